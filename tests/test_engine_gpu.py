"""The embedded engine on a CUDA device (skipped without one): bf16 generate with the Triton
kernels, recorded log-prob == replay, release/resume really moving memory, and a spawned
engine whose results cross CUDA IPC and whose weights are synced through ipc's CUDA backend.

    python -m pytest -q tests/test_engine_gpu.py      (needs diffusers, safetensors, cupy)
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

import flowgrpo_kernels as kernels
from engine_fixtures import ADAPTER_PATH, FixtureAdapter, build_fixture_model_dir, make_request
from trainer.engine import EngineStateError, launch_embedded_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["a red panda"] * 4 + ["a teacup"] * 4
IDS = [f"prompt:{g}:sample:{s}" for g in (0, 1) for s in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_fixture_model_dir(tmp_path_factory.mktemp("fixture_gpu"))


def _launch(model_dir, **kw):
    return launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                  adapter_options=None, device="cuda:0", dtype="bf16", lora=None, **kw)


def test_cuda_generate_replay_release_resume(model_dir):
    adapter = FixtureAdapter(str(model_dir))
    client = _launch(model_dir, in_process=True)
    try:
        request = make_request(adapter, PROMPTS, IDS)
        first = client.generate(request)
        assert first["images"].is_cuda and first["dit_trajectory"]["latents"].dtype == torch.float32
        batch = adapter.pack_trajectory(first, request)
        core = client._transport.core
        for k in range(len(batch.sde_indices)):
            with torch.no_grad():
                v = adapter.replay_velocity(core.transformer, batch, k)
            replayed = kernels.sde_log_prob(batch.latents[:, k], v, batch.next_latents[:, k],
                                            batch.sigmas[:, k].cuda(), batch.sigmas_next[:, k].cuda(),
                                            eta=batch.eta, sde_type=batch.sde_type)
            assert torch.equal(replayed, batch.log_probs[:, k]), k
        text_weight = core.frozen["text"].weight.detach().clone()
        allocated = torch.cuda.memory_allocated()
        info = client.release()
        assert "text" in info["moved"] and "transformer" in info["moved"]
        assert core.frozen["text"].weight.numel() == 0 and torch.cuda.memory_allocated() < allocated
        assert next(core.transformer.parameters()).device.type == "cpu"
        with pytest.raises(EngineStateError):
            client.generate(request)
        client.resume()
        assert torch.equal(core.frozen["text"].weight, text_weight)
        assert next(core.transformer.parameters()).is_cuda
        again = client.generate(request)
        assert torch.equal(again["dit_trajectory"]["latents"], first["dit_trajectory"]["latents"])
        assert torch.equal(again["images"], first["images"])
    finally:
        client.close()


@pytest.mark.multiproc
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="ipc's CUDA backend needs cupy")
def test_spawned_cuda_engine_with_ipc_sync(model_dir):
    import ipc

    adapter = FixtureAdapter(str(model_dir))
    request = make_request(adapter, PROMPTS, IDS)
    send_end, recv_end = ipc.channel_pair()
    client = _launch(model_dir, weight_sync_conn=recv_end)
    sender = ipc.WeightSender(send_end, timeout_s=120.0)
    local = _launch(model_dir, in_process=True)
    try:
        remote, here = client.generate(request), local.generate(request)
        assert remote["images"].is_cuda  # arrived over CUDA IPC, cloned into our memory
        assert torch.equal(remote["dit_trajectory"]["latents"], here["dit_trajectory"]["latents"])
        assert torch.equal(remote["rollout_log_probs"], here["rollout_log_probs"])
        model = adapter.load_train_model(dtype=torch.bfloat16, device="cuda:0")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.02)
        tensors = dict(model.named_parameters())
        stats = sender.sync(1, tensors, mode="full")
        assert stats.backend == "cuda"
        assert client.version == 1 and client.checksum() == stats.checksum
        assert stats.checksum == ipc.weights_checksum(tensors)
        after = client.generate(request)
        assert after["policy_version"] == 1
        assert not torch.equal(after["images"], remote["images"])
    finally:
        local.close()
        sender.close()
        client.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_sampler_loop_never_waits_for_the_gpu():
    """The engine's denoise loop (ODE and SDE steps, the fused kernels, the recorded
    trajectory) runs in torch's sync-debug "error" mode: nothing in it makes the host wait
    for the GPU, so the host queues the steps ahead of it. Control: a host read raises."""
    from trainer.engine.embedded.sampler import denoise

    x = torch.randn(4, 256, 64, device="cuda")
    noise = torch.randn(4, 256, 64, device="cuda")
    sigmas = [1.0, 0.9, 0.75, 0.5, 0.3, 0.0]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            x.sum().item()
        out = denoise(lambda z, s: 0.5 * z, x, sigmas, [1, 2], eta=0.7, sde_type="sde",
                      noise_fn=lambda i: noise)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.log_probs.shape == (4, 2) and bool(torch.isfinite(out.log_probs).all())
