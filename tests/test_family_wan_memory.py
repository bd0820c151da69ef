"""Wan's rows of the config-only memory plan (trainer.compute.memory): activations against the
bytes autograd really saves on tiny WanTransformer3DModels (fp32, and bf16 with Wan's fp32
norms and modulation), parameters against the built model and peft's adapter, the frozen
low-noise expert of Wan 2.2 A14B in the engine, and the plan ``--dry-run`` prints for each
published Wan model at the 480 x 832 x 81-frame geometry, with and without sequence parallelism."""
from __future__ import annotations

import pytest
import torch

from trainer.compute import memory
from test_compute_memory import FACTOR, saved_bytes

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=32, ffn_dim=96, num_layers=3, rope_max_seq_len=64)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("frames, text", [(2, 10), (3, 24)])
def test_planned_wan_activations_are_within_the_stated_factor_of_the_saved_tensor_bytes(dtype, frames, text):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY).to(dtype)
    inputs = dict(hidden_states=torch.randn(2, 4, frames, 8, 8, dtype=dtype), timestep=torch.rand(2) * 1000,
                  encoder_hidden_states=torch.randn(2, text, 16, dtype=dtype))
    measured = saved_bytes(model, inputs)
    video_tokens = frames * 4 * 4
    nbytes = torch.finfo(dtype).bits // 8
    planned = 2 * nbytes * memory.activation_elements(
        "WanTransformer3DModel", model.config, image_tokens=video_tokens, text_tokens=text,
        checkpointing=False, compute_bytes=nbytes)
    assert measured / FACTOR <= planned <= measured * FACTOR, (planned, measured)


def test_planned_wan_parameters_equal_the_built_model_and_lora_equals_peft_on_the_adapters_targets():
    from diffusers import WanTransformer3DModel
    from peft import LoraConfig, get_peft_model

    from trainer.models.wan import WanAdapter

    total, lora = memory.model_params("WanTransformer3DModel", TINY, WanAdapter.lora_targets, lora_rank=4)
    model = WanTransformer3DModel(**TINY)
    assert total == sum(p.numel() for p in model.parameters())
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(WanAdapter.lora_targets)))
    assert lora == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_published_wan_sizes_are_the_model_cards():
    counts = {name: memory.model_params("WanTransformer3DModel", cfg)[0] / 1e9
              for name, cfg in memory.PUBLISHED_BY_MODEL.items()}
    assert 1.3 < counts["Wan2.1-T2V-1.3B-Diffusers"] < 1.5
    assert 13.5 < counts["Wan2.1-T2V-14B-Diffusers"] < 14.5
    assert counts["Wan2.2-T2V-A14B-Diffusers"] == counts["Wan2.1-T2V-14B-Diffusers"]  # per expert
    assert 4.5 < counts["Wan2.2-TI2V-5B-Diffusers"] < 5.5


MODELS = {"Wan2.1-T2V-1.3B-Diffusers": "wan2.1-t2v", "Wan2.1-T2V-14B-Diffusers": "wan2.1-t2v",
          "Wan2.2-T2V-A14B-Diffusers": "wan2.2-t2v", "Wan2.2-TI2V-5B-Diffusers": "wan2.1-t2v"}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_dry_run_prints_each_published_wan_models_plan_at_480x832x81(model, capsys):
    from trainer.config import load_config
    from trainer.launch import main

    sets = [f"model.model_path=/models/{model}", "rollout.sampling.num_frames=81"]
    main(["--config", MODELS[model], "--dry-run", "--nproc", "8", *sum((["--set", s] for s in sets), [])])
    out = capsys.readouterr().out
    assert "# memory plan per GPU" in out and f"published config of Wan-AI/{model}" in out
    assert "sequence parallel x8" in out
    plan = memory.plan_for_config(load_config(MODELS[model], sets), world=8)
    side = 32 if "5B" in model else 16
    assert plan.title.split(" image")[0].endswith(str(21 * (480 // side) * (832 // side)))  # 21 latent frames
    assert ("engine frozen low-noise expert bf16" in plan.terms) == ("A14B" in model)
    assert "engine UMT5-XXL text encoder bf16" in plan.terms
    # sequence parallelism divides the activations: more rows fit with every doubling
    rows = [plan.max_rows(sp=sp, checkpointing=True) for sp in (1, 2, 4, 8)]
    assert rows == sorted(rows) and rows[-1] >= 2 * rows[0]
    # 81 frames of the 14B models do not fit one row without activation checkpointing or SP
    if "14B" in model:
        assert plan.max_rows(sp=1, checkpointing=False) == 0


def test_wan_flop_count_equals_flop_counter_mode_over_a_real_forward_and_the_adapter_states_it(tmp_path):
    """FlopCounterMode over SDPA's math path counts what the count counts (tests/test_compute_flops.py
    says what that is); the adapter's ``forward_flops`` is the same count at its video tokens."""
    from diffusers import WanTransformer3DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.compute import flops
    from trainer.models.geometry import Geometry
    from trainer.models.wan import WanAdapter
    from wan_models import build_tiny_wan_dir

    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY).eval()
    batch, frames, h, w, text = 2, 3, 8, 6, 7
    inputs = dict(hidden_states=torch.randn(batch, 4, frames, h, w), timestep=torch.rand(batch) * 1000,
                  encoder_hidden_states=torch.randn(batch, text, 16))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(**inputs, return_dict=False)
    ours = flops.transformer_forward("WanTransformer3DModel", model.config,
                                     image_tokens=frames * (h // 2) * (w // 2), text_tokens=text, batch=batch)
    assert ours.total == fc.get_total_flops()
    adapter = WanAdapter(str(build_tiny_wan_dir("wan2.1", tmp_path)))
    geometry = Geometry(32, 48, 9)                                   # 3 latent frames of 4 x 6
    stated = adapter.forward_flops(geometry, batch=2, text_tokens=5)
    assert stated == flops.transformer_forward("WanTransformer3DModel", adapter.transformer_config,
                                               image_tokens=3 * 2 * 3, text_tokens=5, batch=2)
