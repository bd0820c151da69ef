"""The Wan family (trainer.models.wan) on tiny random Wan 2.1 and Wan 2.2 (two experts) models
built from their diffusers configs (tests/wan_models.py), loaded through from_pretrained:
diffusers' own WanPipeline runs on them; the embedded engine's rollout of 3-D latents replays
to the recorded log-probs bit for bit on the CPU (ratio == 1); the schedule, the latent
geometry and the decoded video follow the pipeline; Wan 2.2's experts split at the boundary."""
from __future__ import annotations

import pytest
import torch

import flowgrpo_kernels as kernels
from trainer.engine import launch_embedded_engine
from trainer.models import adapter_class
from trainer.models.geometry import Geometry
from wan_models import TINY_VIDEO, WAN22_BOUNDARY, build_tiny_wan_dir

pytestmark = pytest.mark.usefixtures("torch_single_thread")
H, W, F = TINY_VIDEO
PROMPTS = ["a red panda", "a red panda", "a bowl of fruit on a table", "a bowl of fruit on a table"]
IDS = [f"prompt:{g}:sample:{s}" for g in (0, 1) for s in (0, 1)]
ADAPTER = "trainer.models.wan.WanAdapter"
OPTIONS = {"max_sequence_length": 16}


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    return {v: build_tiny_wan_dir(v, root) for v in ("wan2.1", "wan2.2")}


def sampling(**over):
    return {"height": H, "width": W, "num_frames": F, "num_inference_steps": 4, "eta": 0.7,
            "sde_type": "sde", **over}


def test_diffusers_wan_pipeline_generates_video_from_the_tiny_models(wan_dir):
    from diffusers import WanPipeline

    for variant, path in wan_dir.items():
        pipe = WanPipeline.from_pretrained(path)
        assert (pipe.transformer_2 is not None) == (variant == "wan2.2")
        video = pipe(prompt="a red panda", height=H, width=W, num_frames=F, num_inference_steps=2,
                     guidance_scale=1.0, output_type="pt", max_sequence_length=16).frames
        assert video.shape == (1, F, 3, H, W) and torch.isfinite(video).all()


def test_latent_geometry_schedule_and_refusals_follow_the_pipeline(wan_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    adapter = adapter_class("wan")(str(wan_dir["wan2.1"]), **OPTIONS)
    pipe = WanPipeline.from_pretrained(wan_dir["wan2.1"])
    want = pipe.prepare_latents(1, 4, H, W, F, torch.float32, "cpu", torch.Generator().manual_seed(0)).shape
    assert (1, *adapter.latent_shape(Geometry(H, W, F))) == tuple(want) == (1, 4, 2, 4, 4)
    assert adapter.image_tokens(Geometry(H, W, F)) == 2 * 2 * 2
    sigmas = adapter.scheduler_sigmas(4, Geometry(H, W, F))
    reference = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    reference.set_timesteps(4)
    assert torch.equal(sigmas, reference.sigmas.float()) and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    problems = adapter.resolution_problems(Geometry(40, 32, 6))
    assert len(problems) == 2 and "frames - 1" in problems[0] and "multiples of 16" in problems[1]
    with pytest.raises(ValueError, match="frames - 1 must be a multiple of 4"):
        adapter.build_rollout_request(PROMPTS, IDS, sampling(num_frames=4), rollout_id=0, seed=1,
                                      sde_indices=[1])


def _rollout(variant, wan_dir, dtype, sde_indices, sde_type="sde", steps=4):
    engine = launch_embedded_engine(adapter_path=ADAPTER, model_path=str(wan_dir[variant]),
                                    adapter_options=OPTIONS, device="cpu", dtype=dtype, lora=None,
                                    in_process=True)
    try:
        adapter = adapter_class(ADAPTER)(str(wan_dir[variant]), **OPTIONS)
        request = adapter.build_rollout_request(PROMPTS, IDS, sampling(sde_type=sde_type, num_inference_steps=steps),
                                                rollout_id=1,
                                                seed=9, sde_indices=sde_indices)
        return adapter, adapter.pack_trajectory(engine.generate(request), request)
    finally:
        engine.close()


# Wan 2.2 at 8 steps: steps 0-2 are above its expert boundary (sigma >= 0.875 under shift 3)
@pytest.mark.parametrize("variant, dtype, indices, sde_type, steps", [
    ("wan2.1", "fp32", [0, 2], "dance", 4), ("wan2.1", "bf16", [1, 2], "sde", 4),
    ("wan2.2", "fp32", [1, 2], "sde", 8)])
def test_engine_rollout_of_video_latents_replays_to_the_recorded_log_probs(wan_dir, variant, dtype,
                                                                           indices, sde_type, steps):
    adapter, batch = _rollout(variant, wan_dir, dtype, indices, sde_type, steps)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    assert batch.geometry == Geometry(H, W, F)
    assert batch.latents.shape == (4, 2, 4, 2, 4, 4)                    # [B, S, C, F', h, w]
    assert batch.images.shape == (4, F, H, W, 3) and batch.images.dtype == torch.uint8
    assert not torch.equal(batch.next_latents[0], batch.next_latents[1])
    transformer = adapter.load_train_model(dtype=torch_dtype)
    with torch.no_grad():
        replayed = torch.stack([
            kernels.sde_log_prob(batch.latents[:, s], adapter.replay_velocity(transformer, batch, s),
                                 batch.next_latents[:, s], batch.sigmas[:, s], batch.sigmas_next[:, s],
                                 eta=batch.eta, sde_type=batch.sde_type, backend="torch")
            for s in range(len(batch.sde_indices))], dim=1)
    assert torch.equal(replayed, batch.log_probs)                       # ratio == 1 exactly


def test_decoded_video_is_the_pipelines_decode_of_the_same_latents(wan_dir):
    from diffusers import WanPipeline

    adapter = adapter_class("wan")(str(wan_dir["wan2.1"]), **OPTIONS)
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    latents = torch.randn(2, *adapter.latent_shape(Geometry(H, W, F)), generator=torch.Generator().manual_seed(3))
    ours = adapter.decode(frozen, latents, Geometry(H, W, F))
    pipe = WanPipeline.from_pretrained(wan_dir["wan2.1"])
    vae = pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        decoded = vae.decode(latents / std + mean, return_dict=False)[0]
    video = pipe.video_processor.postprocess_video(decoded, output_type="np")
    assert ours.shape == (2, F, H, W, 3)
    assert torch.equal(ours, torch.from_numpy(video * 255).round().clamp(0, 255).to(torch.uint8))


def test_wan22_experts_split_at_the_boundary_and_low_noise_training_is_refused(wan_dir):
    from diffusers import WanTransformer3DModel

    adapter = adapter_class("wan")(str(wan_dir["wan2.2"]), **OPTIONS)
    assert adapter.boundary_ratio == WAN22_BOUNDARY
    assert adapter_class("wan")(str(wan_dir["wan2.1"]), **OPTIONS).boundary_ratio is None
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    high = adapter.load_train_model()
    low = WanTransformer3DModel.from_pretrained(wan_dir["wan2.2"], subfolder="transformer_2")
    geometry = Geometry(H, W, F)
    x = torch.randn(2, *adapter.latent_shape(geometry), generator=torch.Generator().manual_seed(0))
    cond = adapter.encode_prompts(frozen, PROMPTS[1:3])
    sigma = torch.tensor([0.95, 0.5])                                   # one row on each side
    with torch.no_grad():
        mixed = adapter.velocity(high, x, sigma, cond, geometry)
        want_high = high(hidden_states=x[:1], timestep=sigma[:1] * 1000,
                         encoder_hidden_states=cond["prompt_embeds"][:1], return_dict=False)[0]
        want_low = low(hidden_states=x[1:], timestep=sigma[1:] * 1000,
                       encoder_hidden_states=cond["prompt_embeds"][1:], return_dict=False)[0]
    assert torch.equal(mixed[:1], want_high) and torch.equal(mixed[1:], want_low)
    sigmas = adapter.scheduler_sigmas(4, geometry)
    low_steps = [i for i in range(4) if sigmas[i] < WAN22_BOUNDARY]
    assert low_steps and low_steps[0] > 0
    with pytest.raises(ValueError, match=rf"trained steps \[{low_steps[0]}\] have sigma below the boundary"):
        adapter.build_rollout_request(PROMPTS, IDS, sampling(sde_type="dance"), rollout_id=0, seed=1,
                                      sde_indices=[0, low_steps[0]])
    fresh = adapter_class("wan")(str(wan_dir["wan2.2"]), **OPTIONS)  # an actor: no frozen expert
    with pytest.raises(ValueError, match="low-noise expert"):
        fresh.velocity(high, x, torch.tensor([0.3, 0.3]), cond, geometry)


def test_lora_targets_every_attention_projection_and_the_mlp_and_names_map_to_the_engines(wan_dir):
    from trainer.models.lora import apply_lora

    adapter = adapter_class("wan")(str(wan_dir["wan2.1"]), **OPTIONS)
    model = apply_lora(adapter.load_train_model(), rank=4, alpha=8,
                       target_modules=adapter.lora_target_modules())
    wrapped = sorted(n[:-len(".lora_A.default")] for n, _ in model.named_modules() if n.endswith("lora_A.default"))
    per_block = sorted(n.split("blocks.0.", 1)[1] for n in wrapped if ".blocks.0." in n)
    assert per_block == sorted([f"attn{i}.{p}" for i in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")]
                               + ["ffn.net.0.proj", "ffn.net.2"])
    assert len(wrapped) == len(per_block) * len(adapter.transformer_blocks(model))
    names = adapter.weight_name_map(n for n, p in model.named_parameters() if p.requires_grad)
    assert "blocks.1.attn2.to_k.lora_A.weight" in names.values()


def test_preflight_takes_wan_on_sglang_rollouts_and_names_what_stock_sglang_lacks(wan_dir):
    """SGLang 0.5.23 rolls Wan 2.1 and 2.2 out with its native WanPipeline
    (tests/test_sglang_wan.py): the recipes pass preflight on SGLang servers with the extension;
    on stock servers the driver's sigmas and x_T are named, the family is not."""
    import json

    from trainer.config import load_config
    from trainer.config.sections import ConfigError
    from trainer.preflight import preflight

    urls = json.dumps([f"http://127.0.0.1:{30000 + rank}" for rank in range(8)])
    for variant, recipe in (("wan2.1", "wan2.1-t2v"), ("wan2.2", "wan2.2-t2v")):
        base = [f"model.model_path={wan_dir[variant]}", "rollout.engine=sglang",
                f"rollout.sglang_urls={urls}"]
        with pytest.raises(ConfigError) as info:
            preflight(load_config(recipe, base), world_size=8, check_paths=False)
        assert "sampling.driver_sigmas is on" in str(info.value)
        assert "model family" not in str(info.value)
        preflight(load_config(recipe, base + ["rollout.sglang_extension=true"]), world_size=8,
                  check_paths=False)


def test_the_engine_warms_up_at_the_videos_frame_count(wan_dir):
    """The warm-up (the compile before the first rollout) runs the transformer at the run's
    geometry: for video, its frames, not a single frame."""
    from trainer.engine.embedded.core import EngineCore

    core = EngineCore.load(adapter_path=ADAPTER, model_path=str(wan_dir["wan2.1"]), adapter_options=OPTIONS,
                           device="cpu", dtype="fp32", lora=None)
    seen = []
    forward = core.adapter.velocity
    core.adapter.velocity = lambda model, x, *args: seen.append(tuple(x.shape)) or forward(model, x, *args)
    try:
        core.warm_up(height=H, width=W, batch=2, frames=F)
    finally:
        core.close()
    assert seen and all(shape == (2, 4, 2, 4, 4) for shape in seen)   # 5 frames: 2 latent frames
    from trainer.config import load_config
    from trainer.rollout.service import engine_warmup

    rollout = load_config("wan2.1-t2v", []).rollout
    assert engine_warmup(rollout, "blocks", torch.device("cpu"))["frames"] == 33   # the recipe's
    image = load_config("sd3-t2i-lora", []).rollout
    assert "frames" not in engine_warmup(image, "blocks", torch.device("cpu"))   # images unchanged
