"""The adapters in bf16 on a CUDA device (skipped without one).

Same oracles as the CPU tests, where the dtype and device handling actually matters: the
pipeline's timestep rounding to bf16, the casts of fp32 conditions, ids built on the device.
Needs diffusers, transformers, tokenizers; SD3 and FLUX also open_clip_torch (their tiny CLIP
tokenizer takes its vocabulary from it), so a machine without it still runs the Qwen-Image cases.
"""
from __future__ import annotations

import pytest
import torch

from trainer.models.geometry import Geometry

pytest.importorskip("transformers")

from test_models_adapters import (PROMPTS, _pipeline_kwargs, _pipeline_with,  # noqa: E402
                                  as_the_pipeline_runs)
from test_models_rollout import serve  # noqa: E402
from tiny_models import FAMILIES, TINY_HEIGHT, TINY_WIDTH  # noqa: E402
from trainer.models import adapter_class  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
H, W = TINY_HEIGHT, TINY_WIDTH


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_cuda_ode_sampling_equals_the_diffusers_pipeline(family, tiny_model_dir):
    if family != "qwen_image":
        pytest.importorskip("open_clip")
    adapter = as_the_pipeline_runs(adapter_class(family)(str(tiny_model_dir(family))))
    frozen = adapter.load_frozen(device="cuda", dtype=torch.bfloat16)
    transformer = adapter.load_train_model(dtype=torch.bfloat16, device="cuda")
    cond = adapter.encode_prompts(frozen, PROMPTS)
    x_t = adapter.initial_latents(["a", "b"], Geometry(H, W), seed=5, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(x_t.cpu(), adapter.initial_latents(["a", "b"], Geometry(H, W), seed=5, dtype=torch.bfloat16))
    steps = 4
    sigmas = adapter.scheduler_sigmas(steps, Geometry(H, W)).cuda()
    x = x_t.clone()
    with torch.no_grad():
        for i in range(steps):  # the scheduler's step as it is written: dt * v stays bf16
            v = adapter.velocity(transformer, x, sigmas[i].expand(2), cond, Geometry(H, W))
            x = (x.float() + (sigmas[i + 1] - sigmas[i]) * v).to(torch.bfloat16)
    expected = _pipeline_with(frozen, transformer)(
        **_pipeline_kwargs(family, adapter, cond, x_t, steps), output_type="latent").images
    assert torch.equal(x, expected)


def test_bf16_cuda_rollout_replays_to_the_recorded_log_probs(tiny_model_dir):
    """Sampled with kernels.sde_step, replayed with kernels.sde_log_prob (default backend)."""
    import flowgrpo_kernels as kernels

    adapter = adapter_class("qwen_image")(str(tiny_model_dir("qwen_image")))
    frozen = adapter.load_frozen(device="cuda", dtype=torch.bfloat16)
    transformer = adapter.load_train_model(dtype=torch.bfloat16, device="cuda")
    ids = ["prompt:0:sample:0", "prompt:0:sample:1"]
    request = adapter.build_rollout_request(["a red cat"] * 2, ids, {"height": H, "width": W,
                                            "num_inference_steps": 4}, rollout_id=0, seed=3,
                                            sde_indices=[1, 2])
    batch = adapter.pack_trajectory(serve(adapter, frozen, transformer, request, device="cuda",
                                          dtype=torch.bfloat16, backend="auto"), request)
    with torch.no_grad():
        replayed = torch.stack([
            kernels.sde_log_prob(batch.latents[:, s], adapter.replay_velocity(transformer, batch, s),
                                 batch.next_latents[:, s], batch.sigmas[:, s].cuda(),
                                 batch.sigmas_next[:, s].cuda(), eta=batch.eta, sde_type=batch.sde_type)
            for s in range(2)], dim=1)
    assert torch.equal(replayed, batch.log_probs)


def test_compiled_qwen_blocks_compile_once_across_text_lengths_and_alignments(tiny_model_dir):
    """Inductor guards the attention inputs' alignment to 8, so without the adapter's padding
    an unaligned text length after an aligned one compiles the blocks again (CUDA only: the
    CPU lowering has no such guard). With it, every length runs the first graphs."""
    from trainer.models.compile import compile_blocks, compile_events

    torch._dynamo.reset()
    adapter = adapter_class("qwen_image")(str(tiny_model_dir("qwen_image")))
    model = adapter.load_train_model(dtype=torch.bfloat16, device="cuda")
    compile_blocks(adapter.transformer_blocks(model), adapter.block_dynamic_dims)
    x = adapter.initial_latents(["a", "b"], Geometry(H, W), seed=1, dtype=torch.bfloat16, device="cuda")
    joint = adapter.transformer_config["joint_attention_dim"]
    aligned = 24 - x.shape[1] % 8  # image + text tokens a multiple of 8 without padding
    compiles = []
    for length in (aligned, aligned + 1, aligned + 11, aligned + 24):
        cond = {"prompt_embeds": torch.randn(2, length, joint, device="cuda", dtype=torch.bfloat16),
                "prompt_embeds_mask": torch.ones(2, length, dtype=torch.long, device="cuda")}
        before = compile_events()
        v = adapter.velocity(model, x, torch.tensor([0.7, 0.3], device="cuda"), cond, Geometry(H, W))
        v.float().square().mean().backward()  # the actor's replay: forward and backward
        compiles.append(compile_events() - before)
    assert compiles[0] >= 1 and compiles[1:] == [0, 0, 0], compiles
