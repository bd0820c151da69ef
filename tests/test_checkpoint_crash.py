"""SIGKILL a process that saves checkpoints back to back, at random moments, many times:
resume must never trust a half-written checkpoint and must always pick the last COMMITTED one.

Children come from a forkserver that has torch and the checkpoint code imported, so a child
starts in milliseconds instead of paying the imports (seconds) twenty times.
"""
import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch

import test_checkpoint_harness as h
from trainer.checkpoint import latest_committed, load_checkpoint
from trainer.checkpoint import layout

KILLS = 20


def _log_lines(path):
    return path.read_text().split("\n")[:-1] if path.exists() else []


def _wait_for_start(path, seen, proc, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = _log_lines(path)
        starts = [ln for ln in lines[seen:] if ln.startswith("start ")]
        if starts:
            return int(starts[0].split()[1])
        assert proc.is_alive(), f"child died before starting (exit code {proc.exitcode})"
        time.sleep(0.005)
    raise TimeoutError("child did not start")


@pytest.mark.slow
@pytest.mark.multiproc
def test_sigkill_during_saves_never_leaves_a_trusted_partial_checkpoint(tmp_path,
                                                                        torch_single_thread):
    model_dir = h.save_tinynet(tmp_path / "model", dim=48, num_blocks=3)
    root, log = tmp_path / "ckpt", tmp_path / "child.log"
    ctx = mp.get_context("forkserver")
    # torch._dynamo: AdamW's constructor imports it lazily (~5 s under load, per child)
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "trainer.checkpoint",
                                "trainer.actor.model", "trainer.loop", "test_checkpoint_harness"])
    checker = h.make_trainer(model_dir, root, lora=False)
    rng = random.Random(20240607)
    latest_n, mid_save = 0, 0
    for kill in range(KILLS):
        seen = len(_log_lines(log))
        proc = ctx.Process(target=h.crash_child, args=(str(model_dir), str(root), str(log)))
        proc.start()
        # the restarted run resumes from the last committed iteration, never another one
        assert _wait_for_start(log, seen, proc) == latest_n
        time.sleep(rng.uniform(0.0, 1.2))  # a save takes 0.1-0.4 s here: kills land anywhere
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, f"child ended on its own ({proc.exitcode})"

        logged = [int(ln.split()[1]) for ln in _log_lines(log)[seen:] if ln.startswith("saved ")]
        last_logged = max(logged, default=latest_n)
        found = latest_committed(root)
        n = layout.parse_iter(found.name) if found is not None else 0
        # a save may commit and be killed before it logs: at most one ahead of the log
        assert last_logged <= n <= last_logged + 1 and n >= latest_n
        latest_n = n
        committed = layout.committed_iterations(root / "t2i")
        assert len(committed) <= 2  # rotation held even across kills
        if any(layout.commit_problems(d) for _, d in layout.iteration_dirs(root / "t2i")):
            mid_save += 1  # this kill landed inside a save: its directory is not trusted
        if n:
            assert load_checkpoint(checker.checkpointer, root) == found
            assert (checker.next_rollout, checker.policy_version) == (n, n)
            for i, p in enumerate(checker.model.parameters()):
                assert torch.equal(p.detach(), h.expected_weight(n, i, p.shape)), (n, i)
    assert latest_n >= 3, "the children hardly saved anything: the test exercised nothing"
    assert mid_save >= KILLS // 4, f"only {mid_save} of {KILLS} kills landed inside a save"
