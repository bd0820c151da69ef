"""Wan 2.1 I2V and Wan 2.2 I2V-A14B served by SGLang's own native ``WanImageToVideoPipeline``
(sglang==0.5.23), on CPU.

tests/sglang_fixtures.py serves the tiny checkpoints (tests/wan_i2v_models.py) as a user serves
the published ones (``--model-id Wan2.1-I2V-14B-480P-Diffusers`` / ``Wan2.2-I2V-A14B-Diffusers``):
SGLang's native Wan DiT, its text and CLIP image encoding, its image VAE stage, latent and
timestep preparation, the denoising stage with the rollout hooks, decoding; the first frame
travels as a file in SGLang's ``RolloutRequest.image_path``.

- Stock: the answer holds the video, the trajectory and the frame's CLIP and prompt
  embeddings (equal to what our adapter encodes), but not the first frame's condition
  latents, so the replay cannot be given what the DiT saw beside the noise: preflight refuses
  stock SGLang for ``wan_i2v`` (``sglang_stock_refusal``).
- With the trainer's extension (which returns those latents): the native rollout replays
  through our diffusers transformer (first ratio 1), with the driver's sigmas and x_T each
  candidate is the embedded engine's, a full sync is verified by SGLang's checker, and
  training runs (full, LoRA adapter mode) sample every rollout from the weights they synced.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from sglang_fixtures import require_sglang, serve_sglang, stock_rollout, tensor_shapes

from trainer.media import ImageRef
from trainer.models.geometry import Geometry
from wan_i2v_models import build_tiny_wan_i2v_dir
from wan_models import TINY_VIDEO

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]
H, W, F = TINY_VIDEO


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_wan_i2v_dir("wan2.1-i2v", tmp_path_factory.mktemp("wan_i2v"),
                                       clip_image_size=128)  # 257 CLIP tokens: see ext_server
    with serve_sglang(model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_frames")
    out = {}
    for name, colour in (("red", (210, 40, 30)), ("blue", (30, 40, 210))):
        pixels = np.full((H, W, 3), colour, dtype=np.uint8)
        pixels[4:14, 6:16] = 255 - np.array(colour, dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{name}.png")
        out[name] = str(root / f"{name}.png")
    return out


def _rollout(url: str, frame: str) -> dict:
    """One SGLang rollout request (its own schema) with ``frame`` as the first frame."""
    return stock_rollout(url, prompt="a red panda walks", width=W, height=H, num_frames=F,
                         image_path=[frame])


def test_sglang_takes_the_first_frame_by_path_and_returns_no_condition_latents(server, frames):
    """SGLang's native pipeline reads the first frame from ``image_path`` (its CLIP embeddings
    differ between two frames, and equal our adapter's) and returns a video rollout, but none of the tensors of its
    denoising env has the shape of the first-frame condition latents our adapter computes for
    the same frame (mask + VAE latents, what Wan's DiT is given beside the noise): that is the
    refusal's reason, shown on SGLang's own pipeline."""
    from trainer.models import adapter_class

    red, blue = _rollout(server.url, frames["red"]), _rollout(server.url, frames["blue"])
    assert tuple(red["generated_output"].shape) == (3, F, H, W)
    assert red["dit_trajectory"]["latents"].shape[0] == 5  # T + 1
    clip = red["denoising_env"]["image_kwargs"]["encoder_hidden_states_image"]
    clip_blue = blue["denoising_env"]["image_kwargs"]["encoder_hidden_states_image"]
    assert not torch.equal(clip[0], clip_blue[0])  # SGLang read each frame

    adapter = server.adapter
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    ours = adapter.encode_conditions(frozen, ["a red panda walks"], [(ImageRef(frames["red"]),)],
                                     Geometry(H, W, F))
    # what SGLang does return is what our adapter encodes: the CLIP embeddings bit for bit, the
    # prompt embeddings to fp32 rounding (two T5 implementations)
    assert torch.equal(clip[0], ours["image_embeds"][0])
    prompt = red["denoising_env"]["pos_cond_kwargs"]["encoder_hidden_states"]
    prompt = prompt[0] if isinstance(prompt, list) else prompt
    assert prompt.shape == ours["prompt_embeds"][0].shape
    assert float((prompt - ours["prompt_embeds"][0]).abs().max()) < 1e-5
    condition = tuple(ours["condition_latents"].shape)
    shapes = tensor_shapes(red["denoising_env"])
    assert condition not in shapes and condition[1:] not in shapes, (condition, shapes)
    assert "batch.image_latent" in adapter_class("wan_i2v").sglang_stock_refusal


# ---- through the trainer's extension -----------------------------------------------------------
PROMPTS = ["a red panda walks"] * 2 + ["waves on a beach"] * 2
IDS = ["prompt:1:sample:0", "prompt:1:sample:1", "prompt:2:sample:0", "prompt:2:sample:1"]
# Wan 2.2 trains its high-noise expert only: with the tiny checkpoint's shift (5.0) and the
# published boundary (0.9), steps 1 and 2 of 8 (sigmas 0.972, 0.938) are above it.
STEPS = {"wan2.1-i2v": 4, "wan2.2-i2v": 8}


def sampling(variant: str) -> dict:
    return {"height": H, "width": W, "num_frames": F, "num_inference_steps": STEPS[variant],
            "eta": 0.7, "driver_sigmas": False, "driver_xt": False, "guidance_scale": 1.0}


@pytest.fixture(scope="module", params=sorted(STEPS))
def ext_server(request, tmp_path_factory):
    # SGLang's native Wan DiT splits the image context at the published CLIP's 257 tokens:
    # the tiny tower is built to give as many (tests/wan_i2v_models.py)
    model_dir = build_tiny_wan_i2v_dir(request.param, tmp_path_factory.mktemp("wan_i2v_ext"),
                                       clip_image_size=128)
    with serve_sglang(model_dir, extension=True) as srv:
        srv.variant = request.param
        yield srv


def _serving_the_checkpoint(server):
    """A client of ``server`` (extension on) after syncing it the checkpoint's weights, which the
    replay and the embedded engine load: tests of this module that train sync others."""
    from trainer.engine.sglang.client import SGLangEngineClient
    from trainer.engine.sglang.sync import SGLangWeightSync

    client = SGLangEngineClient(server.url, embedded=False, extension=True)
    SGLangWeightSync(client, served_dit=type(server.adapter).sglang_dit).sync(
        100, server.adapter.load_train_model().named_parameters())
    return client


def _i2v_request(server, frames):
    refs = [(ImageRef(frames["red"]),)] * 2 + [(ImageRef(frames["blue"]),)] * 2
    return server.adapter.build_rollout_request(PROMPTS, IDS, sampling(server.variant),
                                                rollout_id=0, seed=7, sde_indices=[1, 2],
                                                images=refs)


def test_extension_rollout_replays_through_our_transformer(ext_server, frames, tmp_path):
    """With the extension, the client sends each candidate's first frame as a file, the answer
    carries the first frame's condition latents (``flowgrpo_image_latent``) beside SGLang's own
    CLIP and prompt embeddings, all equal to what our adapter encodes, and our diffusers
    transformer replays SGLang's native rollout: the first ratio is 1 up to fp32 rounding. The
    files are gone once the answers are in."""
    from trainer.actor.replay import replay_log_probs
    from trainer.engine.sglang.client import SGLangEngineClient

    adapter = ext_server.adapter
    request = _i2v_request(ext_server, frames)
    media = tmp_path / "media"
    media.mkdir()
    client = _serving_the_checkpoint(ext_server)
    client.media_root = str(media)
    response = client.generate(request)
    assert list(media.iterdir()) == []
    batch = adapter.pack_trajectory(response, request)
    assert batch.images.shape == (4, F, H, W, 3) and batch.images.dtype == torch.uint8
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    for row, name in ((0, "red"), (2, "blue")):
        ours = adapter.encode_conditions(frozen, [PROMPTS[row]], [(ImageRef(frames[name]),)],
                                         Geometry(H, W, F))
        for key in sorted(set(ours) - {"prompt_embeds"}):  # Wan 2.2: no image embeddings
            assert torch.allclose(batch.conditions[key][row], ours[key][0], atol=1e-5,
                                  rtol=0), key
    assert not torch.equal(batch.conditions["condition_latents"][0],
                           batch.conditions["condition_latents"][2])
    with torch.no_grad():
        replay = replay_log_probs(adapter, adapter.load_train_model().eval(), batch,
                                  backend="torch")
    gap = float((replay - batch.log_probs).abs().max())
    ratio = float((replay - batch.log_probs).exp().sub(1).abs().max())
    print(f"{ext_server.variant} native-vs-replay (extension): max |logp gap| {gap:.3g}, "
          f"max |ratio - 1| {ratio:.3g}")
    assert gap < 2e-4 and ratio < 2e-4


def test_stock_sglang_is_refused_for_first_frames_naming_the_extension(ext_server, frames):
    """Without the extension the client does not send first frames (the answer would lack the
    latents the replay needs): one error saying so, before any request."""
    from trainer.engine.sglang.client import SGLangEngineClient

    client = SGLangEngineClient(ext_server.url, embedded=False)
    before = len(ext_server.requests)
    with pytest.raises(ValueError, match="need the trainer's SGLang extension"):
        client.generate(_i2v_request(ext_server, frames))
    assert len(ext_server.requests) == before


def test_full_sync_is_verified_by_sglangs_checker_and_serves_the_next_rollout(ext_server, frames):
    """SGLang's stock weight path (``/update_weights_from_tensor`` + its checker) into the
    native Wan DiT, image branch included (its image embedder and image cross-attention under
    SGLang's names): the served tensors are the trainer's, a wrong digest is refused, and the
    next image-to-video rollout is sampled by the new weights."""
    from trainer.engine.sglang.client import SGLangEngineClient
    from trainer.engine.sglang.sync import SGLangSyncError, SGLangWeightSync, tensor_sha256
    from sglang_fixtures import as_served

    adapter = ext_server.adapter
    client = SGLangEngineClient(ext_server.url, embedded=False, extension=True)
    request = _i2v_request(ext_server, frames)
    before = client.generate(request)
    model = adapter.load_train_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    sender = SGLangWeightSync(client, served_dit=type(adapter).sglang_dit, bucket_bytes=1 << 16)
    stats = sender.sync(3, model.named_parameters())
    assert stats.tensors == len(list(model.parameters())) and client.committed_version == 3
    served = ext_server.served_tensors()
    trained = as_served(model.named_parameters(), type(adapter).sglang_dit)
    assert set(trained) == set(served)
    if ext_server.variant == "wan2.1-i2v":  # Wan 2.2 I2V has no image branch
        assert any("add_k_proj" in n for n in trained)
        assert any("image_embedder" in n for n in trained)
    assert all(torch.equal(served[n], p) for n, p in trained.items())
    digests = {n: tensor_sha256(p) for n, p in trained.items()}
    with pytest.raises(SGLangSyncError, match="checksum mismatch"):
        sender._check({**digests, next(iter(digests)): "0" * 64}, 4)
    after = client.generate(request)
    assert after["policy_version"] == 3
    assert not torch.equal(after["images"], before["images"])


def _run_overrides(server, frames, tmp_path) -> list[str]:
    """A tiny image-to-video run on ``server`` with the extension: prompts with first frames."""
    from sglang_fixtures import trainer_overrides

    over = trainer_overrides(server.adapter.model_path, server.url, tmp_path, sampling={
        "num_frames": F, "num_inference_steps": STEPS[server.variant], "sde_indices": [1, 2],
        "sde_pool": [1, 2, 3] if server.variant == "wan2.1-i2v" else [1, 2]})
    names = ("red", "blue")
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(
        {"prompt": f"a red panda number {i}", "images": [frames[names[i % 2]]],
         "metadata": {"sample_id": f"p{i:03d}"}}) for i in range(8)))
    return over + ["model.task=i2v", "train.num_rollouts=3", "rollout.sglang_extension=true"]


def test_training_run_through_the_extension_samples_from_the_weights_it_synced(ext_server,
                                                                               frames, tmp_path):
    """A CPU training run of Wan 2.1 I2V on SGLang with the extension: every prompt's first
    frame reaches SGLang's native pipeline, each step's weights go through our ipc/ transport
    into the native DiT (no SGLang weight route is called), the first update's ratio is 1, and
    the next rollout's log-probs are the new policy's replay, not the old one's."""
    from sglang_fixtures import train_through_extension
    from trainer.config import load_config

    cfg = load_config("tiny", _run_overrides(ext_server, frames, tmp_path) + ["train.lr=2e-2"])
    # two training rollouts and two checking ones, 4 candidates each, all sampled by SGLang
    assert train_through_extension(cfg, ext_server, ext_server.adapter) == 16


#: Schedules SGLang would not pick; Wan 2.2's keeps steps 1 and 2 above the experts' boundary.
DRIVER_SIGMAS = {"wan2.1-i2v": [1.0, 0.8, 0.5, 0.2, 0.0],
                 "wan2.2-i2v": [1.0, 0.97, 0.93, 0.85, 0.7, 0.5, 0.3, 0.1, 0.0]}


def test_extension_rollout_with_the_drivers_noise_is_the_embedded_engines_candidate(ext_server,
                                                                                    frames):
    """With the driver's sigmas and x_T, SGLang's native image-to-video pipeline steps the sent
    grid from the driver's x_T with our sampler and noise: each candidate is the one our
    embedded engine generates for the same request and first frames (latents at every trained
    step and log-probs up to the two fp32 transformers' gap)."""
    from trainer.engine import launch_embedded_engine
    from trainer.engine.sglang.client import SGLangEngineClient

    server, adapter = ext_server, ext_server.adapter
    client = _serving_the_checkpoint(server)
    refs = [(ImageRef(frames["red"]),)] * 2 + [(ImageRef(frames["blue"]),)] * 2
    request = adapter.build_rollout_request(
        PROMPTS, IDS, {**sampling(server.variant), "driver_sigmas": True, "driver_xt": True},
        rollout_id=0, seed=7, sde_indices=[1, 2], images=refs)
    request["extra_sampling_params"]["sigmas"] = DRIVER_SIGMAS[server.variant]
    seen = len(server.requests)
    served = client.generate(request)
    for stepped in server.requests[seen:]:
        assert torch.equal(stepped["sigmas"], torch.tensor(DRIVER_SIGMAS[server.variant]))
    engine = launch_embedded_engine(adapter_path="trainer.models.wan_i2v.WanI2VAdapter",
                                    model_path=adapter.model_path, adapter_options=None,
                                    device="cpu", dtype="fp32", lora=None, in_process=True)
    try:
        ours = engine.generate(request)
    finally:
        engine.close()
    sglang_batch, our_batch = (adapter.pack_trajectory(r, request) for r in (served, ours))
    latent_gap = float((sglang_batch.latents - our_batch.latents).abs().max())
    next_gap = float((sglang_batch.next_latents - our_batch.next_latents).abs().max())
    logp_gap = float((sglang_batch.log_probs - our_batch.log_probs).abs().max())
    print(f"{server.variant} SGLang+extension vs embedded: latents {latent_gap:.3g}, "
          f"next latents {next_gap:.3g}, log-probs {logp_gap:.3g}")
    assert latent_gap < 1e-4 and next_gap < 1e-4 and logp_gap < 2e-4


def test_training_in_lora_adapter_mode_through_the_extension(ext_server, frames, tmp_path):
    """LoRA adapter mode (the I2V recipes' mode; Wan 2.1's image cross-attention projections are
    LoRA targets too) through the extension's adapter receiver: the served weights are the
    actor's merge bit for bit under SGLang's names, and the next rollout is sampled by them."""
    from test_sglang_extension_lora import ADAPTER, SCALING, _differ, _expected

    from trainer.actor.replay import replay_log_probs
    from trainer.actor.sync import merged_full_tensors
    from trainer.config import load_config
    from trainer.engine.sglang.transport import SGLangTransport
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    server, adapter = ext_server, ext_server.adapter
    cfg = load_config("tiny", _run_overrides(server, frames, tmp_path) + ADAPTER)
    preflight(cfg, world_size=1, device="cpu")
    routes = len(server.weight_requests)
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        assert isinstance(trainer.sender, SGLangTransport) and trainer.cfg.sync_mode == "adapter"
        trainer.train_step(0)
        assert trainer.policy_version == trainer.engine.committed_version == 1
        expected = _expected(adapter, trainer.model)
        if server.variant == "wan2.1-i2v":
            assert any("add_k_proj" in n for n in expected)
        assert _differ(server.served_tensors(), expected) == []
        local = adapter.load_train_model().eval()
        local.load_state_dict(dict(merged_full_tensors(trainer.model, SCALING)))
        base = adapter.load_train_model().eval()
        batch = trainer.rollout(1)
        with torch.no_grad():
            served_replay = replay_log_probs(adapter, local, batch, backend="torch")
            base_replay = replay_log_probs(adapter, base, batch, backend="torch")
        assert torch.allclose(served_replay, batch.log_probs, atol=2e-4, rtol=0)
        assert float((base_replay - batch.log_probs).abs().max()) > 2e-3
        assert server.weight_requests[routes:] == []
    finally:
        trainer.close()
