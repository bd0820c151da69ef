"""Wan text-to-video through SGLang's own native pipeline (sglang==0.5.23), on CPU.

tests/sglang_fixtures.py serves tiny Wan 2.1 and Wan 2.2 A14B checkpoints (tests/wan_models.py)
with SGLang's ``WanPipeline`` as a user serves a local Wan checkpoint (``--model-id`` of the
published model, ``--flow-shift`` of the checkpoint): its native ``WanTransformer3DModel`` (and
for Wan 2.2 its second, low-noise expert, picked by SGLang's boundary rule), its UMT5 text
encoding, latent and timestep preparation (the rollout scheduler SGLang maps its UniPC serving
scheduler to), the denoising stage with its rollout hooks on 5-D latents [B, C, F', h, w], its
Wan VAE decoding, weight updater and checker. The trainer replays with its own diffusers
transformer loaded from the same checkpoint, so the engine-vs-replay log-prob gap is that of two
fp32 implementations. The SD3 / FLUX.1 counterparts are tests/test_sglang_families.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from sglang_fixtures import (as_served, assert_served_and_sampled_from, policy_copy,
                             require_sglang, serve_sglang, trainer_overrides)
from wan_models import TINY_VIDEO, build_tiny_wan_dir

from trainer.engine.sglang.client import SGLangEngineClient
from trainer.engine.sglang.rollout import SGLangResponseError, to_sglang_requests
from trainer.engine.sglang.sync import SGLangSyncError, SGLangWeightSync, tensor_sha256
from trainer.models.geometry import Geometry

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

H, W, F = TINY_VIDEO
VARIANTS = ("wan2.1", "wan2.2")
PROMPTS = ["a red panda"] * 2 + ["a teacup"] * 2
IDS = ["prompt:1:sample:0", "prompt:1:sample:1", "prompt:2:sample:0", "prompt:2:sample:1"]
# Wan 2.2 trains its high-noise expert only: with the published boundary (0.875) and the tiny
# checkpoint's shift (3.0), steps 1 and 2 of 8 (sigmas 0.947, 0.883) are above it, steps 3-7
# are the low-noise expert's.
STEPS = {"wan2.1": 4, "wan2.2": 8}
SDE_INDICES = [1, 2]


def sampling(variant: str, **over) -> dict:
    return {"height": H, "width": W, "num_frames": F, "num_inference_steps": STEPS[variant],
            "eta": 0.7, "driver_sigmas": False, "driver_xt": False, "guidance_scale": 1.0, **over}


@pytest.fixture(scope="module")
def wan_dirs(tmp_path_factory):
    """variant -> a tiny checkpoint in a directory named after its family (``family_of``)."""
    root = tmp_path_factory.mktemp("sglang_wan")
    out = {}
    for variant in VARIANTS:
        built = build_tiny_wan_dir(variant, root / variant)
        out[variant] = built.rename(built.parent / "wan")
    return out


@pytest.fixture(scope="module", params=VARIANTS)
def server(request, wan_dirs):
    with serve_sglang(wan_dirs[request.param]) as srv:
        srv.variant = request.param
        yield srv


def _request(server, prompts=PROMPTS, ids=IDS, **over):
    return server.adapter.build_rollout_request(prompts, ids, sampling(server.variant, **over),
                                                rollout_id=0, seed=7, sde_indices=SDE_INDICES)


def _sender(client, adapter, **kwargs):
    return SGLangWeightSync(client, served_dit=type(adapter).sglang_dit, **kwargs)


# ---- the client's video fields, without a server -----------------------------------------------
def test_video_requests_carry_num_frames_and_image_requests_stay_as_they_were(wan_dirs,
                                                                               tiny_model_dir):
    from trainer.models import adapter_class

    wan = adapter_class("wan")(str(wan_dirs["wan2.1"]))
    video = wan.build_rollout_request(PROMPTS, IDS, sampling("wan2.1"), rollout_id=0, seed=7,
                                      sde_indices=SDE_INDICES)
    assert all(body["num_frames"] == F for body in to_sglang_requests(video))
    sd3 = adapter_class("sd3")(str(tiny_model_dir("sd3")))
    image = sd3.build_rollout_request(PROMPTS, IDS, {"height": 32, "width": 32,
                                                     "num_inference_steps": 4, "eta": 0.7,
                                                     "driver_sigmas": False, "driver_xt": False},
                                      rollout_id=0, seed=7, sde_indices=SDE_INDICES)
    assert all("num_frames" not in body for body in to_sglang_requests(image))


def test_a_video_of_the_wrong_shape_is_refused_naming_the_candidate(wan_dirs):
    """SGLang answers a video as float [3, F, H, W]; one with other frames (a server that
    ignored num_frames: its default is 81) is one error naming the candidate and the shape."""
    from trainer.engine.sglang.rollout import to_schema_response
    from trainer.models import adapter_class

    wan = adapter_class("wan")(str(wan_dirs["wan2.1"]))
    request = wan.build_rollout_request(PROMPTS[:1], IDS[:1], sampling("wan2.1"), rollout_id=0,
                                        seed=7, sde_indices=SDE_INDICES)
    body = to_sglang_requests(request)[0]
    latent = wan.latent_shape(Geometry(H, W, F))
    answer = {"seed": body["seed"], "rollout_log_probs": torch.zeros(4),
              "dit_trajectory": {"latents": torch.zeros(5, *latent),
                                 "timesteps": torch.zeros(5), "sigmas": torch.zeros(5)},
              "denoising_env": {"pos_cond_kwargs": {"encoder_hidden_states": torch.zeros(8, 16)}},
              "generated_output": torch.zeros(3, 81, H, W)}
    with pytest.raises(SGLangResponseError, match=r"candidate 0 .*\[3, 81, 32, 32\].*"
                                                  r"\[3, 5, 32, 32\]"):
        to_schema_response([[answer]], [body], request)
    answer["generated_output"] = torch.rand(3, F, H, W)
    response = to_schema_response([[answer]], [body], request)
    assert response["num_frames"] == F and response["images"].shape == (1, F, H, W, 3)
    assert torch.equal(response["images"][0, 2, 5, 7],
                       (answer["generated_output"][:, 2, 5, 7] * 255).round().to(torch.uint8))


# ---- against SGLang's native Wan pipeline ------------------------------------------------------
def test_native_wan_rollout_replays_through_our_transformer(server):
    """SGLang's WanPipeline samples videos; our diffusers Wan transformer replays the recorded
    5-D steps with the conditions SGLang sent back: the first ratio is 1 up to fp32 rounding."""
    from trainer.actor.replay import replay_log_probs

    adapter = server.adapter
    request = _request(server)
    response = SGLangEngineClient(server.url).generate(request)
    batch = adapter.pack_trajectory(response, request)
    latent = adapter.latent_shape(Geometry(H, W, F))
    assert batch.latents.shape == (4, 2, *latent) and len(latent) == 4   # [C, F', h, w]
    assert batch.images.shape == (4, F, H, W, 3) and batch.images.dtype == torch.uint8
    assert not torch.equal(batch.latents[0], batch.latents[1])
    # the rollout scheduler SGLang maps Wan's UniPC to steps our adapter's sigmas
    ours_sigmas = adapter.scheduler_sigmas(STEPS[server.variant], Geometry(H, W, F)).float()
    assert torch.allclose(response["dit_trajectory"]["sigmas"], ours_sigmas)
    assert not any(r["cfg"] for r in server.requests[-4:])  # Wan 2.2's CFG defaults: off
    # SGLang's UMT5 encoding gives the embeddings our adapter computes (512 tokens, zero tail)
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    ours = adapter.encode_prompts(frozen, PROMPTS[:1])["prompt_embeds"]
    assert torch.allclose(batch.conditions["prompt_embeds"][0], ours[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        replay = replay_log_probs(adapter, adapter.load_train_model().eval(), batch,
                                  backend="torch")
    gap = float((replay - batch.log_probs).abs().max())
    ratio = float((replay - batch.log_probs).exp().sub(1).abs().max())
    print(f"{server.variant} native-vs-replay: max |logp gap| {gap:.3g}, "
          f"max |ratio - 1| {ratio:.3g}")
    assert gap < 2e-4 and ratio < 2e-4


def test_every_served_step_is_the_expert_our_adapter_picks(server):
    """The whole trajectory SGLang recorded, step by step: each ODE step's x_i+1 is our
    adapter's Euler step of x_i, whose velocity comes from the expert our boundary rule picks
    (Wan 2.2: the trained high-noise transformer above the boundary, the frozen low-noise
    ``transformer_2`` below it; they differ, so a wrong pick would not match)."""
    adapter = server.adapter
    adapter.load_frozen(device="cpu", dtype=torch.float32)  # Wan 2.2: the low-noise expert
    model = adapter.load_train_model().eval()
    client = SGLangEngineClient(server.url)
    body = to_sglang_requests(_request(server, PROMPTS[:1], IDS[:1]))[0]
    answer = client._call("POST", "/rollout/generate", body)[0]
    latents = answer["dit_trajectory"]["latents"]
    sigmas = answer["dit_trajectory"]["sigmas"]
    embeds = answer["denoising_env"]["pos_cond_kwargs"]["encoder_hidden_states"]
    cond = {"prompt_embeds": embeds[None]}
    ode_steps = [i for i in range(STEPS[server.variant]) if i not in SDE_INDICES]
    high = adapter.high_noise_rows(sigmas[:-1])
    assert (not bool(high[ode_steps].all())) == (server.variant == "wan2.2")
    worst = 0.0
    with torch.no_grad():
        for i in ode_steps:
            v = adapter.velocity(model, latents[i][None], sigmas[i:i + 1], cond, Geometry(H, W, F))
            step = latents[i] + v[0] * (sigmas[i + 1] - sigmas[i])
            worst = max(worst, float((step - latents[i + 1]).abs().max()))
    print(f"{server.variant}: max |x_i+1 - our Euler step| {worst:.3g} over steps {ode_steps}")
    assert worst < 1e-4


def test_full_sync_lands_every_tensor_under_the_served_names_and_the_checker_verifies_it(server):
    """SGLang's updater takes every trained tensor (the high-noise expert for Wan 2.2) through
    its Wan name mapping (``attn1.to_q`` -> ``to_q``, ...); the manifest names what the native
    DiT holds, so its checker verifies every tensor, and one wrong digest fails the sync."""
    adapter = server.adapter
    client = SGLangEngineClient(server.url)
    request = _request(server, PROMPTS[:1], IDS[:1])
    before = client.generate(request)
    low_before = server.served_tensors("transformer_2") if server.variant == "wan2.2" else None
    model = adapter.load_train_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    sender = _sender(client, adapter, bucket_bytes=1 << 16)
    stats = sender.sync(5, model.named_parameters())
    assert stats.tensors == len(list(model.parameters())) and client.committed_version == 5
    served = server.served_tensors()
    trained = as_served(model.named_parameters(), type(adapter).sglang_dit)
    assert set(trained) == set(served)  # every tensor the native DiT holds, none unknown to it
    assert "blocks.0.to_q.weight" in trained and "blocks.0.ffn.fc_in.weight" in trained
    assert all(torch.equal(served[n], p) for n, p in trained.items())
    digests = {n: tensor_sha256(p) for n, p in trained.items()}
    with pytest.raises(SGLangSyncError, match="checksum mismatch"):
        sender._check({**digests, next(iter(digests)): "0" * 64}, 6)
    with pytest.raises(SGLangSyncError):  # our (diffusers) names are not what it holds
        sender._check({n: tensor_sha256(p) for n, p in model.named_parameters()}, 6)
    after = client.generate(request)
    assert after["policy_version"] == 5
    assert not torch.equal(after["images"], before["images"])
    if low_before is not None:  # the frozen low-noise expert is not the synced one
        low_after = server.served_tensors("transformer_2")
        assert all(torch.equal(low_after[n], t) for n, t in low_before.items())


def _overrides(server, tmp_path, **sampling_over) -> list[str]:
    variant, adapter = server.variant, server.adapter
    over = {"num_frames": F, "num_inference_steps": STEPS[variant], "sde_indices": SDE_INDICES,
            "sde_pool": SDE_INDICES if variant == "wan2.2" else [1, 2, 3], **sampling_over}
    return trainer_overrides(adapter.model_path, server.url, tmp_path, sampling=over) + [
        "model.task=t2v", "train.num_rollouts=3", "train.lr=2e-2"]


def test_training_run_samples_every_rollout_from_the_weights_it_synced(server, tmp_path):
    """A CPU training run of Wan through SGLang's stock path: each step synced into the native
    DiT and verified by SGLang's checker before the version advances, and the next rollout's
    recorded log-probs are the new policy's replay, not the old one's."""
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    adapter = server.adapter
    cfg = load_config("tiny", _overrides(server, tmp_path))
    preflight(cfg, world_size=1, device="cpu")
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        for step in range(2):
            old = policy_copy(trainer, adapter)
            seen = len(server.weight_requests)
            metrics = trainer.train_step(step)
            new = policy_copy(trainer, adapter)
            kinds = [type(r).__name__ for r in server.weight_requests[seen:]]
            assert kinds[-1] == "UpdateWeightFromTensorCheckerReqInput"
            assert trainer.policy_version == trainer.engine.committed_version == step + 1
            if step == 0:
                assert metrics["train/first_update_ratio_mean"] == pytest.approx(1.0, abs=2e-4)
            assert_served_and_sampled_from(trainer, adapter, server, old, new, step)
    finally:
        trainer.close()


@pytest.fixture(scope="module", params=VARIANTS)
def extension_server(request, wan_dirs):
    with serve_sglang(wan_dirs[request.param], extension=True) as srv:
        srv.variant = request.param
        yield srv


#: Schedules SGLang would not pick (its grid is the shifted one the adapter computes); Wan 2.2's
#: keeps steps 1 and 2 above the experts' boundary and puts steps 3-7 below it.
DRIVER_SIGMAS = {"wan2.1": [1.0, 0.8, 0.5, 0.2, 0.0],
                 "wan2.2": [1.0, 0.97, 0.92, 0.85, 0.7, 0.5, 0.3, 0.1, 0.0]}


def test_extension_rollout_is_the_embedded_engines_candidate(extension_server):
    """With the extension, SGLang's native Wan pipeline steps the driver's sigmas, starts from
    the driver's 5-D x_T and samples with our kernel and step noise: each candidate is the one
    our embedded engine generates for the same request (same latents at every trained step,
    same log-probs, up to the two fp32 transformers' gap; the same video up to a unit of uint8
    rounding), and SGLang's loop ran the sent grid."""
    from trainer.engine import launch_embedded_engine

    server, adapter = extension_server, extension_server.adapter
    request = _request(server, driver_sigmas=True, driver_xt=True)
    request["extra_sampling_params"]["sigmas"] = DRIVER_SIGMAS[server.variant]
    seen = len(server.requests)
    served = SGLangEngineClient(server.url, extension=True).generate(request)
    for stepped in server.requests[seen:]:
        assert torch.equal(stepped["sigmas"], torch.tensor(DRIVER_SIGMAS[server.variant]))
    engine = launch_embedded_engine(adapter_path="trainer.models.wan.WanAdapter",
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
    # the videos: every later step (Wan 2.2: the low-noise expert's) and each side's own VAE
    pixel_gap = int((sglang_batch.images.int() - our_batch.images.int()).abs().max())
    print(f"{server.variant} SGLang+extension vs embedded: latents {latent_gap:.3g}, "
          f"next latents {next_gap:.3g}, log-probs {logp_gap:.3g}, pixels {pixel_gap}")
    assert latent_gap < 1e-4 and next_gap < 1e-4 and logp_gap < 2e-4 and pixel_gap <= 1


def test_training_run_through_the_extension_samples_from_the_weights_it_synced(
        extension_server, tmp_path):
    """With the trainer's extension: the driver's sigmas and x_T (5-D, unpacked) and our
    sampler run inside SGLang's native Wan pipeline, every step's weights go through our ipc/
    transport into the native DiT under its served names (no SGLang weight route is called),
    and the next rollout is sampled by them."""
    from trainer.config import load_config
    from trainer.engine.sglang.transport import SGLangTransport
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    server, adapter = extension_server, extension_server.adapter
    cfg = load_config("tiny", _overrides(server, tmp_path, driver_sigmas=True, driver_xt=True)
                      + ["rollout.sglang_extension=true"])
    preflight(cfg, world_size=1, device="cpu")
    weight_routes = len(server.weight_requests)
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        assert isinstance(trainer.sender, SGLangTransport)
        for step in range(2):
            old = policy_copy(trainer, adapter)
            metrics = trainer.train_step(step)
            new = policy_copy(trainer, adapter)
            assert trainer.policy_version == trainer.engine.committed_version == step + 1
            assert metrics["train/weight_sync_tensors"] > 0
            if step == 0:  # our sampler and noise inside SGLang: the replay is the same function
                assert metrics["train/first_update_ratio_mean"] == pytest.approx(1.0, abs=2e-4)
            assert_served_and_sampled_from(trainer, adapter, server, old, new, step)
        assert server.weight_requests[weight_routes:] == []
    finally:
        trainer.close()


# ---- configuration ----------------------------------------------------------------------------
def test_served_names_follow_sglangs_whole_mapping_and_leave_the_image_families_as_packed(
        tiny_model_dir):
    """The served layout applies SGLang's whole name chain (renames and packing) to every sent
    name; for Qwen-Image, SD3 and FLUX.1 that is exactly their packing-only layout (no rename
    rule of theirs matches a diffusers name), so only Wan's names change."""
    import importlib

    from sglang_fixtures import _process_state_kept

    with _process_state_kept():  # SGLang's import-time environment, undone (as the fixture does)
        from sglang.multimodal_gen.runtime.loader.utils import get_param_names_mapping

    from trainer.engine.sglang.packing import ServedLayout
    from trainer.models import adapter_class

    for family in ("qwen_image", "sd3", "flux"):
        adapter = adapter_class(family)(str(tiny_model_dir(family)))
        dit = type(adapter).sglang_dit
        module, _, name = dit.rpartition(".")
        table = getattr(importlib.import_module(module), name).param_names_mapping
        packing_only = get_param_names_mapping(
            {p: r for p, r in table.items() if isinstance(r, tuple)})
        layout = ServedLayout(dit)
        for n, _ in adapter.load_train_model().named_parameters():
            packed, index, _ = packing_only(n)
            assert layout.place(n)[0] == (packed if index is not None else n), (family, n)
