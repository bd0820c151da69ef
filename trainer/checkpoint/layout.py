"""On-disk layout of checkpoints, the COMMITTED marker, discovery and rotation.

    <save>/<task>/iter_0000020/
        fsdp/                       DCP shards (model + optimizer; LoRA runs: adapter only)
        rng_rank0.pt ...            per-rank RNG
        trainer_state.json  weight_sync_manifest.json  adapter_contract.json
        COMMITTED                   written last; the only thing resume trusts
    <save>/<task>/latest_checkpointed_iteration.txt
    <save>/latest_checkpointed_iteration.txt

Design choices where the spec is silent:

* COMMITTED is a JSON list of every file of the checkpoint with its size, written through a
  temporary file and an atomic rename. Discovery trusts an iteration only if its marker
  parses and every listed file is still there with that size, so a checkpoint that was
  truncated or partly deleted after its commit is skipped (with a warning) for the next older
  one instead of failing the resume halfway through loading.
* Discovery scans ``iter_*`` directories; ``latest_checkpointed_iteration.txt`` is written for
  tools and humans but never trusted, because a crash between COMMITTED and its update
  leaves it one behind.
* Directories are deleted by renaming them to ``.trash-*`` first (atomic) and then removing
  the tree, so a crash mid-delete leaves a hidden leftover, never a half-deleted iteration.
* Rotation before saving iteration n removes every uncommitted ``iter_*`` (crash leftovers),
  every iteration >= n (an abandoned timeline: a run restarted without --load into the same
  --save; keeping it would make the next resume pick a stale checkpoint), and all but the
  newest ``keep - 1`` committed ones, so at most ``keep`` exist once n commits.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from trainer.fsio import fsync_dir  # noqa: F401  (re-exported)

log = logging.getLogger("trainer.checkpoint")

FSDP_DIR = "fsdp"
COMMITTED = "COMMITTED"
LATEST = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"
WEIGHT_SYNC_MANIFEST = "weight_sync_manifest.json"
ADAPTER_CONTRACT = "adapter_contract.json"
FORMAT_VERSION = 1

_ITER_RE = re.compile(r"^iter_(\d+)$")
_TRASH_PREFIX = ".trash-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, trusted, written or rotated; the message says why."""


def iter_name(iteration: int) -> str:
    return f"iter_{int(iteration):07d}"


def parse_iter(name: str) -> int | None:
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def rng_file(rank: int) -> str:
    return f"rng_rank{int(rank)}.pt"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``path`` appears complete or not at all: write a temp file, fsync, rename, fsync dir."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: object, *, indent: int | None = 2) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


# ---- the commit marker --------------------------------------------------------------------
def _listing(iter_dir: Path) -> dict[str, int]:
    out = {}
    for p in sorted(iter_dir.rglob("*")):
        if p.is_file() and p.name != COMMITTED and ".tmp" not in p.name:
            out[p.relative_to(iter_dir).as_posix()] = p.stat().st_size
    return out


def write_commit_marker(iter_dir: Path, iteration: int, world_size: int) -> None:
    marker = {"format": FORMAT_VERSION, "iteration": int(iteration),
              "world_size": int(world_size), "time": time.time(), "files": _listing(iter_dir)}
    atomic_write_json(Path(iter_dir) / COMMITTED, marker)


def commit_problems(iter_dir: Path) -> list[str]:
    """Why ``iter_dir`` is not a trustworthy committed checkpoint (empty list: it is)."""
    marker_path = Path(iter_dir) / COMMITTED
    if not marker_path.is_file():
        return ["no COMMITTED marker (the save did not finish)"]
    try:
        marker = read_json(marker_path)
        files = marker["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"unreadable COMMITTED marker ({exc})"]
    problems = []
    for rel, size in files.items():
        p = Path(iter_dir) / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
        elif p.stat().st_size != size:
            problems.append(f"{rel} has {p.stat().st_size} bytes, COMMITTED says {size}")
    if not any(rel.startswith(FSDP_DIR + "/") for rel in files):
        problems.append("COMMITTED lists no DCP shards")
    return problems


# ---- discovery ----------------------------------------------------------------------------
def iteration_dirs(task_dir: Path) -> list[tuple[int, Path]]:
    """Every ``iter_*`` directory under ``task_dir``, committed or not, oldest first."""
    task_dir = Path(task_dir)
    if not task_dir.is_dir():
        return []
    found = [(parse_iter(p.name), p) for p in task_dir.iterdir() if p.is_dir()]
    return sorted((n, p) for n, p in found if n is not None)


def committed_iterations(task_dir: Path, *, warn: bool = False) -> list[tuple[int, Path]]:
    """The trustworthy committed iterations under ``task_dir``, oldest first."""
    out = []
    for n, p in iteration_dirs(task_dir):
        problems = commit_problems(p)
        if not problems:
            out.append((n, p))
        elif warn and (p / COMMITTED).exists():
            log.warning("ignoring checkpoint %s: %s", p, "; ".join(problems))
    return out


def latest_committed(path: str | Path, task: str = "t2i") -> Path | None:
    """The newest trustworthy committed ``iter_*`` directory, or None.

    ``path`` may be the checkpoint root (``--save``/``--load``), its ``<task>`` directory, or
    an ``iter_*`` directory itself (returned only if committed).
    """
    p = Path(path)
    if parse_iter(p.name) is not None:
        return p if not commit_problems(p) else None
    task_dir = p / task if (p / task).is_dir() else p
    found = committed_iterations(task_dir, warn=True)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | Path, task: str = "t2i", iteration: int | None = None
                       ) -> Path:
    """The committed iteration to load from ``path`` (newest unless ``iteration`` is given);
    raises CheckpointError naming what was found and why nothing was trusted."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    if parse_iter(p.name) is not None:
        problems = commit_problems(p)
        if problems:
            raise CheckpointError(f"{p} is not a committed checkpoint: " + "; ".join(problems))
        if iteration is not None and parse_iter(p.name) != iteration:
            raise CheckpointError(f"{p} is iteration {parse_iter(p.name)}, not {iteration}")
        return p
    task_dir = p / task if (p / task).is_dir() else p
    committed = committed_iterations(task_dir, warn=True)
    if iteration is not None:
        match = [d for n, d in committed if n == iteration]
        if match:
            return match[0]
        d = task_dir / iter_name(iteration)
        why = "; ".join(commit_problems(d)) if d.is_dir() else "no such directory"
        raise CheckpointError(f"iteration {iteration} under {task_dir} is not usable: {why}"
                              f" (committed: {[n for n, _ in committed] or 'none'})")
    if committed:
        return committed[-1][1]
    seen = [f"{d.name}: {'; '.join(commit_problems(d))}" for _, d in iteration_dirs(task_dir)]
    raise CheckpointError(
        f"no committed checkpoint under {task_dir} (task {task!r})"
        + ("; found only:\n  - " + "\n  - ".join(seen) if seen else "; no iter_* directories"))


def write_latest(root: Path, task: str, iteration: int) -> None:
    """``latest_checkpointed_iteration.txt`` at both levels (task dir first, then the root)."""
    for d in (Path(root) / task, Path(root)):
        atomic_write_bytes(d / LATEST, f"{int(iteration)}\n".encode())


# ---- deletion and rotation ----------------------------------------------------------------
def remove_tree(path: Path) -> None:
    """Delete a directory so that a crash at any point leaves no partial ``iter_*``."""
    path = Path(path)
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}-{time.time_ns()}")
    os.replace(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash)


def plan_rotation(task_dir: Path, keep: int, new_iteration: int) -> list[Path]:
    """What to delete before writing ``new_iteration`` (see the module docstring)."""
    task_dir = Path(task_dir)
    doomed = [p for p in task_dir.iterdir() if p.name.startswith(_TRASH_PREFIX)] \
        if task_dir.is_dir() else []
    kept_committed = []
    for n, p in iteration_dirs(task_dir):
        if n >= new_iteration or commit_problems(p):
            doomed.append(p)
        else:
            kept_committed.append(p)
    if keep > 0:
        doomed += kept_committed[:max(0, len(kept_committed) - (keep - 1))]
    return doomed


def rotate(task_dir: Path, keep: int, new_iteration: int) -> list[Path]:
    """Apply ``plan_rotation``; returns what was deleted. Raises on the first failure."""
    doomed = plan_rotation(task_dir, keep, new_iteration)
    for p in doomed:
        n = parse_iter(p.name)
        if n is not None and n >= new_iteration and not commit_problems(p):
            log.warning("deleting committed checkpoint %s: a new save of iteration %d supersedes "
                        "it (abandoned timeline)", p, new_iteration)
        if p.name.startswith(_TRASH_PREFIX):
            shutil.rmtree(p)
        else:
            remove_tree(p)
    return doomed
