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
* The checkpoint root (``--save``, default ``<run_dir>/checkpoints``) is locked the same way
  (``<root>/.lock``, holding the owner's run dir as well) by the run that claims its run dir,
  and released with the run-dir lock: two runs sharing one --save would rotate away each
  other's checkpoints, so the second is refused with a message naming the first's run dir.
* ``--load`` (of any root, this run's or another's) changes no guard: a directory holding a
  run still needs ``--resume`` or ``--overwrite``. A load older than committed iterations of
  this run's --save would have them replaced at the next save: that truncation needs
  ``--overwrite`` too, and is refused at launch rather than at the first save.
* ``--resume`` without ``--save`` takes the checkpoint root from the run dir's resolved config
  (``config.json``, written at every start), so a relaunch that leaves out an earlier --save
  still finds its checkpoints. History (metrics, TensorBoard) is cleared by ``--overwrite``
  only: a ``--resume`` that finds history but no committed checkpoint is refused.
* ``--resume`` with a different prompt file than the run dir's last start (path, size or
  content hash, recorded in ``prompt_data.json``) is a warning, not a refusal: changing the data
  of a running experiment is a legitimate choice, but never a silent one.
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


# Directories this process holds a lock on (resolved path -> lock): flock conflicts between
# two open files of one process too, so a second claim of a held directory reuses the lock.
_HELD: dict[Path, "RunDirLock"] = {}


class RunDirLock:
    """An exclusive, non-blocking lock on a run directory for this process's lifetime; the
    checkpoint-root lock taken by ``claim_run_dir`` is released with it."""

    what = "run dir"

    def __init__(self, run_dir: str | Path, *, owner_run_dir: str | Path | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.owner_run_dir = str(owner_run_dir or run_dir)
        self.children: list[RunDirLock] = []
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunDirError(f"{self.what} {self.run_dir} cannot be created or locked "
                              f"({_os_error(exc)}): choose a directory path whose parents are "
                              f"directories you can write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace")
            os.close(fd)
            raise RunDirError(self._refusal(holder)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.time(),
                                  "run_dir": self.owner_run_dir}).encode(), 0)
        self._fd = fd
        _HELD[self.run_dir.resolve()] = self
        return self

    def _refusal(self, holder: str) -> str:
        return (f"run dir {self.run_dir} is in use by another run ({_describe_holder(holder)}); "
                f"wait for it to end or choose another --run-dir")

    def release(self) -> None:
        for child in self.children:
            child.release()
        self.children = []
        if self._fd is not None:
            _HELD.pop(self.run_dir.resolve(), None)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class CheckpointRootLock(RunDirLock):
    """The lock of a checkpoint root (``--save``), held by the run whose run dir it names."""

    what = "checkpoint root"

    def _refusal(self, holder: str) -> str:
        try:
            owner = json.loads(holder)["run_dir"]
        except (ValueError, KeyError, TypeError):
            owner = "unknown"
        return (f"checkpoint root {self.run_dir} (--save) is in use by the run in {owner} "
                f"({_describe_holder(holder)}): two runs saving into one root would rotate "
                f"away each other's checkpoints. Pass another --save, or wait for that run "
                f"to end")


def _describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h["started"])))
        return f"pid {h['pid']} on host {h['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown: the lock file is unreadable"


def _os_error(exc: OSError) -> str:
    import errno
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    return f"{name}: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")


def lock_checkpoint_root(cfg) -> None:
    """Hold ``cfg``'s checkpoint root for this run (see the module docstring); a root this
    process holds already is kept. The lock goes with the run dir's lock when this process
    holds that one, else it lasts until the process ends."""
    from trainer.checkpoint.save import checkpoint_root  # local: torch (see the top)
    if cfg.checkpoint.save_interval < 0 and not cfg.checkpoint.save:
        return  # this run never saves
    root = checkpoint_root(cfg)
    if root.resolve() in _HELD:
        return
    lock = CheckpointRootLock(root, owner_run_dir=cfg.logging.run_dir).acquire()
    parent = _HELD.get(Path(cfg.logging.run_dir).resolve())
    if parent is not None and parent is not lock:
        parent.children.append(lock)


def recorded_checkpoint_save(run_dir: str | Path) -> str | None:
    """The ``checkpoint.save`` of the run dir's resolved config (None: none recorded)."""
    path = Path(run_dir) / "config.json"
    try:
        return json.loads(path.read_text()).get("checkpoint", {}).get("save")
    except (OSError, ValueError, AttributeError):
        return None


def _adopt_recorded_save(cfg):
    """--resume without --save: the checkpoint root the run dir's config names."""
    recorded = recorded_checkpoint_save(cfg.logging.run_dir)
    if cfg.checkpoint.save or not recorded:
        return cfg
    log.info("--resume: checkpoint root %s, as the run dir's config.json names it (no --save "
             "given)", recorded)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                   save=recorded))


def previous_run(cfg) -> list[str]:
    """What in the run's directories shows an earlier run (empty: nothing)."""
    from trainer.checkpoint.layout import committed_iterations  # local: torch (see the top)
    from trainer.checkpoint.save import checkpoint_root
    found = []
    metrics = Path(cfg.logging.run_dir) / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        lines = sum(1 for _ in metrics.open())
        found.append(f"{metrics} ({lines} lines)")
    committed = committed_iterations(checkpoint_root(cfg) / cfg.model.task)
    if committed:
        found.append(f"committed checkpoints {[n for n, _ in committed]} under "
                     f"{checkpoint_root(cfg) / cfg.model.task}")
    return found


def _newer_than_explicit_load(cfg) -> list[int]:
    """Committed iterations of the save root newer than what ``--load`` resumes (an explicit
    ``iter_N``, or the newest committed iteration of a root: this run's or another's)."""
    from trainer.checkpoint.layout import committed_iterations, latest_committed, parse_iter
    from trainer.checkpoint.save import checkpoint_root  # local: torch (see the top)
    if not cfg.checkpoint.load:
        return []
    load = Path(cfg.checkpoint.load)
    chosen = load if parse_iter(load.name) is not None else latest_committed(load,
                                                                              cfg.model.task)
    if chosen is None:
        return []
    n = parse_iter(chosen.name)
    task_dir = (checkpoint_root(cfg) / cfg.model.task).resolve()
    return [m for m, _ in committed_iterations(task_dir) if m > n]


def claim_run_dir(cfg, *, check_only: bool = False):
    """Apply --resume / --overwrite to ``cfg`` (returns an updated copy) or refuse a launch
    into a directory holding a run; call with the run-dir lock held. ``check_only``: refuse
    or not, change nothing (the launcher's check before torchrun starts the ranks)."""
    if cfg.checkpoint.resume and cfg.checkpoint.overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: pass one")
    if cfg.checkpoint.resume:
        cfg = _adopt_recorded_save(cfg)
    ck = cfg.checkpoint
    lock_checkpoint_root(cfg)
    problems = []
    found = previous_run(cfg)
    if found and not (ck.overwrite or ck.resume):
        problems.append(_refusal(cfg, found))
    newer = _newer_than_explicit_load(cfg)
    if newer and not ck.overwrite:
        from trainer.checkpoint.save import checkpoint_root  # local: torch (see the top)
        problems.append(f"--load {ck.load} is older than the committed iterations {newer} of "
                        f"this run's --save {checkpoint_root(cfg)}: saving would replace "
                        f"them. Pass --overwrite to truncate that timeline, --resume to "
                        f"continue from the newest, or another --save")
    if ck.resume and found and not ck.load \
            and not any("committed checkpoints" in f for f in found):
        problems.append(_no_checkpoint_to_resume(cfg, found))
    if problems:
        raise RunDirError("\n".join(problems))
    if check_only:
        return cfg
    if ck.resume:
        warn_if_prompt_data_changed(cfg)
    record_prompt_data(cfg)
    if ck.overwrite:
        if found:
            _clear_history(cfg, found)
        return cfg
    if ck.resume:
        if ck.load:
            return cfg
        from trainer.checkpoint.save import checkpoint_root  # local: torch (see the top)
        if any("committed checkpoints" in f for f in found):
            log.info("--resume: continuing from the newest verified checkpoint under %s",
                     checkpoint_root(cfg))
            return dataclasses.replace(cfg, checkpoint=dataclasses.replace(
                ck, load=str(checkpoint_root(cfg))))
        log.warning("--resume: %s holds no run yet; starting at step 0", cfg.logging.run_dir)
    return cfg


def _no_checkpoint_to_resume(cfg, found: list[str]) -> str:
    from trainer.checkpoint.save import checkpoint_root  # local: torch (see the top)
    recorded = recorded_checkpoint_save(cfg.logging.run_dir)
    hint = (f" (the run dir's config.json names --save {recorded})"
            if recorded and Path(recorded) != checkpoint_root(cfg) else "")
    return (f"--resume: run dir {cfg.logging.run_dir} holds a run (" + "; ".join(found)
            + f") but no committed checkpoint under {checkpoint_root(cfg) / cfg.model.task}"
            + hint + ": pass the --save it was saved to, --load a checkpoint, or --overwrite "
                     "to start over (its metrics and TensorBoard are cleared)")


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


PROMPT_DATA_RECORD = "prompt_data.json"


def prompt_data_fingerprint(cfg) -> dict:
    """What identifies the training prompts: the path as given, and for a file its resolved
    path, size and sha256 (read in 8 MiB chunks)."""
    import hashlib
    value = str(cfg.data.prompt_data)
    out = {"prompt_data": value}
    path = Path(value)
    if path.is_file():
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        out.update(resolved=str(path.resolve()), size=path.stat().st_size,
                   sha256=h.hexdigest())
    return out


def record_prompt_data(cfg) -> None:
    """Write the prompt data's fingerprint into the run dir (a failure is a warning)."""
    path = Path(cfg.logging.run_dir) / PROMPT_DATA_RECORD
    try:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(prompt_data_fingerprint(cfg), indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not record the prompt data's fingerprint in %s (%s)", path,
                    _os_error(exc))


def warn_if_prompt_data_changed(cfg) -> bool:
    """On --resume: warn (and return True) when the prompt data differs from the one the run
    dir last started with."""
    try:
        before = json.loads((Path(cfg.logging.run_dir) / PROMPT_DATA_RECORD).read_text())
    except (OSError, ValueError):
        return False
    now = prompt_data_fingerprint(cfg)
    changed = [k for k in ("resolved", "size", "sha256") if before.get(k) != now.get(k)]
    if not changed and before.get("prompt_data") == now.get("prompt_data"):
        return False
    log.warning("--resume with different prompt data: the run started with %s%s, now %s%s; "
                "the resumed rollouts draw from the new prompts", before.get("prompt_data"),
                f" (sha256 {before['sha256'][:12]})" if before.get("sha256") else "",
                now.get("prompt_data"), f" (sha256 {now['sha256'][:12]})"
                if now.get("sha256") else "")
    return True
