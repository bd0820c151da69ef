"""On-disk layout of checkpoints, the COMMITTED marker, discovery and rotation.

    <save>/<task>/iter_0000020/
        fsdp/                       DCP shards (model + optimizer; LoRA runs: adapter only)
        rng_rank0.pt ...            per-rank RNG
        trainer_state.json  weight_sync_manifest.json  adapter_contract.json
        COMMITTED                   written last; the only thing resume trusts
    <save>/<task>/latest_checkpointed_iteration.txt
    <save>/latest_checkpointed_iteration.txt

Design choices:

* COMMITTED is a JSON list of every file of the checkpoint with its size and a content
  checksum (xxh3-128 when the ``xxhash`` package is installed, else sha256, which adds several
  times more to a save), written through a temporary file and an atomic rename.
  Discovery trusts an iteration only if its marker parses and every listed file is still
  there with that size; loading (``resolve_checkpoint``) also recomputes the checksums and
  parses the JSON sidecars and the DCP metadata, and falls back to the next older iteration,
  logging which one and why, instead of failing (or training on garbage) halfway through.
* Discovery scans ``iter_*`` directories; ``latest_checkpointed_iteration.txt`` is written for
  tools and humans but never trusted, because a crash between COMMITTED and its update
  leaves it one behind.
* Directories are deleted by renaming them to ``.trash-*`` first (atomic) and then removing
  the tree, so a crash mid-delete leaves a hidden leftover, never a half-deleted iteration.
* Every file under an iteration must be listed in COMMITTED and every listed file must be
  there: a file on disk the marker does not list (a shard whose entry was removed) makes the
  iteration untrusted, like a missing one.
* Rotation before saving iteration n removes every uncommitted or damaged ``iter_*`` (crash
  leftovers) and all but the newest ``keep - 1`` committed ones below n, so at most ``keep``
  exist once n commits. It never deletes what it did not write: rotation tags the directory
  it is about to write (``.writer``: host, pid), and an uncommitted ``iter_*`` tagged by
  another process that is alive (or on another host, where that cannot be told) is left in
  place with a warning. (The run's lock on its checkpoint root, ``trainer.rundir``, keeps a
  second run out in the first place.) A committed iteration >= n belongs to another timeline (a run
  restarted into the same --save): rotation refuses to delete it unless told to
  (``overwrite``, --overwrite), and then logs each deletion.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

from trainer.utils.fsio import fsync_dir  # noqa: F401  (re-exported)

log = logging.getLogger("trainer.checkpoint")

FSDP_DIR = "fsdp"
COMMITTED = "COMMITTED"
LATEST = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"
WEIGHT_SYNC_MANIFEST = "weight_sync_manifest.json"
ADAPTER_CONTRACT = "adapter_contract.json"
FORMAT_VERSION = 2  # 2: COMMITTED records {"size", "hash"} per file (1: sizes only)
_CHUNK = 8 << 20

WRITER_TAG = ".writer"

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


# ---- checksums ----------------------------------------------------------------------------
def _hasher(algo: str):
    if algo == "xxh3_128":
        import xxhash  # optional: sha256 is the fallback (module docstring)
        return xxhash.xxh3_128()
    return hashlib.new(algo)


def default_hash_algo() -> str:
    try:  # optional: sha256 is the fallback (module docstring)
        import xxhash  # noqa: F401
        return "xxh3_128"
    except ImportError:
        return "sha256"


def file_checksum(path: Path, algo: str | None = None) -> str:
    """``"<algo>:<hex>"`` of a file's bytes, read in 8 MiB chunks."""
    algo = algo or default_hash_algo()
    h = _hasher(algo)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return f"{algo}:{h.hexdigest()}"


# ---- the commit marker --------------------------------------------------------------------
def _listing(iter_dir: Path) -> dict[str, dict]:
    algo = default_hash_algo()
    out = {}
    for p in sorted(iter_dir.rglob("*")):
        if p.is_file() and p.name not in (COMMITTED, WRITER_TAG) and ".tmp" not in p.name:
            out[p.relative_to(iter_dir).as_posix()] = {"size": p.stat().st_size,
                                                       "hash": file_checksum(p, algo)}
    return out


def write_commit_marker(iter_dir: Path, iteration: int, world_size: int) -> None:
    marker = {"format": FORMAT_VERSION, "iteration": int(iteration),
              "world_size": int(world_size), "time": time.time(), "files": _listing(iter_dir)}
    atomic_write_json(Path(iter_dir) / COMMITTED, marker)


def _read_marker(iter_dir: Path) -> tuple[dict | None, str | None]:
    marker_path = Path(iter_dir) / COMMITTED
    if not marker_path.is_file():
        return None, "no COMMITTED marker (the save did not finish, or the marker was deleted)"
    try:
        files = read_json(marker_path)["files"]
        entries = {str(rel): v if isinstance(v, dict) else {"size": int(v)}
                   for rel, v in files.items()}
        for v in entries.values():
            int(v["size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"unreadable COMMITTED marker ({type(exc).__name__}: {exc})"
    return entries, None


def commit_problems(iter_dir: Path, *, contents: bool = False) -> list[str]:
    """Why ``iter_dir`` is not a trustworthy committed checkpoint (empty list: it is).

    Sizes always; ``contents=True`` also recomputes every file's checksum and parses the
    JSON sidecars and the DCP metadata (what a load reads before it changes any state)."""
    files, why = _read_marker(iter_dir)
    if why is not None:
        return [why]
    problems = []
    for rel, entry in files.items():
        p = Path(iter_dir) / rel
        if not p.is_file():
            problems.append(f"{rel} is missing")
        elif p.stat().st_size != entry["size"]:
            problems.append(f"{rel} has {p.stat().st_size} bytes, COMMITTED says {entry['size']}")
        elif contents and entry.get("hash"):
            algo = str(entry["hash"]).partition(":")[0]
            try:
                got = file_checksum(p, algo)
            except (ImportError, ValueError) as exc:
                problems.append(f"{rel}: cannot compute its {algo} checksum ({exc})")
                continue
            if got != entry["hash"]:
                problems.append(f"{rel}: content checksum {got} != COMMITTED {entry['hash']} "
                                f"(the file changed after the commit)")
    unlisted = _unlisted_files(Path(iter_dir), files)
    if unlisted:
        problems.append(f"{len(unlisted)} file(s) on disk that COMMITTED does not list, e.g. "
                        f"{unlisted[:3]} (the marker was edited, or files were added after the "
                        f"commit)")
    if not any(rel.startswith(FSDP_DIR + "/") for rel in files):
        problems.append("COMMITTED lists no DCP shards")
    if contents and not problems:
        problems += _parse_problems(Path(iter_dir), files)
    return problems


def _parse_problems(iter_dir: Path, listed: dict) -> list[str]:
    """The listed sidecars a load reads parse (catches damage that no checksum covers: a
    format-1 marker, or a file damaged before the commit)."""
    problems = []
    for name in (TRAINER_STATE, ADAPTER_CONTRACT):
        if name not in listed:
            continue
        try:
            if not isinstance(read_json(iter_dir / name), dict):
                problems.append(f"{name} is not a JSON object")
        except (OSError, ValueError) as exc:
            problems.append(f"{name} does not parse ({type(exc).__name__}: {exc})")
    if f"{FSDP_DIR}/.metadata" not in listed:
        return problems
    try:
        dcp.FileSystemReader(str(iter_dir / FSDP_DIR)).read_metadata()
    except Exception as exc:  # any unpickling failure of a damaged .metadata
        problems.append(f"{FSDP_DIR}/.metadata does not load ({type(exc).__name__}: "
                        f"{str(exc)[:200]})")
    return problems


def _unlisted_files(iter_dir: Path, files: dict[str, dict]) -> list[str]:
    """Files under ``iter_dir`` the marker does not list (the marker, the writer tag and
    temporary files aside, as ``_listing`` leaves them out)."""
    out = []
    for p in sorted(iter_dir.rglob("*")):
        rel = p.relative_to(iter_dir).as_posix()
        if p.is_file() and p.name not in (COMMITTED, WRITER_TAG) and ".tmp" not in p.name \
                and rel not in files:
            out.append(rel)
    return out


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


def resolve_checkpoint(path: str | Path, task: str = "t2i", iteration: int | None = None,
                       *, verify: bool = True) -> Path:
    """The committed iteration to load from ``path``: the newest whose files verify (contents
    too with ``verify``), unless ``iteration`` is given. Every newer iteration passed over is
    logged with its reasons; raises CheckpointError naming what was found and why nothing was
    trusted."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist")
    if parse_iter(p.name) is not None:
        problems = commit_problems(p, contents=verify)
        if problems:
            raise CheckpointError(f"{p} is not a usable committed checkpoint: "
                                  + "; ".join(problems))
        if iteration is not None and parse_iter(p.name) != iteration:
            raise CheckpointError(f"{p} is iteration {parse_iter(p.name)}, not {iteration}")
        return p
    task_dir = p / task if (p / task).is_dir() else p
    found = iteration_dirs(task_dir)
    if iteration is not None:
        d = task_dir / iter_name(iteration)
        why = "; ".join(commit_problems(d, contents=verify)) if d.is_dir() \
            else "no such directory"
        if d.is_dir() and not why:
            return d
        raise CheckpointError(f"iteration {iteration} under {task_dir} is not usable: {why}"
                              f" (iterations present: {[n for n, _ in found] or 'none'})")
    rejected = []
    for n, d in reversed(found):
        problems = commit_problems(d, contents=verify)
        if not problems:
            for name, why in rejected:
                log.warning("checkpoint %s skipped: %s; falling back to %s", name, why, d)
            return d
        rejected.append((d.name, "; ".join(problems)))
    seen = [f"{name}: {why}" for name, why in reversed(rejected)]
    raise CheckpointError(
        f"no usable committed checkpoint under {task_dir} (task {task!r})"
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


def plan_rotation(task_dir: Path, keep: int, new_iteration: int, *,
                  overwrite: bool = False) -> list[Path]:
    """What to delete before writing ``new_iteration`` (see the module docstring); raises
    CheckpointError rather than plan the deletion of another timeline's committed iterations
    without ``overwrite``."""
    task_dir = Path(task_dir)
    doomed = [p for p in task_dir.iterdir() if p.name.startswith(_TRASH_PREFIX)] \
        if task_dir.is_dir() else []
    kept_committed, other_timeline = [], []
    for n, p in iteration_dirs(task_dir):
        if commit_problems(p):
            writer = live_writer(p)
            if writer is None:
                doomed.append(p)
            else:
                log.warning("rotation leaves %s in place: it is not committed and %s is "
                            "writing it (not this run's to delete)", p, writer)
        elif n >= new_iteration:
            other_timeline.append(p)
        else:
            kept_committed.append(p)
    if other_timeline and not overwrite:
        raise CheckpointError(
            f"saving iteration {new_iteration} would replace the committed checkpoints "
            f"{[p.name for p in other_timeline]} in {task_dir}, which belong to another "
            f"timeline (a later run into the same --save); refusing to delete them. Resume "
            f"that run (--resume), save elsewhere (--save), or pass --overwrite to replace them")
    doomed += other_timeline
    if keep > 0:
        doomed += kept_committed[:max(0, len(kept_committed) - (keep - 1))]
    return doomed


def rotate(task_dir: Path, keep: int, new_iteration: int, *,
           overwrite: bool = False) -> list[Path]:
    """Apply ``plan_rotation``; returns what was deleted. Raises on the first failure."""
    doomed = plan_rotation(task_dir, keep, new_iteration, overwrite=overwrite)
    target = Path(task_dir) / iter_name(new_iteration)
    if target not in doomed and live_writer(target) is not None:
        raise CheckpointError(f"{target} is being written by {live_writer(target)}, not by "
                              f"this run: two runs are saving into one --save")
    for p in doomed:
        n = parse_iter(p.name)
        if n is not None and n >= new_iteration and not commit_problems(p):
            log.warning("deleting committed checkpoint %s (--overwrite): a new save of "
                        "iteration %d replaces that timeline", p, new_iteration)
        if p.name.startswith(_TRASH_PREFIX):
            shutil.rmtree(p)
        else:
            remove_tree(p)
    tag_writer(target)
    return doomed


def tag_writer(iter_dir: Path) -> None:
    """Mark ``iter_dir`` as being written by this process (see the module docstring)."""
    iter_dir = Path(iter_dir)
    iter_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(iter_dir / WRITER_TAG, {"host": socket.gethostname(), "pid": os.getpid(),
                                              "time": time.time()}, indent=None)


def live_writer(iter_dir: Path) -> str | None:
    """Who else is writing ``iter_dir``: "pid N on host H" when its writer tag names another
    process that is alive (or one on another host), else None."""
    try:
        tag = read_json(Path(iter_dir) / WRITER_TAG)
        host, pid = str(tag["host"]), int(tag["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host == socket.gethostname():
        if pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, another user's
    return f"pid {pid} on host {host}"
