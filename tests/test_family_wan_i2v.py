"""Wan image-to-video (trainer.models.wan_i2v) on tiny random Wan 2.1 I2V (CLIP image embeddings)
and Wan 2.2 I2V-A14B (two experts) models built from their diffusers configs
(tests/wan_i2v_models.py), loaded through from_pretrained: diffusers' own
WanImageToVideoPipeline runs on them; the conditions and the transformer's inputs and output
are those the pipeline's own loop computes for the same first frame, bit for bit; the embedded
engine's rollout is reproducible, steered by the first frame, and replays to its recorded
log-probs bit for bit (ratio == 1), CFG included; Wan 2.2's experts both take the condition;
LoRA wraps the image cross-attention where there is one; bad models, options and image counts
are refused, and preflight refuses SGLang rollouts with the reason."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import flowgrpo_kernels as kernels
from trainer.engine import launch_embedded_engine
from trainer.media import ImageRef
from trainer.models import ADAPTERS, adapter_class
from trainer.models.geometry import Geometry
from trainer.tasks import CONDITIONED_TASKS, GENERATION_TASKS
from wan_i2v_models import WAN22_I2V_BOUNDARY, build_tiny_wan_i2v_dir
from wan_models import TINY_VIDEO, build_tiny_wan_dir

pytestmark = pytest.mark.usefixtures("torch_single_thread")
H, W, F = TINY_VIDEO
GEOMETRY = Geometry(H, W, F)
FAMILY = "wan_i2v"
PROMPTS = ["a red panda walks", "a red panda walks", "waves on a beach", "waves on a beach"]
IDS = [f"prompt:{g}:sample:{s}" for g in (0, 1) for s in (0, 1)]


def picture(root, name, colour, size=(40, 24)) -> ImageRef:
    """A flat-colour PNG with a square of the opposite colour, not at the output's size."""
    pixels = np.full((size[1], size[0], 3), colour, dtype=np.uint8)
    pixels[4:14, 6:16] = (255 - np.array(colour)).astype(np.uint8)
    Image.fromarray(pixels).save(root / f"{name}.png")
    return ImageRef(str(root / f"{name}.png"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_i2v")
    return {v: build_tiny_wan_i2v_dir(v, root) for v in ("wan2.1-i2v", "wan2.2-i2v")}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_frames")
    return {name: picture(root, name, colour) for name, colour in
            (("red", (210, 40, 30)), ("blue", (30, 40, 210)), ("grey", (128, 128, 128)))}


def sampling(**over):
    return {"height": H, "width": W, "num_frames": F, "num_inference_steps": 4, "eta": 0.7,
            "sde_type": "sde", **over}


def test_i2v_is_a_conditioned_task_and_the_family_is_registered_for_it_only():
    assert "i2v" in GENERATION_TASKS and "i2v" in CONDITIONED_TASKS
    cls = adapter_class(FAMILY)
    assert ADAPTERS[FAMILY] == "trainer.models.wan_i2v.WanI2VAdapter"
    assert cls.supported_tasks == ("i2v",) and cls.max_condition_images == 1
    cls.check_task("i2v")
    for task in ("t2v", "edit"):
        with pytest.raises(ValueError):
            cls.check_task(task)


def test_diffusers_wan_image_to_video_pipeline_runs_on_the_tiny_models(model_dir, refs):
    from diffusers import WanImageToVideoPipeline

    for variant, path in model_dir.items():
        pipe = WanImageToVideoPipeline.from_pretrained(path)
        assert (pipe.transformer_2 is not None) == (variant == "wan2.2-i2v")
        assert (pipe.image_encoder is not None) == (variant == "wan2.1-i2v")
        video = pipe(image=refs["red"].open(), prompt="a red panda walks", height=H, width=W,
                     num_frames=F, num_inference_steps=2, guidance_scale=1.0, output_type="pt",
                     generator=torch.Generator().manual_seed(0)).frames
        assert video.shape == (1, F, 3, H, W) and torch.isfinite(video).all()


@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.2-i2v"])
def test_conditions_and_the_forward_are_what_the_pipelines_own_loop_feeds_its_transformer(
        model_dir, refs, variant):
    """The pipeline runs one step from our x_T on the schedule our sigmas come from (its
    scheduler swapped for the flow-match one at the checkpoint's shift, so its first timestep is
    our sigma 1.0 x 1000); what its transformer receives is our recorded conditions, bit for bit,
    and what it returns is our velocity."""
    from diffusers import WanImageToVideoPipeline

    adapter = adapter_class(FAMILY)(str(model_dir[variant]))
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    cond = adapter.encode_conditions(frozen, ["a red panda walks"], [(refs["red"],)], GEOMETRY)
    assert set(cond) == set(adapter.condition_keys)
    assert ("image_embeds" in cond) == (variant == "wan2.1-i2v")
    x_t = adapter.initial_latents(["s0"], GEOMETRY, seed=3)
    pipe = WanImageToVideoPipeline.from_pretrained(model_dir[variant])
    pipe.scheduler = adapter.scheduler
    seen = []
    pipe.transformer.register_forward_hook(lambda m, args, kwargs, out: seen.append((kwargs, out[0])),
                                           with_kwargs=True)
    pipe(image=refs["red"].open(), prompt="a red panda walks", height=H, width=W, num_frames=F,
         num_inference_steps=1, guidance_scale=1.0, latents=x_t.clone(), output_type="latent")
    kwargs, out = seen[0]
    channels = adapter.latent_channels
    assert torch.equal(kwargs["hidden_states"][:, :channels], x_t)
    assert torch.equal(kwargs["hidden_states"][:, channels:], cond["condition_latents"])
    assert torch.equal(kwargs["encoder_hidden_states"], cond["prompt_embeds"])
    if variant == "wan2.1-i2v":
        assert torch.equal(kwargs["encoder_hidden_states_image"], cond["image_embeds"])
    else:
        assert kwargs["encoder_hidden_states_image"] is None
    # the condition: a first-frame mask over the VAE's 4 frames per latent frame, then latents
    mask = cond["condition_latents"][:, :4]
    assert torch.equal(mask[:, :, 0], torch.ones_like(mask[:, :, 0])) and not mask[:, :, 1:].any()
    assert float(kwargs["timestep"][0]) == 1000.0
    with torch.no_grad():
        v = adapter.velocity(adapter.load_train_model(), x_t, torch.tensor([1.0]), cond, GEOMETRY)
    assert torch.equal(v, out)


def test_the_first_frame_latents_are_the_vae_encoding_of_the_resized_frame_then_black_frames(
        model_dir, refs):
    """Independently of prepare_latents: the resized frame and F - 1 black frames through the
    VAE's mode, normalised by its latent statistics."""
    from diffusers import AutoencoderKLWan

    adapter = adapter_class(FAMILY)(str(model_dir["wan2.1-i2v"]))
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    cond = adapter.first_frame_conditions(frozen, refs["blue"], GEOMETRY)
    vae = AutoencoderKLWan.from_pretrained(model_dir["wan2.1-i2v"], subfolder="vae")
    frame = torch.from_numpy(np.array(refs["blue"].open().resize((W, H), Image.LANCZOS))).float()
    frame = (frame / 127.5 - 1).permute(2, 0, 1)[None, :, None]          # [1, 3, 1, H, W] in [-1, 1]
    video = torch.cat([frame, torch.zeros(1, 3, F - 1, H, W)], dim=2)
    with torch.no_grad():
        z = vae.encode(video).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(cond["condition_latents"][:, 4:], (z - mean) / std, rtol=1e-4, atol=1e-4)


def _engine(model_dir, variant, dtype="fp32"):
    return launch_embedded_engine(adapter_path=ADAPTERS[FAMILY], model_path=str(model_dir[variant]),
                                  adapter_options=None, device="cpu", dtype=dtype, lora=None,
                                  in_process=True)


def _replayed_log_probs(adapter, batch, dtype):
    """The actor's replay of every trained step (the CFG velocity where the rollout had CFG)."""
    from trainer.models.guidance import guided_velocity

    transformer = adapter.load_train_model(dtype=dtype)
    steps = []
    with torch.no_grad():
        for s in range(len(batch.sde_indices)):
            x, sigma = batch.latents[:, s], batch.sigmas[:, s]
            v = guided_velocity(adapter, transformer, x, sigma, batch.conditions, batch.geometry,
                                batch.guidance_scale)
            steps.append(kernels.sde_log_prob(x, v, batch.next_latents[:, s], sigma, batch.sigmas_next[:, s],
                                              eta=batch.eta, sde_type=batch.sde_type, backend="torch"))
    return torch.stack(steps, dim=1)


def test_cfg_encodes_each_first_frame_once_and_its_negative_is_the_empty_prompt_with_that_frame(
        model_dir, refs, monkeypatch):
    """Under CFG the engine's negative takes the first frame's conditions from the positive
    (``negative_conditions``) instead of running the CLIP tower and the VAE again: one encode
    per distinct frame and request, and the negative equals encoding the empty prompt with the
    same frames (what the engine did before)."""
    cls = adapter_class(FAMILY)
    encodes = []
    original = cls.first_frame_conditions
    monkeypatch.setattr(cls, "first_frame_conditions",
                        lambda self, frozen, ref, geometry: encodes.append(ref) or original(self, frozen, ref, geometry))
    engine = _engine(model_dir, "wan2.1-i2v")
    images = [(refs["red"],)] * 2 + [(refs["blue"],)] * 2
    try:
        adapter = cls(str(model_dir["wan2.1-i2v"]))
        request = adapter.build_rollout_request(PROMPTS, IDS, sampling(guidance_scale=3.0), rollout_id=1,
                                                seed=9, sde_indices=[1, 2], images=images)
        batch = adapter.pack_trajectory(engine.generate(request), request)
    finally:
        engine.close()
    assert sorted(r.entry for r in encodes) == sorted([refs["red"].entry, refs["blue"].entry])
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    encoded_again = adapter.encode_conditions(frozen, [""] * 4, images, GEOMETRY)
    for key, value in encoded_again.items():
        torch.testing.assert_close(batch.conditions["neg:" + key], value, rtol=0, atol=0)


# Wan 2.2 I2V at 8 steps under shift 5: steps 0-2 are above its expert boundary (sigma >= 0.9)
@pytest.mark.parametrize("variant, dtype, indices, sde_type, steps, guidance", [
    ("wan2.1-i2v", "fp32", [1, 2], "sde", 4, 1.0), ("wan2.1-i2v", "bf16", [0, 2], "dance", 4, 1.0),
    ("wan2.1-i2v", "fp32", [1, 3], "sde", 4, 3.0), ("wan2.2-i2v", "fp32", [1, 2], "sde", 8, 1.0)])
def test_engine_rollout_is_steered_by_the_first_frame_and_replays_to_the_recorded_log_probs(
        model_dir, refs, variant, dtype, indices, sde_type, steps, guidance):
    engine = _engine(model_dir, variant, dtype)
    try:
        adapter = adapter_class(FAMILY)(str(model_dir[variant]))

        def request(first):
            images = [(refs[first],)] * 2 + [(refs["blue"],)] * 2
            table = sampling(num_inference_steps=steps, guidance_scale=guidance, sde_type=sde_type)
            return adapter.build_rollout_request(PROMPTS, IDS, table, rollout_id=1, seed=9,
                                                 sde_indices=indices, images=images)

        red = request("red")
        first, again = engine.generate(red), engine.generate(red)
        lat = first["dit_trajectory"]["latents"]
        assert torch.equal(lat, again["dit_trajectory"]["latents"])
        assert torch.equal(first["images"], again["images"])
        other = engine.generate(request("grey"))["dit_trajectory"]["latents"]
        assert not torch.equal(lat[:2], other[:2]) and torch.equal(lat[2:], other[2:])
        batch = adapter.pack_trajectory(first, red)
    finally:
        engine.close()
    assert batch.sources[0] == (refs["red"],) and batch.sources[3] == (refs["blue"],)
    assert batch.latents.shape == (4, 2, 4, 2, 4, 4)                    # [B, S, C, F', h, w]
    assert batch.conditions["condition_latents"].shape == (4, 8, 2, 4, 4)
    assert batch.images.shape == (4, F, H, W, 3) and batch.images.dtype == torch.uint8
    assert not torch.equal(batch.next_latents[0], batch.next_latents[1])
    if guidance != 1.0:  # the negative: the empty prompt with the same first frame
        assert torch.equal(batch.conditions["neg:condition_latents"], batch.conditions["condition_latents"])
        assert torch.equal(batch.conditions["neg:image_embeds"], batch.conditions["image_embeds"])
        assert not torch.equal(batch.conditions["neg:prompt_embeds"], batch.conditions["prompt_embeds"])
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    assert torch.equal(_replayed_log_probs(adapter, batch, torch_dtype), batch.log_probs)   # ratio == 1


def test_wan22_experts_both_take_the_condition_and_split_at_the_boundary(model_dir, refs):
    from diffusers import WanTransformer3DModel

    path = model_dir["wan2.2-i2v"]
    adapter = adapter_class(FAMILY)(str(path))
    assert adapter.boundary_ratio == WAN22_I2V_BOUNDARY
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    high = adapter.load_train_model()
    low = WanTransformer3DModel.from_pretrained(path, subfolder="transformer_2")
    cond = adapter.encode_conditions(frozen, ["a", "b"], [(refs["red"],), (refs["blue"],)], GEOMETRY)
    x = torch.randn(2, *adapter.latent_shape(GEOMETRY), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.95, 0.5])                                    # one row on each side
    with torch.no_grad():
        mixed = adapter.velocity(high, x, sigma, cond, GEOMETRY)
        want = [model(hidden_states=torch.cat([x[r:r + 1], cond["condition_latents"][r:r + 1]], 1),
                      timestep=sigma[r:r + 1] * 1000, encoder_hidden_states=cond["prompt_embeds"][r:r + 1],
                      return_dict=False)[0] for r, model in ((0, high), (1, low))]
    assert torch.equal(mixed[:1], want[0]) and torch.equal(mixed[1:], want[1])
    low_step = next(i for i, s in enumerate(adapter.scheduler_sigmas(4, GEOMETRY)) if s < WAN22_I2V_BOUNDARY)
    with pytest.raises(ValueError, match="trains its high-noise expert only"):
        adapter.build_rollout_request(PROMPTS, IDS, sampling(sde_type="dance"), rollout_id=0, seed=1,
                                      sde_indices=[low_step], images=[(refs["red"],)] * 4)


@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.2-i2v"])
def test_lora_wraps_the_image_cross_attention_where_there_is_one_and_names_map_to_the_engines(
        model_dir, variant):
    from trainer.models.lora import apply_lora

    adapter = adapter_class(FAMILY)(str(model_dir[variant]))
    model = apply_lora(adapter.load_train_model(), rank=4, alpha=8, target_modules=adapter.lora_target_modules())
    wrapped = sorted(n[:-len(".lora_A.default")] for n, _ in model.named_modules() if n.endswith("lora_A.default"))
    per_block = sorted(n.split("blocks.0.", 1)[1] for n in wrapped if ".blocks.0." in n)
    want = [f"attn{i}.{p}" for i in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")] + ["ffn.net.0.proj",
                                                                                            "ffn.net.2"]
    if variant == "wan2.1-i2v":
        want += ["attn2.add_k_proj", "attn2.add_v_proj"]
    assert per_block == sorted(want)
    assert len(wrapped) == len(per_block) * len(adapter.transformer_blocks(model))
    names = adapter.weight_name_map(n for n, p in model.named_parameters() if p.requires_grad)
    assert ("blocks.1.attn2.add_v_proj.lora_B.weight" in names.values()) == (variant == "wan2.1-i2v")


def test_bad_models_options_and_image_counts_are_refused_naming_each_problem(model_dir, refs, tmp_path):
    t2v = build_tiny_wan_dir("wan2.1", tmp_path)
    with pytest.raises(ValueError, match=r"takes 4 input channels, not the 12 of image-to-video.*WanAdapter"):
        adapter_class(FAMILY)(str(t2v))
    with pytest.raises(ValueError, match="max_sequence_length must be 512 for Wan 2.1 I2V"):
        adapter_class(FAMILY)(str(model_dir["wan2.1-i2v"]), max_sequence_length=16)
    flf2v = tmp_path / "flf2v"                # Wan 2.1 FLF2V's config: two frames' CLIP tokens
    shutil.copytree(model_dir["wan2.1-i2v"], flf2v)
    config = json.loads((flf2v / "transformer" / "config.json").read_text())
    (flf2v / "transformer" / "config.json").write_text(json.dumps({**config, "pos_embed_seq_len": 34}))
    with pytest.raises(ValueError, match="first-and-last-frame model .* is not supported"):
        adapter_class(FAMILY)(str(flf2v))
    # Wan 2.2 has no image tokens to find: a shorter text window is its own choice
    assert adapter_class(FAMILY)(str(model_dir["wan2.2-i2v"]), max_sequence_length=16).condition_keys == (
        "prompt_embeds", "condition_latents")
    adapter = adapter_class(FAMILY)(str(model_dir["wan2.1-i2v"]))
    assert adapter.condition_image_problems([(refs["red"],), (), (refs["red"], refs["blue"])]) == [
        "candidate 1 has 0 images; 'wan_i2v' takes exactly one, the first frame",
        "candidate 2 has 2 images; 'wan_i2v' takes exactly one, the first frame"]
    with pytest.raises(ValueError, match="every candidate needs one image"):
        adapter.build_rollout_request(PROMPTS, IDS, sampling(), rollout_id=0, seed=1, sde_indices=[1])
    with pytest.raises(ValueError, match="encode_conditions"):
        adapter.encode_prompts({}, ["a"])
    assert adapter.forward_flops(GEOMETRY, batch=1, text_tokens=512) is None
    assert adapter_class(FAMILY)(str(model_dir["wan2.2-i2v"])).forward_flops(GEOMETRY, batch=1,
                                                                             text_tokens=8) is not None


def test_preflight_refuses_sglang_rollouts_of_image_to_video_with_the_reason(model_dir):
    """SGLang 0.5.23 has a native Wan image-to-video pipeline, but its stock rollout answer
    leaves out the first frame's condition latents the replay needs (trainer/models/wan_i2v.py;
    the trainer's SGLang extension returns them)."""
    from trainer.config import load_config
    from trainer.config.sections import ConfigError
    from trainer.preflight import preflight

    cfg = load_config("wan2.1-i2v", [f"model.model_path={model_dir['wan2.1-i2v']}", "rollout.engine=sglang",
                                     'rollout.sglang_urls=["http://127.0.0.1:30000"]'])
    with pytest.raises(ConfigError, match=r"model family 'wan_i2v' cannot roll out on stock SGLang: stock SGLang 0.5.23's WanImageToVideoPipeline"):
        preflight(cfg, world_size=8, check_paths=False)


@pytest.mark.parametrize("recipe, model", [("wan2.1-i2v", "Wan2.1-I2V-14B-480P-Diffusers"),
                                           ("wan2.2-i2v", "Wan2.2-I2V-A14B-Diffusers")])
def test_the_memory_plan_counts_the_image_branch_and_the_engines_clip_tower(recipe, model):
    """The published I2V configs (36 input channels; Wan 2.1's image embedder and image
    cross-attention, about 2.1 B parameters over the 14B text-to-video model) and the engine's
    frozen parts, the CLIP vision tower included."""
    from trainer.compute import memory
    from trainer.config import load_config
    from trainer.models.wan import WanAdapter

    plan = memory.plan_for_config(load_config(recipe, []), world=8)
    total = memory.model_params("WanTransformer3DModel", memory.PUBLISHED_BY_MODEL[model])[0]
    t2v = memory.model_params("WanTransformer3DModel", memory.PUBLISHED_BY_MODEL["Wan2.1-T2V-14B-Diffusers"])[0]
    assert f"published config of Wan-AI/{model}" in plan.title
    if "2.1" in model:
        assert 16.0e9 < total < 16.6e9
    else:  # the patch embedding's 20 more input channels, each a (1, 2, 2) kernel per output
        assert total - t2v == 20 * 5120 * 2 * 2
    assert "engine CLIP ViT-H/14 image encoder bf16" in plan.terms
    assert ("engine frozen low-noise expert bf16" in plan.terms) == ("A14B" in model)
    # LoRA on the image cross-attention of Wan 2.1 only (2.2 has none to match)
    lora = memory.model_params("WanTransformer3DModel", memory.PUBLISHED_BY_MODEL[model],
                               adapter_class(FAMILY).lora_targets, lora_rank=4)[1]
    plain = memory.model_params("WanTransformer3DModel", memory.PUBLISHED_BY_MODEL[model],
                                WanAdapter.lora_targets, lora_rank=4)[1]
    assert lora - plain == (40 * 2 * 4 * (5120 + 5120) if "2.1" in model else 0)   # 40 blocks x k, v


def test_the_engine_warms_up_with_a_first_frame_at_the_videos_geometry(model_dir):
    """The warm-up (the compile before the first rollout) encodes a stand-in first frame and
    runs the transformer at the run's frames, with the condition channels."""
    from trainer.engine.embedded.core import EngineCore

    core = EngineCore.load(adapter_path=ADAPTERS[FAMILY], model_path=str(model_dir["wan2.1-i2v"]),
                           adapter_options=None, device="cpu", dtype="fp32", lora=None)
    seen = []
    forward = core.adapter.velocity
    core.adapter.velocity = lambda model, x, sigma, cond, geometry: seen.append(
        (tuple(x.shape), tuple(cond["condition_latents"].shape), tuple(cond["image_embeds"].shape))) or forward(
        model, x, sigma, cond, geometry)
    try:
        core.warm_up(height=H, width=W, batch=2, frames=F)
    finally:
        core.close()
    assert seen and all(shapes == ((2, 4, 2, 4, 4), (2, 8, 2, 4, 4), (2, 17, 8)) for shapes in seen)
