"""Run-level faults: the run-dir lock, --resume / --overwrite, a run that cannot train, and
(end to end through ``python -m trainer launch`` on the toy model) their exit codes."""
from __future__ import annotations

import dataclasses
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



# ---- issue 49: shared checkpoint roots, resume and --load guards ----------------------------
def _hold(code: str, *args: str) -> subprocess.Popen:
    """A second process running ``code`` (which prints 'held' once ready) until killed."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_saving_into_a_held_checkpoint_root_is_refused_naming_the_first(tmp_path):
    """Two runs, two run dirs, one --save: the second is refused naming the first's run dir
    (issue 49, bad 1); the first's run-dir lock releases the root with it."""
    root, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    code = ("import sys, time; from trainer.config import load_config; "
            "from trainer.rundir import RunDirLock, claim_run_dir; "
            "cfg = load_config('toy', [f'logging.run_dir={sys.argv[1]}', "
            "f'checkpoint.save={sys.argv[2]}']); "
            "RunDirLock(sys.argv[1]).acquire(); claim_run_dir(cfg); print('held', flush=True); "
            "time.sleep(60)")
    holder = _hold(code, str(first), str(root))
    try:
        with pytest.raises(RunDirError) as e:
            claim_run_dir(_cfg(second, f"checkpoint.save={root}"))
        assert f"checkpoint root {root}" in str(e.value)
        assert f"the run in {first}" in str(e.value) and f"pid {holder.pid}" in str(e.value)
        assert "another --save" in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    lock = RunDirLock(second).acquire()
    try:
        claim_run_dir(_cfg(second, f"checkpoint.save={root}"))   # free once the first ended
    finally:
        lock.release()
    code = ("import sys, time; from trainer.rundir import CheckpointRootLock; "
            "CheckpointRootLock(sys.argv[1]).acquire(); print('held', flush=True); "
            "time.sleep(60)")
    holder = _hold(code, str(root))                               # released with the run dir
    holder.kill()
    holder.wait()


def test_rotation_leaves_an_iteration_another_live_process_is_writing(tmp_path):
    """An uncommitted iter_* whose writer tag names another live process is not rotation's to
    delete (issue 49, bad 1: both runs' rotations deleted the other's iteration in flight);
    once that process is gone it is a crash leftover and goes."""
    task = tmp_path / "t2i"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = task / layout.iter_name(3)
        (busy / layout.FSDP_DIR).mkdir(parents=True)
        (busy / layout.FSDP_DIR / "__0_0.distcp").write_bytes(b"x" * 64)
        (busy / ".writer").write_text(json.dumps({"host": socket.gethostname(),
                                                  "pid": other.pid, "time": time.time()}))
        layout.rotate(task, keep=2, new_iteration=4)
        assert busy.is_dir() and (busy / layout.FSDP_DIR / "__0_0.distcp").is_file()
        with pytest.raises(layout.CheckpointError, match=f"pid {other.pid}.*one --save"):
            layout.rotate(task, keep=2, new_iteration=3)
    finally:
        other.kill()
        other.wait()
    layout.rotate(task, keep=2, new_iteration=5)
    assert not busy.exists()
    assert json.loads((task / layout.iter_name(5) / ".writer").read_text())["pid"] == os.getpid()


def test_resume_without_save_finds_the_recorded_root_and_never_clears_history(tmp_path):
    """The first run saved to another root; --resume without --save continues from there
    (issue 49, bad 2). A --resume that finds history and no checkpoint is refused, naming
    --overwrite, and leaves the history as it was."""
    from trainer.config import write_resolved
    run, root = tmp_path / "run", tmp_path / "elsewhere"
    write_resolved(_cfg(run, f"checkpoint.save={root}"), run)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "tensorboard").mkdir()
    d = root / "t2i" / layout.iter_name(2)
    (d / layout.FSDP_DIR).mkdir(parents=True)
    (d / layout.FSDP_DIR / "__0_0.distcp").write_bytes(b"x" * 64)
    layout.write_commit_marker(d, 2, 1)
    resumed = claim_run_dir(_cfg(run, "checkpoint.resume=true"))
    assert resumed.checkpoint.save == str(root) and resumed.checkpoint.load == str(root)
    assert (run / "metrics.jsonl").read_text().count("\n") == 2
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text('{"step": 1}\n')
    (bare / "tensorboard").mkdir()
    with pytest.raises(RunDirError, match=r"no committed checkpoint.*--overwrite"):
        claim_run_dir(_cfg(bare, "checkpoint.resume=true"))
    assert (bare / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (bare / "tensorboard").is_dir()


def test_load_of_another_runs_checkpoints_into_a_used_run_dir_keeps_every_guard(tmp_path):
    """--load changes no guard (issue 49, bad 3): a used run dir still needs --resume or
    --overwrite, and a load older than this run's own committed iterations needs --overwrite;
    nothing is touched until one is given."""
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    history = "".join(f'{{"step": {i}}}\n' for i in range(1, 7))
    (run / "metrics.jsonl").write_text(history)
    _committed(run, 6)
    loaded = _committed(other, 2).parent.parent
    with pytest.raises(RunDirError, match="already holds a run") as e:
        claim_run_dir(_cfg(run, f"checkpoint.load={loaded}"))
    assert "older than the committed iterations [6]" in str(e.value)     # both, in one error
    with pytest.raises(RunDirError, match=r"older than the committed iterations \[6\]"):
        claim_run_dir(_cfg(run, f"checkpoint.load={loaded}", "checkpoint.resume=true"))
    assert (run / "metrics.jsonl").read_text() == history
    assert layout.committed_iterations(run / "checkpoints" / "t2i")
    claimed = claim_run_dir(_cfg(run, f"checkpoint.load={loaded}", "checkpoint.overwrite=true"))
    assert claimed.checkpoint.load == str(loaded)
    assert (run / "metrics.jsonl").read_text() == ""


def test_resume_with_other_prompt_data_warns_naming_both(tmp_path, caplog):
    """Resuming with a different prompt file is a warning naming both (issue 49; the choice
    is documented in trainer.rundir): same path, changed content included."""
    run, prompts = tmp_path / "run", tmp_path / "prompts.txt"
    prompts.write_text("a red cube\n")
    claim_run_dir(_cfg(run, f"data.prompt_data={prompts}"))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    _committed(run, 1)
    with caplog.at_level("WARNING", logger="trainer"):
        claim_run_dir(_cfg(run, f"data.prompt_data={prompts}", "checkpoint.resume=true"))
    assert "different prompt data" not in caplog.text
    prompts.write_text("a blue ball\n")
    with caplog.at_level("WARNING", logger="trainer"):
        claim_run_dir(_cfg(run, f"data.prompt_data={prompts}", "checkpoint.resume=true"))
    assert "different prompt data" in caplog.text and str(prompts) in caplog.text


def test_a_run_dir_under_a_file_is_one_clear_error(tmp_path):
    """run_dir inside a regular file (issue 49): one RunDirError naming the path, no raw
    traceback from mkdir."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match=r"cannot be created or locked \(ENOTDIR"):
        RunDirLock(blocker / "run").acquire()


# ---- issue 49: a full disk under the run dir -------------------------------------------------
_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
import numpy as np
from trainer.metrics import MetricsLogger
run = Path(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # past the limit a write fails with EFBIG
m = MetricsLogger(run, tensorboard=False)
m.log(1, {"reward/mean": 0.5}, console=False)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
size = (run / "metrics.jsonl").stat().st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, hard))   # the disk fills mid-line
m.log(2, {f"train/metric_{i}": float(i) for i in range(20)}, console=False)
noise = np.random.default_rng(0).integers(0, 255, (4, 64, 64, 3), dtype=np.uint8)
m.image_grid("train/samples", 2, noise[:, :16, :16], path=run / "p" / "s.png")
m.image("eval/samples", 2, noise[0], path=run / "eval" / "e.png")
assert not m.write_text("summary.json", json.dumps({"last": {"x": 1.0}}) * 20)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))        # space again
m.log(3, {"reward/mean": 0.7}, console=False)
m.close()
print("survived", flush=True)
"""


def test_a_full_disk_under_the_run_dir_is_counted_and_metrics_lines_stay_whole(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk (a small tmpfs needs root): a metrics line cut
    short, two pictures and the summary fail; the process goes on, metrics.jsonl holds whole lines only,
    and the next line carries logging/write_failures (issue 49, bad 7)."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, str(run)], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr[-3000:]
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in rows] == [1, 3]
    assert rows[1]["logging/write_failures"] == 4.0
    assert not (run / "summary.json").exists() and not list(run.glob(".*.tmp"))
    assert "could not write metrics.jsonl" in proc.stderr and "EFBIG" in proc.stderr
    assert not (run / "p" / "s.png").exists() and not list((run / "p").glob("*tmp*"))


def test_resume_drops_a_torn_last_metrics_line_with_a_warning(tmp_path, caplog):
    """A crash mid-write left half a line: the resume cut removes it, says so, and the next
    line starts on a line of its own (issue 49, bad 7)."""
    from trainer.metrics import MetricsLogger
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a')
    m = MetricsLogger(run, tensorboard=False)
    with caplog.at_level("WARNING", logger="trainer"):
        m.truncate_after(2)
    m.log(3, {"a": 3.0}, console=False)
    m.close()
    assert "torn last line" in caplog.text
    assert [json.loads(line)["step"] for line in
            (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_failed_artifact_write_is_counted_not_raised(tmp_path, caplog):
    """The rollout's artifact writes (sidecars, PNGs under the run dir) settle through
    settle_writes: an ENOSPC is logged and counted into the logger's figure."""
    import errno
    from concurrent.futures import Future
    from trainer.metrics import MetricsLogger, settle_writes
    m = MetricsLogger(tmp_path, tensorboard=False)
    ok, full = Future(), Future()
    ok.set_result(None)
    full.set_exception(OSError(errno.ENOSPC, "No space left on device"))
    with caplog.at_level("ERROR", logger="trainer"):
        assert settle_writes([ok, full], "rollout artifacts in x") == 1
    assert "ENOSPC" in caplog.text and m.write_failures == 1
    m.close()


# ---- issue 49: a run that never trained ------------------------------------------------------
class _Untrained:
    def __init__(self, run_dir: Path, lr_steps: int = 0):
        self.cfg = _cfg(run_dir, "checkpoint.save_interval=1")
        self.lr_steps = lr_steps
        self._rollouts_without_step = 2


def test_no_checkpoint_of_an_untrained_model_and_the_run_ends_nonzero(tmp_path, caplog):
    from trainer.checkpoint.trained import UntrainedRunError, worth_saving
    run = _Untrained(tmp_path)
    with caplog.at_level("WARNING", logger="trainer.checkpoint"):
        assert not worth_saving(run, 1, False)
    assert "no optimizer step has been taken yet" in caplog.text
    with pytest.raises(UntrainedRunError, match="without a single optimizer step"):
        worth_saving(run, 2, True)
    assert isinstance(UntrainedRunError("x"), TrainingStalledError)   # launch: exit 1, one line
    assert worth_saving(_Untrained(tmp_path, lr_steps=3), 2, True)

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


@pytest.mark.slow
@pytest.mark.multiproc
def test_launch_with_only_nan_rewards_shorter_than_the_stall_limit_exits_nonzero(tmp_path):
    """Every reward NaN for 2 rollouts (the stall limit is 10): no optimizer step, so no
    checkpoint is committed and the run exits 1 naming why (issue 49, weak)."""
    run = tmp_path / "run"
    proc = _launch(run, "--set", "train.num_rollouts=2", "--set", "checkpoint.save_interval=1",
                   "--set", "reward.custom_reward_path=fault_rewards.always_nan",
                   "--set", 'reward.required_components=["always_nan"]',
                   "--set", 'reward.component_weights={"always_nan": 1.0}')
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "without a single optimizer step" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert layout.committed_iterations(run / "checkpoints" / "t2i") == []


def test_the_engine_deadline_counts_images_as_its_help_says():
    """--engine-timeout-per-sample is "added to the floor per requested image": a batched
    request of one toy group (8 candidates, one prompt entry each) gets floor + 8 x per-image,
    and SGLang's single-prompt form counts its num_outputs_per_prompt (issue 49: it counted
    the one prompt)."""
    from trainer.config.sections import RolloutConfig
    from trainer.engine.embedded.client import _PipeTransport
    cfg = _cfg(Path("unused"))
    r = cfg.rollout
    help_text = [f.metadata["doc"] for f in dataclasses.fields(RolloutConfig)
                 if f.name == "engine_timeout_per_sample_s"][0]
    assert "per requested image" in help_text
    pipe = _PipeTransport(None, None, floor_s=r.engine_timeout_floor_s,
                          per_image_s=r.engine_timeout_per_sample_s)
    group = {"prompt": ["a red cube"] * r.n_samples_per_prompt}
    assert pipe.deadline_s("generate", (group,)) == 120.0 + 30.0 * 8   # the toy: 6 minutes
    single = {"prompt": "a red cube", "num_outputs_per_prompt": 4}
    assert pipe.deadline_s("generate", (single,)) == 120.0 + 30.0 * 4
    by_ids = {"prompt": "a red cube", "extra_sampling_params": {"sample_ids": ["a", "b", "c"]}}
    assert pipe.deadline_s("generate", (by_ids,)) == 120.0 + 30.0 * 3
    assert pipe.deadline_s("health", ()) == 120.0


@pytest.mark.slow
@pytest.mark.multiproc
def test_launch_resume_without_the_earlier_save_continues_from_it(tmp_path):
    """The first run saved to another root; the relaunch with --resume and no --save
    continues from that root and keeps saving there; the history is kept (issue 49, bad 2:
    it started over at step 0 and cleared metrics.jsonl)."""
    run, root = tmp_path / "run", tmp_path / "elsewhere"
    first = _launch(run, "--set", "train.num_rollouts=1", "--set", f"checkpoint.save={root}")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _launch(run, "--set", "train.num_rollouts=2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and str(root) in resumed.stderr
    assert _steps(run) == [1, 2]
    assert [n for n, _ in layout.committed_iterations(root / "t2i")] == [1, 2]
    assert not (run / "checkpoints" / "t2i").exists()
