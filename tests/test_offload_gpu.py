"""--offload-train on a CUDA device (skipped without one): between steps the actor's parameter,
gradient and AdamW storage leaves the GPU (the device bytes are measured, not assumed), and a
run with offload trains exactly like one without it.

    python -m pytest -q -o addopts= tests/test_offload_gpu.py
"""
from __future__ import annotations

import os
import socket

import pytest
import torch

# Deterministic GPU maths in this process, so that the two runs can be compared closely: what
# is asserted is "offload changes nothing", not the GPU's run-to-run reduction order.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
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


def _actor_bytes(trainer) -> int:
    from trainer.actor.model import _local, actor_tensors

    return sum(_local(t).untyped_storage().nbytes()
               for t in actor_tensors(trainer.model, trainer.optimizer))


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
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            q = q.full_tensor() if hasattr(q, "full_tensor") else q
            torch.testing.assert_close(q, p, msg=n)
            bitwise = bitwise and torch.equal(p, q)
        print(f"weights after 2 steps bitwise equal: {bitwise}")
        assert plain.policy_version == offl.policy_version == 2
    finally:
        plain.close()
        offl.close()
