"""One run per run directory: an OS lock held for the run's life, and an explicit choice
(--resume or --overwrite) before a launch reuses a directory that already holds a run.

    lock = RunDirLock(run_dir).acquire()      # raises RunDirError naming the holder
    cfg = claim_run_dir(cfg)                   # resume / overwrite decisions, logged

Design choices:

* The lock is ``fcntl.flock`` on ``<run_dir>/.lock``: the kernel drops it when the process
  dies (SIGKILL and OOM included), so a stale lock file never blocks a relaunch; the file
  holds ``{"host", "pid", "started"}`` of the holder only for the refusal message.
* "Holds a run" means a non-empty ``metrics.jsonl`` or a committed checkpoint under the
  run's checkpoint root. Reusing such a directory needs ``--resume`` (continue from its
  newest verified checkpoint: ``checkpoint.load`` is set to the checkpoint root) or
  ``--overwrite`` (metrics and TensorBoard events cleared, its checkpoints may be replaced);
  without either, nothing is touched.
* ``--load`` of one explicit older iteration of the same checkpoint root would replace the
  newer ones at the next save: that truncation needs ``--overwrite`` too, and is refused at
  launch rather than at the first save.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

# trainer.checkpoint is imported inside the functions that read checkpoints: the torch-free
# launcher (trainer.launch) imports this module, and trainer.checkpoint imports torch.

log = logging.getLogger("trainer")

LOCK_FILE = ".lock"


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; the message says why and what to pass."""


class RunDirLock:
    """An exclusive, non-blocking lock on a run directory for this process's lifetime."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            raise RunDirError(f"run dir {self.run_dir} is in use by another run "
                              f"({_describe_holder(holder)}); wait for it to end or choose "
                              f"another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.time()}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h["started"])))
        return f"pid {h['pid']} on host {h['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown: the lock file is unreadable"


def previous_run(cfg) -> list[str]:
    """What in the run's directories shows an earlier run (empty: nothing)."""
    from trainer.checkpoint.layout import committed_iterations  # local: torch (see the top)
    found = []
    metrics = Path(cfg.logging.run_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        lines = sum(1 for _ in metrics.open())
        found.append(f"{metrics} ({lines} lines)")
    committed = committed_iterations(_checkpoint_root(cfg) / cfg.model.task)
    if committed:
        found.append(f"committed checkpoints {[n for n, _ in committed]} under "
                     f"{_checkpoint_root(cfg) / cfg.model.task}")
    return found


def _newer_than_explicit_load(cfg) -> list[int]:
    """Committed iterations of the save root newer than an explicit ``--load .../iter_N``."""
    from trainer.checkpoint.layout import committed_iterations, parse_iter  # local: torch
    if not cfg.checkpoint.load:
        return []
    load = Path(cfg.checkpoint.load).resolve()
    n = parse_iter(load.name)
    task_dir = (_checkpoint_root(cfg) / cfg.model.task).resolve()
    if n is None or load.parent != task_dir:
        return []
    return [m for m, _ in committed_iterations(task_dir) if m > n]


def claim_run_dir(cfg, *, check_only: bool = False):
    """Apply --resume / --overwrite to ``cfg`` (returns an updated copy) or refuse a launch
    into a directory holding a run; call with the run-dir lock held. ``check_only``: refuse
    or not, change nothing (the launcher's check before torchrun starts the ranks)."""
    ck = cfg.checkpoint
    if ck.resume and ck.overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: pass one")
    newer = _newer_than_explicit_load(cfg)
    if newer and not ck.overwrite:
        raise RunDirError(f"--load {ck.load} is older than the committed iterations {newer} of "
                          f"the same --save: saving would replace them. Pass --overwrite to "
                          f"truncate that timeline, or --resume to continue from the newest")
    found = previous_run(cfg)
    if check_only:
        if found and not (ck.overwrite or ck.resume or ck.load):
            raise RunDirError(_refusal(cfg, found))
        return cfg
    if ck.overwrite:
        if found:
            _clear_history(cfg, found)
        return cfg
    if ck.resume:
        if ck.load:
            return cfg
        if any("committed checkpoints" in f for f in found):
            log.info("--resume: continuing from the newest verified checkpoint under %s",
                     _checkpoint_root(cfg))
            return dataclasses.replace(cfg, checkpoint=dataclasses.replace(
                ck, load=str(_checkpoint_root(cfg))))
        if found:
            log.warning("--resume: %s holds no committed checkpoint; starting at step 0 and "
                        "clearing its metrics", cfg.logging.run_dir)
            _clear_history(cfg, found)
        return cfg
    if found and not ck.load:
        raise RunDirError(_refusal(cfg, found))
    return cfg


def _refusal(cfg, found: list[str]) -> str:
    return (f"run dir {cfg.logging.run_dir} already holds a run (" + "; ".join(found)
            + "): pass --resume to continue it from its newest checkpoint, or --overwrite to "
              "start over")


def _clear_history(cfg, found: list[str]) -> None:
    run_dir = Path(cfg.logging.run_dir)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        metrics.write_text("")
    tb = run_dir / "tensorboard"
    if tb.is_dir():
        shutil.rmtree(tb)
    log.warning("starting over in %s: cleared metrics.jsonl and tensorboard/ (was: %s); "
                "older checkpoints are replaced as the new run saves", run_dir, "; ".join(found))


def _checkpoint_root(cfg) -> Path:
    from trainer.checkpoint.save import checkpoint_root  # local: torch (see the top)
    return checkpoint_root(cfg.checkpoint.save, cfg.logging.run_dir)
