"""The config-only FLOP counts (trainer.compute.flops) against a hand count and against
torch's FlopCounterMode over a real forward of tiny diffusers transformers built from config.

FlopCounterMode counts matmuls, convolutions and attention (here through SDPA's math path,
whose Q K^T and A V are bmm's it counts); it leaves out elementwise work (norms, modulation,
activations, softmax, rotary), biases and the sinusoidal timestep features, exactly what the
count leaves out, so the two must agree to the FLOP."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from trainer.compute import flops
from trainer.models.geometry import Geometry

QWEN = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6))
SD3 = dict(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=3,
           attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
           caption_projection_dim=16, pooled_projection_dim=10, pos_embed_max_size=16,
           dual_attention_layers=(0,), qk_norm="rms_norm")
FLUX = dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=10,
            guidance_embeds=True, axes_dims_rope=(4, 6, 6))


def counted(model, **inputs) -> int:
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(**inputs, return_dict=False)
    return fc.get_total_flops()


def qwen_inputs(batch, h, w, text):
    return dict(hidden_states=torch.randn(batch, h * w, 16), timestep=torch.rand(batch),
                encoder_hidden_states=torch.randn(batch, text, 24),
                encoder_hidden_states_mask=torch.ones(batch, text, dtype=torch.long),
                img_shapes=[[(1, h, w)]] * batch)


def test_qwen_image_count_equals_flop_counter_mode_over_a_real_forward():
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**QWEN).eval()
    batch, h, w, text = 3, 4, 6, 7
    ours = flops.transformer_forward("QwenImageTransformer2DModel", model.config,
                                     image_tokens=h * w, text_tokens=text, batch=batch)
    assert ours.total == counted(model, **qwen_inputs(batch, h, w, text))


def test_sd3_count_with_a_dual_attention_layer_and_a_context_pre_only_block_equals_flop_counter():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**SD3).eval()
    batch, h, w, text = 2, 8, 6, 5
    got = counted(model, hidden_states=torch.randn(batch, 4, h, w), timestep=torch.rand(batch) * 1000,
                  encoder_hidden_states=torch.randn(batch, text, 12),
                  pooled_projections=torch.randn(batch, 10))
    ours = flops.transformer_forward("SD3Transformer2DModel", model.config,
                                     image_tokens=(h // 2) * (w // 2), text_tokens=text, batch=batch)
    assert ours.total == got


def test_flux_count_with_guidance_embedding_and_single_blocks_equals_flop_counter():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**FLUX).eval()
    batch, h, w, text = 2, 3, 4, 5
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(h).float(), torch.arange(w).float(),
                                         indexing="ij"), -1).reshape(-1, 3).float()
    got = counted(model, hidden_states=torch.randn(batch, h * w, 8), timestep=torch.rand(batch),
                  guidance=torch.full((batch,), 3.5), encoder_hidden_states=torch.randn(batch, text, 12),
                  pooled_projections=torch.randn(batch, 10), txt_ids=torch.zeros(text, 3), img_ids=img_ids)
    ours = flops.transformer_forward("FluxTransformer2DModel", model.config,
                                     image_tokens=h * w, text_tokens=text, batch=batch)
    assert ours.total == got


def test_qwen_image_count_equals_a_hand_count_of_one_block():
    # one block, d = 4, no text: by hand, per image token 4 projections 2*4*4 = 128 and the MLP
    # 2*4*16 * 2 = 256; in 2*2*4 = 32, out 2*4*4 = 32; per sample time 2*256*4 + 2*4*4 = 2080,
    # modulation 2 * 2*4*24 = 384, norm_out 2*4*8 = 64; attention 4 * L^2 * d = 4*9*4 = 144
    cfg = dict(QWEN, num_layers=1, attention_head_dim=2, num_attention_heads=2, in_channels=4,
               out_channels=1, joint_attention_dim=5)
    count = flops.transformer_forward("QwenImageTransformer2DModel", cfg, image_tokens=3,
                                      text_tokens=0, batch=2)
    assert count.linear == 2 * (2080 + 384 + 64 + 3 * (128 + 256 + 32 + 32))
    assert count.attention == 2 * 144


def test_an_uncounted_transformer_class_is_refused_by_name():
    with pytest.raises(ValueError, match="CogVideoXTransformer3DModel"):
        flops.transformer_forward("CogVideoXTransformer3DModel", {}, image_tokens=1, text_tokens=1)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from tests.tiny_models import FAMILIES, build_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny")
    return {family: build_tiny_model_dir(family, root) for family in FAMILIES}


def adapter_of(family, tiny_dirs):
    from tests.tiny_models import ADAPTER_PATHS
    from trainer.utils.values import import_dotpath

    return import_dotpath(ADAPTER_PATHS[family])(str(tiny_dirs[family]))


@pytest.mark.parametrize("family", ["qwen_image", "sd3", "flux", "toy"])
def test_each_adapter_states_the_flops_of_its_own_velocity_forward(family, tiny_dirs):
    """The adapter's count (geometry -> tokens, Qwen-Image's text padding included) equals
    FlopCounterMode over ``velocity`` itself: what the engine and the replay run."""
    if family == "toy":
        from trainer.toy.adapter import ToyAdapter

        adapter = ToyAdapter()
        height = width = adapter.resolution
    else:
        adapter = adapter_of(family, tiny_dirs)
        height, width = 64, 96
    model = adapter.load_train_model().eval()
    batch, text = 2, 5 if family != "toy" else adapter.max_sequence_length
    joint = int(adapter.transformer_config["joint_attention_dim"])
    cond = {"prompt_embeds": torch.randn(batch, text, joint),
            "prompt_embeds_mask": torch.ones(batch, text, dtype=torch.long),
            "pooled_prompt_embeds": torch.randn(
                batch, int(adapter.transformer_config.get("pooled_projection_dim") or 1))}
    cond = {k: cond[k] for k in adapter.condition_keys}
    latents = adapter.initial_latents([f"s{i}" for i in range(batch)], Geometry(height, width), seed=0)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        adapter.velocity(model, latents, torch.full((batch,), 0.5), cond, Geometry(height, width))
    stated = adapter.forward_flops(Geometry(height, width), batch=batch, text_tokens=text)
    assert stated.total == fc.get_total_flops()
