"""SD3 and FLUX.1 through SGLang's own native pipelines (sglang==0.5.23), on CPU.

tests/sglang_fixtures.py serves each tiny model with the family's native SGLang pipeline
(``StableDiffusion3Pipeline`` / ``FluxPipeline``): its native DiT, its text encoding, latent and
timestep preparation, the denoising stage with the rollout controller, decoding, the weight
updater and checker. The trainer replays with its own diffusers transformer loaded from the same
checkpoint, so the engine-vs-replay log-prob gap is that of two fp32 implementations. Covered
per family: the native rollout and its replay, a verified full sync, a stock training run, a
training run through the extension's ipc/ transport (driver sigmas and x_T), and the LoRA
adapter mode through SGLang's ``lora_merge``. The Qwen-Image counterparts are in
tests/test_sglang_api.py, tests/test_sglang_extension.py and tests/test_sglang_lora.py.
"""
from __future__ import annotations

import pytest
import torch

from sglang_fixtures import (as_served, assert_served_and_sampled_from, policy_copy,
                             require_sglang, serve_sglang, trainer_overrides)

from trainer.engine.sglang.client import SGLangEngineClient
from trainer.engine.sglang.sync import SGLangSyncError, SGLangWeightSync, tensor_sha256
from trainer.models.geometry import Geometry

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
            "driver_sigmas": False, "driver_xt": False, "guidance_scale": 1.0}
PROMPTS = ["a red panda"] * 2 + ["a teacup"] * 2
IDS = ["prompt:1:sample:0", "prompt:1:sample:1", "prompt:2:sample:0", "prompt:2:sample:1"]


@pytest.fixture(scope="module", params=["sd3", "flux"])
def server(request, tiny_model_dir):
    with serve_sglang(tiny_model_dir(request.param)) as srv:
        yield srv


def _request(adapter, prompts=PROMPTS, ids=IDS):
    return adapter.build_rollout_request(prompts, ids, SAMPLING, rollout_id=0, seed=7,
                                         sde_indices=[1, 2])


def _sender(client, adapter, **kwargs):
    return SGLangWeightSync(client, served_dit=type(adapter).sglang_dit, **kwargs)


def test_native_rollout_replays_through_our_transformer(server):
    """SGLang's native pipeline samples; our diffusers transformer replays the recorded steps
    with the conditions SGLang sent back: the first ratio is 1 up to the fp32 gap."""
    from trainer.actor.replay import replay_log_probs

    adapter = server.adapter
    request = _request(adapter)
    response = SGLangEngineClient(server.url).generate(request)
    batch = adapter.pack_trajectory(response, request)
    assert batch.latents.shape[:2] == (4, 2) and batch.images.dtype == torch.uint8
    assert not torch.equal(batch.latents[0], batch.latents[1])
    assert torch.allclose(response["dit_trajectory"]["sigmas"],
                          adapter.scheduler_sigmas(4, Geometry(32, 32)).float())
    # SGLang's text encoders give the embeddings our adapter computes for the same prompt
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    ours = adapter.encode_prompts(frozen, PROMPTS[:1])
    for key in adapter.condition_keys:
        assert torch.allclose(batch.conditions[key][0], ours[key][0], atol=1e-5, rtol=0), key
    with torch.no_grad():
        replay = replay_log_probs(adapter, adapter.load_train_model().eval(), batch,
                                  backend="torch")
    gap = float((replay - batch.log_probs).abs().max())
    print(f"{adapter.family} native-vs-replay: max |logp gap| {gap:.3g}")
    assert gap < 2e-4


def test_full_sync_lands_every_tensor_and_the_checker_verifies_it(server):
    """SGLang's updater takes every transformer tensor under our names (neither DiT packs
    any) and its checker agrees with the manifest; one wrong digest fails the verification."""
    adapter = server.adapter
    client = SGLangEngineClient(server.url)
    request = _request(adapter, PROMPTS[:1], IDS[:1])
    before = client.generate(request)
    model = adapter.load_train_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    sender = _sender(client, adapter, bucket_bytes=1 << 16)
    stats = sender.sync(5, model.named_parameters())
    assert stats.tensors == len(list(model.parameters())) and client.committed_version == 5
    served, trained = server.served_tensors(), as_served(model.named_parameters(),
                                                         type(adapter).sglang_dit)
    assert set(trained) == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(served[n], p) for n, p in trained.items())
    digests = {n: tensor_sha256(p) for n, p in trained.items()}
    with pytest.raises(SGLangSyncError, match="checksum mismatch"):
        sender._check({**digests, next(iter(digests)): "0" * 64}, 6)
    after = client.generate(request)
    assert after["policy_version"] == 5
    assert not torch.equal(after["images"], before["images"])


def test_training_run_samples_every_rollout_from_the_weights_it_synced(server, tmp_path):
    """A CPU training run through SGLang's stock path: each step synced into the native DiT
    and verified by SGLang's checker before the version advances, and the next rollout's
    recorded log-probs are the new policy's replay, not the old one's."""
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    adapter = server.adapter
    model_dir = adapter.model_path
    overrides = trainer_overrides(model_dir, server.url, tmp_path)
    cfg = load_config("tiny", overrides + ["train.num_rollouts=3", "train.lr=2e-2"])
    preflight(cfg, world_size=1, device="cpu")
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        for step in range(2):
            old = policy_copy(trainer, adapter)
            seen = len(server.weight_requests)
            trainer.train_step(step)
            new = policy_copy(trainer, adapter)
            kinds = [type(r).__name__ for r in server.weight_requests[seen:]]
            assert kinds[-1] == "UpdateWeightFromTensorCheckerReqInput"
            assert trainer.policy_version == trainer.engine.committed_version == step + 1
            assert_served_and_sampled_from(trainer, adapter, server, old, new, step)
    finally:
        trainer.close()


@pytest.fixture(scope="module", params=["sd3", "flux"])
def extension_server(request, tiny_model_dir):
    with serve_sglang(tiny_model_dir(request.param), extension=True) as srv:
        yield srv


def test_training_run_through_the_extension_samples_from_the_weights_it_synced(
        extension_server, tmp_path):
    """With the trainer's extension: the driver's sigmas and x_T (packed as the family packs
    its latents) and our sampler run inside SGLang's native pipeline, every step's weights go
    through our ipc/ transport into the native DiT (no SGLang weight route is called), and the
    next rollout is sampled by them."""
    from trainer.config import load_config
    from trainer.engine.sglang.transport import SGLangTransport
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    server, adapter = extension_server, extension_server.adapter
    overrides = trainer_overrides(adapter.model_path, server.url, tmp_path,
                                  sampling={"driver_sigmas": True, "driver_xt": True})
    cfg = load_config("tiny", overrides + ["rollout.sglang_extension=true",
                                           "train.num_rollouts=3", "train.lr=2e-2"])
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
            assert_served_and_sampled_from(trainer, adapter, server, old, new, step)
        assert server.weight_requests[weight_routes:] == []
    finally:
        trainer.close()


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_lora_adapter_mode_through_lora_merge(family, tiny_model_dir, tmp_path):
    """LoRA adapter sync mode on the stock path: the step's adapter goes through SGLang's
    ``lora_merge`` into the native DiT and is checker-verified; the next rollout replays under
    the trainer's merged model, not the base one."""
    from trainer.actor.replay import replay_log_probs
    from trainer.actor.sync import merged_full_tensors
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    model_dir = tiny_model_dir(family)
    lora = ["lora.rank=4", "lora.alpha=8", "fsdp.trainable_mode=lora", "lora.adapter_mode=true",
            "train.lr=0.3"]
    with serve_sglang(model_dir) as server:  # a fresh server: its first sync is a full one
        cfg = load_config("tiny", trainer_overrides(model_dir, server.url, tmp_path) + lora)
        preflight(cfg, world_size=1, device="cpu")
        trainer = Trainer(cfg, rank=0, world=1, device="cpu")
        adapter = server.adapter
        try:
            assert trainer.cfg.sync_mode == "adapter" and trainer.engine.committed_version == 0
            trainer.train_step(0)
            assert trainer.policy_version == trainer.engine.committed_version == 1
            last = server.weight_requests[-2:]
            assert last[0].weight_update_mode == "lora_merge"
            assert type(last[1]).__name__ == "UpdateWeightFromTensorCheckerReqInput"
            local, base = adapter.load_train_model().eval(), adapter.load_train_model().eval()
            missing, unexpected = local.load_state_dict(
                dict(merged_full_tensors(trainer.model, 8 / 4)), strict=False)
            assert not unexpected and set(missing) <= {n for n, _ in local.named_buffers()}
            batch = trainer.rollout(1)
            with torch.no_grad():
                served_replay = replay_log_probs(adapter, local, batch, backend="torch")
                base_replay = replay_log_probs(adapter, base, batch, backend="torch")
            assert torch.allclose(served_replay, batch.log_probs, atol=2e-4, rtol=0)
            assert float((base_replay - batch.log_probs).abs().max()) > 2e-3
        finally:
            trainer.close()
