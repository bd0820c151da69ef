"""The embedded engine as its own process (spawn): same results as in-process, errors cross
the pipe, its HTTP mode, and weight updates through ipc/ (full, then LoRA adapter mode) with
the engine's checksum equal to the sender's and the replayed log-prob equal to the recorded."""
from __future__ import annotations

import os

import pytest
import torch

import ipc
import flowgrpo_kernels as kernels
from engine_fixtures import ADAPTER_PATH, FixtureAdapter, build_fixture_model_dir, make_request
from trainer.engine import RequestError, SGLangEngineClient, launch_embedded_engine

pytestmark = [pytest.mark.slow, pytest.mark.multiproc, pytest.mark.usefixtures("torch_single_thread")]

# served unmerged: the replay below is then bitwise the engine's record (the merged adapter's
# parity is tested in test_compute_path.py)
LORA = {"rank": 4, "alpha": 8, "target_modules": ["attn.to_q", "attn.to_v"], "merge": False}
PROMPTS = ["a red panda"] * 2 + ["a teacup"] * 2
IDS = [f"prompt:{g}:sample:{s}" for g in (0, 1) for s in (0, 1)]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    model_dir = build_fixture_model_dir(tmp_path_factory.mktemp("fixture_spawn"))
    send_end, recv_end = ipc.channel_pair()
    client = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=LORA,
                                    weight_sync_conn=recv_end, http_port=0)
    sender = ipc.WeightSender(send_end, timeout_s=120.0)
    yield client, sender, FixtureAdapter(str(model_dir)), model_dir
    sender.close()
    process = client._transport.process
    client.close()
    assert process.exitcode == 0


def test_spawned_engine_serves_like_in_process(spawned):
    client, _, adapter, model_dir = spawned
    health = client.health()
    assert health["pid"] == client.pid != os.getpid() and health["lora"] and health["weight_sync"]
    request = make_request(adapter, PROMPTS, IDS)
    remote = client.generate(request)
    local = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                   adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                   in_process=True)
    try:
        here = local.generate(request)
    finally:
        local.close()
    # LoRA B starts at 0, so the LoRA engine in another process samples exactly the base model
    for key in ("rollout_log_probs", "images"):
        assert torch.equal(remote[key], here[key]), key
    assert torch.equal(remote["dit_trajectory"]["latents"], here["dit_trajectory"]["latents"])
    # the HTTP mode of the same process answers the same
    over_http = SGLangEngineClient(client.http_url).generate(request)
    assert torch.equal(over_http["dit_trajectory"]["latents"], remote["dit_trajectory"]["latents"])
    assert torch.equal(over_http["images"], remote["images"])
    # an engine-side validation error arrives as the same exception, every problem listed
    with pytest.raises(RequestError) as info:
        client.generate(dict(request, height=31, guidance_scale=0.5))
    assert len(info.value.problems) >= 2
    assert any("guidance_scale" in p for p in info.value.problems)
    assert any("multiples of 16" in p for p in info.value.problems)


def test_weight_sync_full_then_adapter(spawned):
    from peft import LoraConfig, get_peft_model

    client, sender, adapter, _ = spawned
    request = make_request(adapter, PROMPTS, IDS)
    before = client.generate(request)
    model = get_peft_model(adapter.load_train_model(), LoraConfig(
        r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"],
        init_lora_weights=True))
    names = adapter.weight_name_map([n for n, _ in model.named_parameters()])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.mul_(1.01)
    full = {names[n]: p.detach() for n, p in model.named_parameters()}
    stats = sender.sync(0, full, mode="full")
    assert client.checksum() == stats.checksum == ipc.weights_checksum(full)
    assert client.version == 0

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    lora_only = {names[n]: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    stats = sender.sync(1, lora_only, mode="adapter")
    everything = {names[n]: p.detach() for n, p in model.named_parameters()}
    assert client.version == 1
    assert client.checksum() == ipc.weights_checksum(everything)
    after = client.generate(request)
    assert after["policy_version"] == 1
    assert not torch.equal(after["dit_trajectory"]["latents"], before["dit_trajectory"]["latents"])
    # the actor replays the engine's record on its own (LoRA) model: identical log-probs
    batch = adapter.pack_trajectory(after, request)
    for k in range(len(batch.sde_indices)):
        with torch.no_grad():
            v = adapter.replay_velocity(model, batch, k)
        replayed = kernels.sde_log_prob(batch.latents[:, k], v, batch.next_latents[:, k],
                                        batch.sigmas[:, k], batch.sigmas_next[:, k],
                                        eta=batch.eta, sde_type=batch.sde_type)
        assert torch.equal(replayed, batch.log_probs[:, k]), k
