"""The trainer's SGLang path against SGLang's own diffusion server (sglang==0.5.23, pinned in
tests/requirements-sglang.txt and the README's test command), on CPU.

tests/sglang_fixtures.py serves a tiny Qwen-Image with SGLang's native pipeline: its native DiT
(packed ``to_added_qkv``), text encoding, latent preparation, timestep preparation, denoising
stage with the rollout controller, decoding, its weight updater and checker. The trainer
replays with its own diffusers transformer loaded from the same weights, so the engine-vs-replay
log-prob gap measured here is between two implementations.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from sglang_fixtures import (as_served as _as_served, assert_served_and_sampled_from,
                             policy_copy as _policy_copy, require_sglang, restore_torch_reductions, serve_sglang,
                             trainer_overrides)

from trainer.models.qwen_image import QwenImageAdapter

from trainer.engine.sglang.client import SGLangEngineClient
from trainer.engine.sglang.rollout import sample_seed, stock_problems
from trainer.engine.sglang import sync as sglang_sync
from trainer.engine.sglang.sync import (SGLangSyncError, SGLangWeightSync, serialize_payload,
                                        tensor_sha256)
from trainer.engine.sglang.verify import VerifyPolicy
from trainer.models.geometry import Geometry

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

SAMPLING = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
            "driver_sigmas": False, "driver_xt": False}
PROMPTS = ["a red panda"] * 2 + ["a teacup"] * 2
IDS = ["prompt:1:sample:0", "prompt:1:sample:1", "prompt:2:sample:0", "prompt:2:sample:1"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_sglang(tiny_model_dir("qwen_image")) as srv:
        yield srv


@pytest.fixture
def adapter(server):
    return server.adapter


def _sender(client, **kwargs):
    """A sender that names what SGLang's native DiT holds (what connect_sglang builds)."""
    return SGLangWeightSync(client, served_dit=QwenImageAdapter.sglang_dit, **kwargs)




def _request(adapter, prompts=PROMPTS, ids=IDS, rollout_id=0):
    return adapter.build_rollout_request(prompts, ids, SAMPLING, rollout_id=rollout_id, seed=7,
                                         sde_indices=[1, 2])


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_installed_sglang_is_the_pinned_version():
    from importlib.metadata import version

    assert version("sglang") == "0.5.23", "the client is written against 0.5.23's API"


def test_sglang_refuses_what_it_lacks(server):
    """Our extra keys are an HTTP 400 from SGLang's own SamplingParams; the client never
    sends them, and preflight names every stock-SGLang gap."""
    body = {"prompt": "a cat", "seed": 1, "width": 32, "height": 32, "num_inference_steps": 4,
            "extra_sampling_params": {"sample_ids": ["a"], "sigmas": [1.0, 0.5, 0.0]}}
    status, reply = _post(server.url + "/rollout/generate", body)
    assert status == 400 and "sample_ids" in reply["detail"]

    problems = "\n".join(stock_problems({"sde_type": "dance", "guidance_scale": 4.0},
                                        extension=False))
    for fragment in ("sde_type='dance'", "driver_sigmas", "driver_xt", "guidance_scale=4.0"):
        assert fragment in problems, fragment
    assert stock_problems({"sde_type": "sde", "driver_sigmas": False, "driver_xt": False},
                          extension=False) == []
    assert stock_problems({"sde_type": "dance", "driver_sigmas": True, "driver_xt": True},
                          extension=True) == []


def test_rollout_packs_and_replays_through_our_transformer(server, adapter):
    """SGLang's native pipeline samples; our diffusers transformer, loaded from the same
    checkpoint, replays: the first ratio is 1 up to the two implementations' fp32 gap."""
    from trainer.actor.replay import replay_log_probs

    client = SGLangEngineClient(server.url)
    request = _request(adapter)
    seen = len(server.requests)
    response = client.generate(request)
    sent = server.requests[seen:]
    # one output per SGLang request, each seeded from its sample id (distinct noise)
    assert [r["num_outputs_per_prompt"] for r in sent] == [1] * 4
    # SGLang's Qwen-Image defaults to CFG (guidance 4.0): the request turns it off
    assert not any(r["cfg"] for r in sent)
    assert sorted(r["seed"] for r in sent) == sorted(sample_seed(7, i) for i in IDS)
    assert len({r["seed"] for r in sent}) == 4
    batch = adapter.pack_trajectory(response, request)
    assert batch.latents.shape[:2] == (4, 2) and batch.images.dtype == torch.uint8
    assert not torch.equal(batch.latents[0], batch.latents[1])  # same prompt, other noise
    # SGLang's sigmas and per-step timesteps ([T+1] on the wire) mapped onto our schema
    assert torch.allclose(response["dit_trajectory"]["sigmas"],
                          adapter.scheduler_sigmas(4, Geometry(32, 32)).float())
    # SGLang's text encoding stage: the embeddings our adapter computes for the same prompt
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    ours = adapter.encode_prompts(frozen, PROMPTS[:1])["prompt_embeds"][0]
    assert torch.allclose(batch.conditions["prompt_embeds"][0], ours, atol=1e-5, rtol=0)
    with torch.no_grad():
        replay = replay_log_probs(adapter, adapter.load_train_model().eval(), batch,
                                  backend="torch")
    gap = (replay - batch.log_probs).abs().max()
    print(f"native-vs-replay: max |logp gap| {float(gap):.3g}, "
          f"max |ratio - 1| {float((replay - batch.log_probs).exp().sub(1).abs().max()):.3g}")
    assert float(gap) < 2e-4
    assert float((replay - batch.log_probs).exp().sub(1).abs().max()) < 1e-3
    # a candidate is a pure function of (seed, sample id): asking again alone reproduces it
    again = adapter.pack_trajectory(client.generate(_request(adapter, PROMPTS[2:3], IDS[2:3])),
                                    _request(adapter, PROMPTS[2:3], IDS[2:3]))
    assert torch.equal(again.latents[0], batch.latents[2])
    assert torch.equal(again.images[0], batch.images[2])


def test_conditions_arrive_as_sglang_sends_them(server, adapter):
    """SGLang's denoising stage keeps ``batch.prompt_embeds`` (a list: one tensor per text
    encoder) in ``pos_cond_kwargs.encoder_hidden_states``, and no mask for a one-prompt
    request: the raw answer has that form and the client maps it."""
    from trainer.engine.sglang.rollout import to_sglang_requests

    body = to_sglang_requests(_request(adapter, PROMPTS[:1], IDS[:1]))[0]
    answer = SGLangEngineClient(server.url)._call("POST", "/rollout/generate", body)
    pos = answer[0]["denoising_env"]["pos_cond_kwargs"]
    assert isinstance(pos["encoder_hidden_states"], list)
    assert len(pos["encoder_hidden_states"]) == 1
    assert pos["encoder_hidden_states_mask"] is None


def test_payload_reads_back_through_sglang_deserializer():
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    from trainer.engine.sglang.sync import flattened_bucket

    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    named = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.arange(5, dtype=torch.bfloat16))]
    monkey_patch_torch_reductions()  # as SGLang's worker does before deserializing
    try:
        bucket = flattened_bucket(named)
        got = MultiprocessingSerializer.deserialize(serialize_payload({"transformer": bucket}))
    finally:
        restore_torch_reductions()
        torch.multiprocessing.set_sharing_strategy(strategy)
    meta = got["transformer"]["metadata"]
    flat = got["transformer"]["flattened_tensor"]
    for (name, t), m in zip(named, meta):
        back = flat[m.start_idx:m.end_idx].view(getattr(torch, m.dtype.split(".")[-1]))
        assert m.name == name and torch.equal(back.reshape(m.shape), t)


def _bumped(adapter, delta: float):
    model = adapter.load_train_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)
    return model


@pytest.mark.parametrize("transport", ["tensor", "disk"])
def test_weight_sync_changes_served_weights(server, adapter, transport, tmp_path):
    """Every tensor lands, packed ones included: the native DiT's ``to_added_qkv`` is the
    concatenation of the add_q/k/v projections we send, and SGLang's checker agrees with the
    manifest named as the server holds it."""
    client = SGLangEngineClient(server.url)
    request = _request(adapter, PROMPTS[:1], IDS[:1])
    before = client.generate(request)
    model = _bumped(adapter, 0.01 if transport == "tensor" else -0.01)
    sender = _sender(client, transport=transport, bucket_bytes=1 << 20,
                     disk_dir=tmp_path if transport == "disk" else None)
    stats = sender.sync(5, model.named_parameters())
    assert stats.tensors == len(list(model.parameters())) and client.committed_version == 5
    served, trained = server.served_tensors(), _as_served(model.named_parameters())
    assert "transformer_blocks.0.attn.to_added_qkv.weight" in trained
    assert set(trained) <= set(served)
    assert all(torch.equal(served[n], p) for n, p in trained.items())
    # the checker compares SHA-256 values: one wrong digest fails the sync's verification
    digests = {n: tensor_sha256(p) for n, p in trained.items()}
    name = "transformer_blocks.0.attn.to_added_qkv.weight"
    with pytest.raises(SGLangSyncError, match="checksum mismatch"):
        sender._check({**digests, name: "0" * 64}, 6)
    after = client.generate(request)
    assert after["policy_version"] == 5
    assert not torch.equal(after["images"], before["images"])


def test_manifest_in_our_names_misses_the_packed_tensors(server, adapter):
    """Without the packing table the manifest names add_q/k/v_proj, which the native module
    does not have: SGLang's checker reports them missing (the first sync of a run failed so)."""
    client = SGLangEngineClient(server.url)
    with pytest.raises(SGLangSyncError, match=r"missing \d+ tensor.*add_[qkv]_proj"):
        SGLangWeightSync(client).sync(6, _bumped(adapter, 0.004).named_parameters())
    assert client.committed_version is None


def test_checksum_is_asked_of_the_transformer_only(server, adapter):
    client = SGLangEngineClient(server.url)
    seen = len(server.weight_requests)
    digest = json.loads(client.checksum())
    assert [r.module_names for r in server.weight_requests[seen:]] == [["transformer"]]
    assert list(digest) == ["transformer"]


LORA = ["lora.rank=4", "lora.alpha=8", "fsdp.trainable_mode=lora", "train.lr=3e-2"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora_merged"])
def test_trainer_step_through_sglang_syncs_the_served_weights(server, tiny_model_dir, tmp_path,
                                                              lora):
    """generate -> pack -> replay (first ratio 1) -> update -> sync through SGLang's
    deserializer -> checker -> the next rollout is served by the trained weights (LoRA:
    merged into the base by the trainer; adapter mode's lora_merge: tests/test_sglang_lora.py)."""
    from trainer.actor.sync import merged_full_tensors
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    cfg = load_config("tiny", trainer_overrides(tiny_model_dir("qwen_image"), server.url,
                                                 tmp_path) + (LORA if lora else []))
    preflight(cfg, world_size=1, device="cpu")
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        assert isinstance(trainer.sender, SGLangWeightSync)
        assert trainer.engine.committed_version == 0  # the first sync ran and was verified
        metrics = trainer.train_step(0)
        assert metrics["train/first_update_ratio_mean"] == 1.0
        assert metrics["train/logp_parity"] < 2e-4  # replay vs SGLang's own log-prob
        assert metrics["train/optimizer_steps"] > 0
        assert trainer.policy_version == 1 and trainer.engine.committed_version == 1
        served = server.served_tensors()
        if lora:
            assert trainer.cfg.sync_mode == "merge"
            trained = _as_served(merged_full_tensors(trainer.model, 8 / 4))
        else:
            names = trainer._engine_names()
            trained = _as_served((names[n], p) for n, p in trainer.model.named_parameters())
        assert set(trained) == set(served)
        base = _as_served(server.adapter.load_train_model().named_parameters())
        assert any(not torch.equal(p, base[n]) for n, p in trained.items())
        assert all(torch.equal(served[n], p) for n, p in trained.items())
        batch = trainer.rollout(1)  # served by version 1 (the driver checks the echo)
        assert batch.policy_version == 1
    finally:
        trainer.close()


def test_trainer_refuses_sglang_server_without_weight_sync(tiny_model_dir, tmp_path):
    """A server that cannot take a sync would serve the base weights forever: the run stops
    at construction instead."""
    from trainer.config import load_config
    from trainer.loop import Trainer

    model_dir = tiny_model_dir("qwen_image")
    with serve_sglang(model_dir, weights_api=False) as srv:
        cfg = load_config("tiny", trainer_overrides(model_dir, srv.url, tmp_path))
        with pytest.raises(SGLangSyncError, match="update_weights_from_tensor: HTTP 404"):
            Trainer(cfg, rank=0, world=1, device="cpu")


def test_payload_labelled_with_gpu_uuid(server, adapter, monkeypatch):
    """One payload per rank, labelled with its GPU's UUID: SGLang's worker takes the payload
    whose UUID is its own (prefix and case normalised) and refuses when none is."""
    from trainer.engine.sglang import sync as sglang_sync

    monkeypatch.setattr(sglang_sync, "gpu_uuid", lambda device: "GPU-00ab-CD")
    client = SGLangEngineClient(server.url)
    model = _bumped(adapter, 0.003)
    server.set_device_uuid("00ab-cd")
    _sender(client).sync(8, model.named_parameters())
    assert server.weight_requests[-2].payload_gpu_uuids == ["GPU-00ab-CD"]
    server.set_device_uuid("ffff")
    with pytest.raises(SGLangSyncError, match="no payload was exported from this worker's GPU"):
        _sender(client).sync(9, model.named_parameters())
    assert client.committed_version == 8  # a failed sync never advances the version


def test_trainer_refuses_a_family_the_client_cannot_map(tiny_model_dir, tmp_path):
    """An adapter that names no SGLang mapping (the toy here, or a user's own) is refused
    before any request; every shipped image family is served (tests/test_sglang_families.py)."""
    from trainer.config import load_config
    from trainer.engine.sglang.sync import sglang_config_problems
    from trainer.models import ADAPTERS

    overrides = trainer_overrides(tiny_model_dir("sd3"), "http://127.0.0.1:9", tmp_path)
    for family in ("toy", "qwen_image", "sd3", "flux"):
        overrides[0] = f"model.adapter_path={ADAPTERS[family]}"
        cfg = load_config("tiny", overrides)
        problems = sglang_config_problems(cfg.model, cfg.rollout, cfg.lora)
        refused = [p for p in problems if "the SGLang client maps" in p]
        assert (refused != []) == (family == "toy"), (family, problems)


def test_checker_catches_an_update_sglang_skipped(server, adapter):
    """SGLang's loader skips (with a log line) a tensor whose name the module lacks and still
    reports success: only the checker shows that the served weights did not change."""
    client = SGLangEngineClient(server.url)
    model = _bumped(adapter, 0.002)
    renamed = [("renamed." + n if i == 0 else n, p)
               for i, (n, p) in enumerate(model.named_parameters())]
    with pytest.raises(SGLangSyncError, match="missing 1 tensor"):
        _sender(client).sync(11, renamed)
    assert client.committed_version != 11




def test_training_run_samples_every_rollout_from_the_weights_it_synced(server, tiny_model_dir,
                                                                       tmp_path):
    """A CPU training run through SGLang's stock path: each step's weights go through SGLang's
    updater into the native DiT and its checker verifies them (the version advances only
    then), and the next rollout is sampled by them: its recorded log-probs are the new
    policy's replay, not the old one's."""
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    overrides = trainer_overrides(tiny_model_dir("qwen_image"), server.url, tmp_path)
    cfg = load_config("tiny", overrides + ["train.num_rollouts=3", "train.lr=2e-2"])
    preflight(cfg, world_size=1, device="cpu")
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    adapter = server.adapter
    try:
        assert trainer.engine.committed_version == 0
        for step in range(2):
            old = _policy_copy(trainer, adapter)
            seen = len(server.weight_requests)
            trainer.train_step(step)
            new = _policy_copy(trainer, adapter)
            kinds = [type(r).__name__ for r in server.weight_requests[seen:]]
            assert kinds[-1] == "UpdateWeightFromTensorCheckerReqInput"
            assert trainer.policy_version == trainer.engine.committed_version == step + 1
            assert_served_and_sampled_from(trainer, adapter, server, old, new, step)
    finally:
        trainer.close()


# ---- the stock path's bounded verification (trainer/engine/sglang/verify.py) --------------------
def _recorded(policy: VerifyPolicy) -> list:
    """The SyncCheck of every sync ``policy`` starts, in order."""
    checks, start = [], policy.start
    policy.start = lambda version: checks.append(start(version)) or checks[-1]
    return checks


def _served_sizes(model) -> dict[str, int]:
    served = _as_served(model.named_parameters())
    return {n: t.numel() * t.element_size() for n, t in served.items()}


def test_sampled_syncs_hash_only_their_window_and_cover_the_model(server, adapter):
    """The first sync asks SGLang's checker for every served tensor; each later one for the
    tensors meeting its window only (at most budget + 2 x the largest tensor), and every served
    tensor is asked for within ceil(total / budget) sampled syncs. Each sync still lands whole."""
    import math

    client = SGLangEngineClient(server.url)
    model = _bumped(adapter, 0.001)
    sizes = _served_sizes(model)
    total, budget = sum(sizes.values()), sum(sizes.values()) // 5
    policy = VerifyPolicy(budget_bytes=budget)
    checks = _recorded(policy)
    sender = _sender(client, verify=policy, bucket_bytes=1 << 20)
    sender.sync(20, model.named_parameters())
    assert set(server.weight_requests[-1].expected_named_tensors_sha256) == set(sizes)
    covered = set()
    for k in range(math.ceil(total / budget)):
        model = _bumped(adapter, 0.001 * (k + 2))
        stats = sender.sync(21 + k, model.named_parameters())
        asked = server.weight_requests[-1].expected_named_tensors_sha256
        assert not checks[-1].full and set(asked) == set(checks[-1].hashed) < set(sizes)
        assert stats.hashed_bytes == sum(sizes[n] for n in asked)
        assert stats.hashed_bytes <= budget + 2 * max(sizes.values())
        served = server.served_tensors()
        sent = _as_served(model.named_parameters())
        assert all(torch.equal(served[n], t) for n, t in sent.items())
        covered |= set(asked)
    assert covered == set(sizes) and client.committed_version == 20 + math.ceil(total / budget)
    sender.request_full()  # what the loop does after a checkpoint
    sender.sync(40, model.named_parameters())
    assert checks[-1].full and set(server.weight_requests[-1].expected_named_tensors_sha256) \
        == set(sizes)


def _corrupt_sent_bytes(monkeypatch, where: str):
    """The payload's first (or last) byte flipped after the sender hashed what it meant to
    send: the server then holds bytes the trainer's digest does not describe."""
    made = []

    def corrupted(named):
        flat = real(named)
        made.append(flat)
        if (where == "first" and len(made) == 1) or where == "last":
            index = 0 if where == "first" else -1
            flat["flattened_tensor"][index] ^= 1
        return flat

    real = sglang_sync.flattened_bucket
    monkeypatch.setattr(sglang_sync, "flattened_bucket", corrupted)
    return made


def test_checker_catches_a_corrupted_tensor_inside_the_window(server, adapter, monkeypatch):
    """SGLang's checker still verifies what was sent: a byte wrong on the server in a tensor
    of the sampled window fails the sync (the version stays); one outside it is the policy's
    stated blind spot, caught by the next full sync."""
    client = SGLangEngineClient(server.url)
    model = _bumped(adapter, 0.0015)
    sizes = _served_sizes(model)
    policy = VerifyPolicy(budget_bytes=sum(sizes.values()) // 5)
    checks = _recorded(policy)
    # one bucket: the flattened payload's first byte is the first tensor's, its last the last's
    sender = _sender(client, verify=policy, bucket_bytes=1 << 40)
    sender.sync(50, model.named_parameters())
    first, last = next(iter(sizes)), list(sizes)[-1]
    with monkeypatch.context() as m:
        _corrupt_sent_bytes(m, "first")
        with pytest.raises(SGLangSyncError, match="checksum mismatch"):
            sender.sync(51, model.named_parameters())
    assert first in checks[-1].hashed and client.committed_version == 50
    with monkeypatch.context() as m:
        _corrupt_sent_bytes(m, "last")
        sender.sync(51, model.named_parameters())  # the window [0, budget) misses the last
        assert last not in checks[-1].hashed and client.committed_version == 51
        assert not torch.equal(server.served_tensors()[last],
                               _as_served(model.named_parameters())[last])
        sender.request_full()
        with pytest.raises(SGLangSyncError, match="checksum mismatch"):
            sender.sync(52, model.named_parameters())
    assert checks[-1].full and client.committed_version == 51


def test_extension_config_against_a_stock_server_is_an_error(server, tiny_model_dir, tmp_path):
    """rollout.sglang_extension on, but the server has no extension route: the trainer stops
    and says how to start the server, instead of syncing another way than configured."""
    from trainer.config import load_config
    from trainer.engine.sglang.sync import connect_sglang
    from trainer.engine.sglang.transport import TransportError

    overrides = trainer_overrides(tiny_model_dir("qwen_image"), server.url, tmp_path)
    cfg = load_config("tiny", overrides + ["rollout.sglang_extension=true"])
    with pytest.raises(TransportError, match="SGLANG_PLUGINS=flowgrpo"):
        connect_sglang(cfg.model, cfg.rollout, cfg.lora, cfg.weight_sync, 0, tmp_path,
                       server.adapter)


def test_a_saved_checkpoint_makes_the_next_sync_verify_every_tensor(server, tiny_model_dir,
                                                                    tmp_path):
    """The loop's hook: after a step's sampled sync, saving a checkpoint makes the next sync
    ask SGLang's checker for every served tensor."""
    from trainer.checkpoint import latest_committed
    from trainer.config import load_config
    from trainer.loop import Trainer

    overrides = trainer_overrides(tiny_model_dir("qwen_image"), server.url, tmp_path)
    trainer = Trainer(load_config("tiny", overrides), rank=0, world=1, device="cpu")
    try:
        sizes = _served_sizes(_policy_copy(trainer, server.adapter))
        policy = VerifyPolicy(budget_bytes=sum(sizes.values()) // 5)
        checks = _recorded(policy)
        trainer.sender.verify = policy
        trainer.sync_weights()           # a new policy's first sync: full
        trainer.train_step(0)            # sampled
        assert [c.full for c in checks] == [True, False]
        assert set(server.weight_requests[-1].expected_named_tensors_sha256) < set(sizes)
        trainer.maybe_save(1, is_last=True)
        assert latest_committed(tmp_path / "run" / "checkpoints") is not None
        trainer.sync_weights()
        assert checks[-1].full
        assert set(server.weight_requests[-1].expected_named_tensors_sha256) == set(sizes)
    finally:
        trainer.close()
