"""Run-level faults: the run-dir lock, --resume / --overwrite, a run that cannot train, and
(end to end through ``python -m trainer launch`` on the toy model) their exit codes."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.checkpoint import layout
from trainer.config import load_config
from trainer.rundir import RunDirError, RunDirLock, claim_run_dir
from trainer.watchdog import TrainingStalledError, check_progress

ROOT = Path(__file__).resolve().parents[1]


def _cfg(run_dir: Path, *sets: str):
    return load_config("toy", [f"logging.run_dir={run_dir}", *sets])


def _committed(run_dir: Path, n: int) -> Path:
    d = run_dir / "checkpoints" / "t2i" / layout.iter_name(n)
    (d / layout.FSDP_DIR).mkdir(parents=True)
    (d / layout.FSDP_DIR / "__0_0.distcp").write_bytes(b"x" * 64)
    layout.write_commit_marker(d, n, 1)
    return d


def test_lock_refuses_a_second_holder_naming_it(tmp_path):
    """Another process holds the lock: refused with its pid and host; once it exits (the
    kernel drops the lock, even on SIGKILL) the directory is free again."""
    code = ("import sys, time; from trainer.rundir import RunDirLock; "
            "RunDirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError) as e:
            RunDirLock(tmp_path).acquire()
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    with RunDirLock(tmp_path):
        pass


def test_a_dir_holding_a_run_needs_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    assert claim_run_dir(_cfg(run)).checkpoint.load is None       # empty: nothing to decide
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    _committed(run, 2)
    with pytest.raises(RunDirError, match=r"metrics.jsonl \(2 lines\).*\[2\].*--resume.*"
                                          r"--overwrite"):
        claim_run_dir(_cfg(run))
    resumed = claim_run_dir(_cfg(run, "checkpoint.resume=true"))
    assert resumed.checkpoint.load == str(run / "checkpoints")
    assert (run / "metrics.jsonl").read_text()                   # resume keeps the history
    with pytest.raises(RunDirError, match="contradict"):
        claim_run_dir(_cfg(run, "checkpoint.resume=true", "checkpoint.overwrite=true"))
    claim_run_dir(_cfg(run, "checkpoint.overwrite=true"))
    assert (run / "metrics.jsonl").read_text() == ""             # overwrite clears it


def test_an_explicit_older_load_needs_overwrite_to_truncate(tmp_path):
    run = tmp_path / "run"
    old = _committed(run, 2)
    _committed(run, 4)
    with pytest.raises(RunDirError, match=r"older than the committed iterations \[4\]"):
        claim_run_dir(_cfg(run, f"checkpoint.load={old}"))
    assert claim_run_dir(_cfg(run, f"checkpoint.load={old}", "checkpoint.overwrite=true"))


class _Run:
    def __init__(self, limit: int):
        self.cfg = _cfg(Path("unused"), f"train.max_rollouts_without_step={limit}")


def test_stall_guard_counts_consecutive_empty_rollouts():
    run = _Run(3)
    empty = {"train/optimizer_steps": 0.0, "reward/failed_groups": 4.0}
    check_progress(run, 0, dict(empty))
    check_progress(run, 1, dict(empty))
    check_progress(run, 2, {"train/optimizer_steps": 2.0})          # a step resets the streak
    check_progress(run, 3, dict(empty))
    check_progress(run, 4, dict(empty))
    with pytest.raises(TrainingStalledError, match=r"last 3 rollouts \(3..5.*4 group\(s\) "
                                                   r"failed their reward checks"):
        check_progress(run, 5, dict(empty))
    never = _Run(0)
    for i in range(50):
        check_progress(never, i, {"train/optimizer_steps": 0.0})


# ---- end to end: python -m trainer launch --config toy -------------------------------------
def _launch(run_dir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer", "launch", "--config", "toy",
           "--set", f"logging.run_dir={run_dir}", "--set", "data.eval_prompt_data=none",
           "--set", "logging.progress=false", "--set", "rollout.write_artifacts=false",
           "--set", "logging.tensorboard=false", "--set", "rollout.rollout_batch_size=2",
           *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               HF_HUB_OFFLINE="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in
            (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.multiproc
def test_launch_refuses_a_used_run_dir_and_resume_continues_it(tmp_path):
    """Run 2 rollouts (save_interval 0: saved at the end); a second launch into the same
    directory exits 1 and touches nothing; with --resume it continues at rollout 3 and the
    metrics hold each step once."""
    run = tmp_path / "run"
    first = _launch(run, "--set", "train.num_rollouts=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert [n for n, _ in layout.committed_iterations(run / "checkpoints" / "t2i")] == [2]
    again = _launch(run, "--set", "train.num_rollouts=3")
    assert again.returncode == 1
    assert "already holds a run" in again.stderr and "--resume" in again.stderr
    assert "Traceback" not in again.stderr
    assert _steps(run) == [1, 2]
    resumed = _launch(run, "--set", "train.num_rollouts=3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "iter_0000002" in resumed.stderr
    assert _steps(run) == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.multiproc
def test_launch_that_cannot_train_exits_nonzero_naming_the_cause(tmp_path):
    """Every group fails its required reward component: after
    --max-rollouts-without-step rollouts the run stops with exit code 1 and the cause."""
    t0 = time.monotonic()
    proc = _launch(tmp_path / "run", "--set", "train.num_rollouts=6",
                   "--set", "reward.custom_reward_path=fault_rewards.always_nan",
                   "--set", "reward.scorer_path=none",  # the toy components would be unweighed
                   "--set", 'reward.required_components=["always_nan"]',
                   "--set", 'reward.component_weights={"always_nan": 1.0}',
                   "--max-rollouts-without-step", "2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "no optimizer step in the last 2 rollouts" in proc.stderr
    assert "failed their reward checks" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 300


@pytest.mark.slow
@pytest.mark.multiproc
def test_launch_whose_final_save_fails_exits_nonzero_naming_the_os_error(tmp_path):
    """--save on a 256 KiB tmpfs (a toy checkpoint is MBs): the save after rollout 1 fails
    and training goes on; the final save after rollout 2 fails too, so the run's result is
    not on disk: exit 1 naming ENOSPC."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("needs to mount a small tmpfs (root); the ENOSPC path itself is covered "
                    "in test_checkpoint_faults.py")
    try:
        proc = _launch(tmp_path / "run", "--set", "train.num_rollouts=2",
                       "--set", "checkpoint.save_interval=1",
                       "--set", f"checkpoint.save={disk / 'ckpt'}")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert sorted({row["step"] for row in rows}) == [1, 2]   # rollout 2 ran after a failed save
    assert [(row["step"], row["train/checkpoint_failures"]) for row in rows
            if set(row) == {"step", "time", "train/checkpoint_failures"}] == [(1, 1.0), (2, 2.0)]
    assert "CHECKPOINT FAILED" in proc.stderr and "training continues" in proc.stderr
    final = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 0:")]
    assert len(final) == 1, proc.stderr[-3000:]
    assert "final checkpoint (step 2) was not saved" in final[0]
    assert "ENOSPC: No space left on device" in final[0]
    assert "there is no committed checkpoint" in final[0]
    assert "Traceback" not in proc.stderr
