"""--offload-train on a CUDA device (skipped without one): between steps the actor's parameter,
gradient and AdamW storage leaves the GPU (the device bytes are measured, not assumed), and a
run with offload trains exactly like one without it.

    python -m pytest -q -o addopts= tests/test_offload_gpu.py
"""
from __future__ import annotations

import os

import pytest
import torch

from dist_fixtures import free_port

# Deterministic GPU maths in this process, so that the two runs can be compared closely: what
# is asserted is "offload changes nothing", not the GPU's run-to-run reduction order.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _trainer(tmp_path, name: str, offload: bool):
    from trainer.config import load_config
    from trainer.loop import Trainer

    cfg = load_config("toy", [
        "train.num_rollouts=3", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
        "train.micro_batch_size=4", "data.eval_prompt_data=none", "launch.device=cuda",
        f"fsdp.offload_train={'true' if offload else 'false'}", "logging.progress=false",
        "fsdp.offload_policy=always",  # offload every step (as_needed would skip it here)
        "logging.tensorboard=false", f"logging.run_dir={tmp_path / name}"])
    return Trainer(cfg, rank=0, world=1, device="cuda")


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (a DTensor's gathered, a plain tensor as is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _actor_bytes(trainer) -> int:
    from trainer.actor.model import _local, actor_tensors

    return sum(_local(t).untyped_storage().nbytes()
               for t in actor_tensors(trainer.actor.model, trainer.actor.optimizer))


def test_offload_frees_the_actor_and_changes_nothing(tmp_path, process_group):
    from trainer.actor.model import offload_actor, onload_actor

    plain, offl = _trainer(tmp_path, "plain", False), _trainer(tmp_path, "offload", True)
    try:
        for rollout in range(2):
            a, b = plain.train_step(rollout), offl.train_step(rollout)
            for key in ("reward/mean", "train/loss", "train/ratio_mean", "train/grad_norm"):
                torch.testing.assert_close(a[key], b[key], msg=f"rollout {rollout} {key}")
            assert offl.offloaded is not None and plain.offloaded is None
            # offloaded: every actor tensor's local storage is gone from the device ...
            assert _actor_bytes(offl) == 0
            # ... and the allocator's live and reserved bytes fall by at least the actor's
            torch.cuda.synchronize()
            off_alloc = torch.cuda.memory_allocated()
            onload_actor(offl.model, offl.optimizer, offl.offloaded)
            torch.cuda.synchronize()
            on_bytes, on_alloc = _actor_bytes(offl), torch.cuda.memory_allocated()
            assert on_bytes > 1_000_000  # 1.3 M fp32 params + AdamW moments
            assert on_alloc - off_alloc >= on_bytes, (on_alloc, off_alloc, on_bytes)
            # the step reports the bytes its offload moved (bench_step.py's PCIe floor)
            assert b["perf/offload_gb"] * 1e9 == pytest.approx(on_bytes, rel=1e-6)
            assert "perf/offload_gb" not in a
            reserved_on = torch.cuda.memory_reserved()
            offl.offloaded = offload_actor(offl.model, offl.optimizer)
            # reserved bytes are reported, not asserted: this model's tensors are all small
            # and share the allocator's 2 MiB segments with other live tensors
            print(f"actor {on_bytes} B; allocated {on_alloc} -> {off_alloc}; reserved "
                  f"{reserved_on} -> {torch.cuda.memory_reserved()}")
        # the trained weights agree after onload (a lost or stale shard would be far off)
        onload_actor(offl.model, offl.optimizer, offl.offloaded)
        offl.offloaded = None
        bitwise = True
        for (n, p), (_, q) in zip(plain.model.named_parameters(), offl.model.named_parameters()):
            p, q = _full(p), _full(q)
            torch.testing.assert_close(q, p, msg=n)
            bitwise = bitwise and torch.equal(p, q)
        print(f"weights after 2 steps bitwise equal: {bitwise}")
        assert plain.policy_version == offl.policy_version == 2
    finally:
        plain.close()
        offl.close()


def _onload_into_nan_blocks(monkeypatch, skip_wait: bool) -> list[bool]:
    """Route the loop's onload through NaN-filled cached blocks, with the optimizer state's
    side-stream copies held back ~0.5 s: a step that reads the state before its copies land
    reads NaN. Returns, per onload, whether the state's copies were deferred."""
    import trainer.loop as loop_mod
    from trainer.actor.model import PendingOnload

    real_onload, deferred = loop_mod.onload_actor, []

    def onload(model, optimizer, state, *, state_stream=None):
        # the blocks the onload will be given back, filled with NaN and returned to the cache
        torch.cuda.empty_cache()
        junk = [torch.full((nbytes // cpu.element_size(),), float("nan"), dtype=cpu.dtype,
                           device="cuda") for cpu, nbytes in state.host.values()]
        del junk
        if state_stream is not None:
            with torch.cuda.stream(state_stream):
                torch.cuda._sleep(1_000_000_000)
        pending = real_onload(model, optimizer, state, state_stream=state_stream)
        deferred.append(pending.event is not None)
        return pending

    monkeypatch.setattr(loop_mod, "onload_actor", onload)
    if skip_wait:
        monkeypatch.setattr(PendingOnload, "wait", lambda self: None)
    return deferred


@pytest.mark.parametrize("skip_wait", [False, True])
def test_optimizer_state_onload_overlaps_and_the_step_waits(tmp_path, process_group,
                                                            monkeypatch, skip_wait):
    """The loop copies the optimizer state back on a side stream (overlapping the first
    forwards) and the first optimizer step waits for it: with the copies delayed and the
    blocks they land in pre-filled with NaN, the offloaded run still trains like the plain
    one. The control (skip_wait) shows the setup reaches the race: without the wait the step
    reads what the blocks held before the copies."""
    from trainer.actor.model import onload_actor

    plain, offl = _trainer(tmp_path, "plain", False), _trainer(tmp_path, "offload", True)
    deferred = _onload_into_nan_blocks(monkeypatch, skip_wait)
    try:
        for rollout in range(2):
            a, b = plain.train_step(rollout), offl.train_step(rollout)
        assert deferred == [True]  # rollout 1 onloads, with the state on the side stream
        onload_actor(offl.model, offl.optimizer, offl.offloaded)
        offl.offloaded = None
        full = [(_full(p), _full(q)) for p, q in zip(plain.model.parameters(),
                                                     offl.model.parameters())]
        if skip_wait:  # NaN where the cache gave the junk back, stale bytes elsewhere
            assert any(not torch.isfinite(q).all() or not torch.allclose(q, p) for p, q in full)
            return
        torch.testing.assert_close(a["train/loss"], b["train/loss"])
        for p, q in full:
            torch.testing.assert_close(q, p)
    finally:
        plain.close()
        offl.close()
