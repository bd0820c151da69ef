"""The config-only memory plan (trainer.compute.memory): parameters against the built model
and peft's adapter, activations against the bytes autograd really saves (saved_tensors_hooks
on tiny diffusers transformers, CPU), and the plan printed by --dry-run for the shipped recipes."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.compute import memory
from tests.test_compute_flops import FLUX, QWEN, SD3, qwen_inputs

#: The activation model against measurement: within this factor either way. It is a count of
#: the block's saved tensors, not a fit to these shapes (other widths and depths than the
#: module docstring's enumeration); the embedding and output layers it leaves out are inside it.
FACTOR = 1.1


def saved_bytes(model, inputs) -> int:
    """Bytes autograd keeps for the backward: the largest saved view of each storage, counted
    once (a view of a cached table, such as the rotary frequencies, costs its view), the
    parameters (which the matmuls save too, but the plan counts as weights) left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = max(seen.get(ptr, 0), t.numel() * t.element_size())
        return t

    # flash attention saves q, k, v, out and the log-sum-exp, no L x L matrix: as on the GPU
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs, return_dict=False)
    return sum(seen.values())


def _flux_inputs(batch, h, w, text):
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(h).float(), torch.arange(w).float(),
                                     indexing="ij"), -1).reshape(-1, 3)
    return dict(hidden_states=torch.randn(batch, h * w, 8), timestep=torch.rand(batch),
                guidance=torch.full((batch,), 3.5), encoder_hidden_states=torch.randn(batch, text, 12),
                pooled_projections=torch.randn(batch, 10), txt_ids=torch.zeros(text, 3), img_ids=ids)


CASES = {
    "QwenImageTransformer2DModel": (dict(QWEN, num_layers=3, attention_head_dim=48,
                                         axes_dims_rope=(16, 16, 16)), 64, 10,
                                    lambda: qwen_inputs(2, 8, 8, 10)),
    "SD3Transformer2DModel": (dict(SD3, num_layers=3, attention_head_dim=48, caption_projection_dim=96,
                                   dual_attention_layers=(0, 1)), 64, 10,
                              lambda: dict(hidden_states=torch.randn(2, 4, 16, 16), timestep=torch.rand(2),
                                           encoder_hidden_states=torch.randn(2, 10, 12),
                                           pooled_projections=torch.randn(2, 10))),
    "FluxTransformer2DModel": (dict(FLUX, num_layers=2, num_single_layers=3, attention_head_dim=48,
                                    axes_dims_rope=(16, 16, 16)), 64, 10,
                               lambda: _flux_inputs(2, 8, 8, 10)),
}


@pytest.mark.parametrize("cls_name", sorted(CASES))
def test_planned_activations_are_within_the_stated_factor_of_the_saved_tensor_bytes(cls_name):
    import diffusers

    cfg, image, text, inputs = CASES[cls_name]
    torch.manual_seed(0)
    model = getattr(diffusers, cls_name)(**cfg)
    measured = saved_bytes(model, inputs())
    planned = 2 * 4 * memory.activation_elements(cls_name, model.config, image_tokens=image,
                                                 text_tokens=text, checkpointing=False)
    assert measured / FACTOR <= planned <= measured * FACTOR, (planned, measured)


def test_planned_parameters_equal_the_built_model_and_lora_equals_peft_on_the_adapters_targets():
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig, get_peft_model

    from trainer.models.qwen_image import QwenImageAdapter

    cfg = dict(QWEN, num_layers=3)
    total, lora = memory.model_params("QwenImageTransformer2DModel", cfg,
                                      QwenImageAdapter.lora_targets, lora_rank=4)
    model = QwenImageTransformer2DModel(**cfg)
    assert total == sum(p.numel() for p in model.parameters())
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                  target_modules=list(QwenImageAdapter.lora_targets)))
    assert lora == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_checkpointing_keeps_one_block_input_per_block_plus_one_blocks_full_set():
    cfg = dict(QWEN, num_layers=4)
    inner = 2 * 16
    off = memory.activation_elements("QwenImageTransformer2DModel", cfg, image_tokens=6,
                                     text_tokens=2, checkpointing=False)
    on = memory.activation_elements("QwenImageTransformer2DModel", cfg, image_tokens=6,
                                    text_tokens=2, checkpointing=True)
    assert off == 4 * 26 * 8 * inner and on == (4 * 8 + 26 * 8) * inner


def test_sequence_parallel_divides_activations_and_the_full_qwen_recipe_does_not_fit_one_gpu():
    from trainer.config import load_config

    full = memory.plan_for_config(load_config("qwen-image-t2i-full", []), world=1)
    assert full.total(sp=1, rows=1) > memory.H200_GB * memory.GB  # 20 B params x 16 bytes
    act = full.activations[False]
    assert full.total(sp=4, rows=8) == pytest.approx(sum(full.terms.values()) + 8 * act / 4)
    lora = memory.plan_for_config(load_config("qwen-image-t2i-lora", []), world=8)
    assert lora.max_rows() >= 1 and "engine transformer bf16" in lora.terms
    # sharing the base: the engine's 2P go, the actor's shard grows from 2P / 8 to 2P
    params = lora.terms["engine transformer bf16"] / 2
    assert lora.shared_base_saving == pytest.approx(2 * params / 8)
    assert full.shared_base_saving == 0.0  # full training: the engine's copy differs


@pytest.mark.parametrize("recipe", ["qwen-image-t2i-lora", "qwen-image-t2i-full", "sd3-flowgrpo",
                                    "sd3-t2i-lora", "flux-t2i-lora"])
def test_dry_run_prints_the_memory_plan_of_each_shipped_recipe(recipe, capsys):
    from trainer.launch import main

    main(["--config", recipe, "--dry-run", "--nproc", "8"])  # placeholder paths: rc 2, plan printed
    out = capsys.readouterr().out
    assert "# memory plan per GPU" in out and "published config of" in out
    assert "sequence parallel x8" in out and ("fits" in out or "does NOT fit" in out)
