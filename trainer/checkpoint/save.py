"""``Checkpointer``: crash-safe checkpoints of a training run over named ``Stateful`` parts
(as torchtitan's checkpoint manager: each part has ``state_dict`` / ``load_state_dict``, and
the checkpointer reaches for nothing else). ``save_checkpoint(checkpointer, step)`` writes one.

Parts and where they go:

* the DCP parts (``parts``, by directory name: ``fsdp`` the actor's model and optimizer,
  ``ema`` the EMA when there is one): ``dcp.save(part.state_dict())`` into ``iter_n/<name>``;
  loading fills a fresh ``state_dict()`` in place and hands it to ``load_state_dict``;
* the run's state (``state``: ``trainer.state.TrainerState``, the counters and this rank's
  RNG): the counters go to ``trainer_state.json`` with ``record()`` (what the run was), the
  RNG to this rank's RNG file;
* ``sidecars()``: rank 0's JSON files describing the run (the weight-sync manifest and the
  adapter contract), which resume checks.

Order (docs/design.md#checkpoints): rotation by rank 0, broadcast -> DCP shards -> per-rank RNG ->
JSON sidecars (rank 0) -> MIN all-reduce of every rank's success -> COMMITTED (rank 0) ->
``latest_checkpointed_iteration.txt`` in the task directory, then in the root.

Failure policy: a rotation failure raises on every rank (rank 0's result is broadcast, so no
rank is left waiting in a collective). A failed write (DCP, RNG, sidecars, or the commit
itself; disk full included: DCP wraps the OSError in a ``CheckpointException``, which is a
``BaseException``) on any rank is logged loudly on every rank with the OS error, counted in
``on_failure`` (the run's ``checkpoint_failures``; the loop logs it as
``train/checkpoint_failures``), its
partial directory is removed by rank 0 and no COMMITTED marker exists; training goes on,
the previous committed checkpoint stays the resume point and the next save retries. The
exception is the run's final save (``final=True``): no later save can retry it, so the
trained weights would not be on disk; it raises ``CheckpointError`` on every rank naming
each failed rank's OS error and the newest committed checkpoint (the run exits non-zero).

Design choices:

* The checkpoint root is ``--save``, or ``<run_dir>/checkpoints`` when only --save-interval
  is set (the config field's documented default).
* ``iter_<n>`` uses the loop's step (rollouts completed); trainer_state records the last
  rollout id (n - 1), and resume starts at that id + 1.
* An actor offloaded to host memory (--offload-train) is brought back for the save and
  offloaded again afterwards by the loop (``Actor.onloaded``): DCP reads the device shards,
  whose storage is freed while offloaded.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint import layout
from trainer.checkpoint.rng import write_rng
from trainer.checkpoint.shards import _single_process_ok
from trainer.utils.collectives import all_ranks_ok, broadcast_from_rank0, failures_by_rank

log = logging.getLogger("trainer.checkpoint")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Checkpointer:
    """Where and what to save (module docstring); every rank holds one."""

    root: Path                       # --save, or <run_dir>/checkpoints
    task: str                        # model.task: the task directory under the root
    parts: dict[str, Stateful]       # DCP parts by directory name ("fsdp", "ema")
    state: Stateful                  # counters + "rng": trainer_state.json and the RNG file
    record: Callable[[], dict]       # what the run was, beside the counters in trainer_state
    sidecars: Callable[[], dict[str, tuple[dict, int | None]]]  # rank 0: {file: (json, indent)}
    on_failure: Callable[[], int]    # counts a failed save; returns the new count
    rank: int = 0
    world: int = 1
    keep: int = 0                    # checkpoint.max_actor_ckpt_to_keep
    overwrite: bool = False          # checkpoint.overwrite
    metrics: Any = None              # rank 0 logs train/checkpoint_failures on a failure
    contract: Callable[[], dict] | None = None  # load: this run's adapter contract
    fingerprint: str | None = None   # load: this run's sampling fingerprint


def checkpoint_root(save: str | None, run_dir: str | Path) -> Path:
    """``checkpoint.save``, or ``<run_dir>/checkpoints`` when only --save-interval is set."""
    return Path(save or Path(run_dir) / "checkpoints")


def write_dcp(state: dict[str, Any], directory: Path) -> None:
    """One DCP part (every rank calls it under torch.distributed)."""
    with _single_process_ok():
        dcp.save(state, checkpoint_id=str(directory),
                 no_dist=not (dist.is_available() and dist.is_initialized()))


def _write(ck: Checkpointer, step: int, iter_dir: Path) -> None:
    """Every DCP part, this rank's RNG, and (rank 0) the JSON sidecars, in that order."""
    iter_dir.mkdir(parents=True, exist_ok=True)
    for name, part in ck.parts.items():
        write_dcp(part.state_dict(), iter_dir / name)
    state = ck.state.state_dict()
    rng = state.pop("rng")
    write_rng(iter_dir / layout.rng_file(ck.rank), rng)
    if ck.rank == 0:
        layout.atomic_write_json(iter_dir / layout.TRAINER_STATE,
                                 {"format": layout.FORMAT_VERSION, "iteration": int(step),
                                  **state, **ck.record(), "world_size": int(ck.world)})
        for name, (content, indent) in ck.sidecars().items():
            layout.atomic_write_json(iter_dir / name, content, indent=indent)


def _commit(ck: Checkpointer, step: int, iter_dir: Path) -> None:
    layout.write_commit_marker(iter_dir, step, ck.world)
    layout.write_latest(ck.root, ck.task, step)

# Free space under which a failed write is taken for a full disk (see describe_failure).
NEARLY_FULL_BYTES = 1 << 20


def disk_full(path: Path) -> str | None:
    """An ENOSPC line when the filesystem holding ``path`` has almost no space left, else None."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free >= NEARLY_FULL_BYTES:
        return None
    return (f"ENOSPC: No space left on device ({free} of {st.f_blocks * st.f_frsize} bytes "
            f"free on the filesystem of {probe})")


def describe_failure(exc: BaseException, written: Path | None = None) -> str:
    """The root cause of a failed write in one line: the OS error (errno name, strerror,
    file) when there is one, also inside DCP's per-rank ``CheckpointException``. Without one,
    and with the filesystem of ``written`` full, that is named first: torch's zip writer (DCP
    uses it for non-tensor items) reports a short write as "unexpected pos", losing ENOSPC."""
    causes: list[BaseException] = []
    if isinstance(exc, CheckpointException):
        causes += [pair[0] for pair in exc.failures.values()]
    causes.append(exc)
    for cause in causes:
        seen = cause
        while seen is not None:
            if isinstance(seen, OSError) and seen.errno is not None:
                name = errno.errorcode.get(seen.errno, str(seen.errno))
                where = f" ({seen.filename})" if seen.filename else ""
                return f"OSError {name}: {seen.strerror}{where}"
            seen = seen.__cause__ or seen.__context__
    first = causes[0]
    said = f"{type(first).__name__}: {str(first).splitlines()[0][:300] if str(first) else ''}"
    full = disk_full(written) if written is not None else None
    return said if full is None else f"{full}; the writer reported {said}"


def _remove_partial(ck: Checkpointer, iter_dir: Path) -> None:
    """Rank 0 removes a failed save's directory (it was never committed)."""
    if ck.rank != 0 or not iter_dir.exists():
        return
    try:
        layout.remove_tree(iter_dir)
        log.warning("removed the partial checkpoint directory %s", iter_dir)
    except OSError as exc:
        log.error("could not remove the partial checkpoint directory %s: %s", iter_dir,
                  describe_failure(exc))


def _count_failure(ck: Checkpointer, step: int, what: str, task_dir: Path, final: bool) -> None:
    """Log and count a failed save; the run's final save raises (see the module docstring)."""
    n = ck.on_failure()
    log.error("!!! CHECKPOINT FAILED: %s at step %d (rank %d); no COMMITTED marker was written, "
              "the previous committed checkpoint stays the resume point; %s "
              "(train/checkpoint_failures = %d)", what, step, ck.rank,
              "this was the run's final save" if final else "training continues", n)
    if ck.metrics is not None and ck.rank == 0:
        ck.metrics.log(step, {"train/checkpoint_failures": float(n)}, console=False)
    if final:
        committed = layout.committed_iterations(task_dir)
        newest = (f"the newest committed checkpoint is {committed[-1][1]}" if committed
                  else f"there is no committed checkpoint in {task_dir}")
        raise layout.CheckpointError(f"the run's final checkpoint (step {step}) was not saved: "
                                     f"{what}; the trained weights are not on disk ({newest})")


def _rotate(ck: Checkpointer, task_dir: Path, step: int) -> None:
    """Rank 0 makes room (``max_actor_ckpt_to_keep``); a failure raises on every rank."""
    error = None
    if ck.rank == 0:
        try:
            task_dir.mkdir(parents=True, exist_ok=True)
            removed = layout.rotate(task_dir, ck.keep, step, overwrite=ck.overwrite)
            if removed:
                log.info("checkpoint rotation removed %s", [p.name for p in removed])
        except Exception as exc:  # reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
    error = broadcast_from_rank0(error)
    if error is not None:
        raise layout.CheckpointError(f"checkpoint rotation in {task_dir} failed on rank 0 "
                                     f"before saving iteration {step}: {error}")


def save_checkpoint(ck: Checkpointer, step: int, *, final: bool = False) -> Path | None:
    """Save ``ck``'s parts as iteration ``step``; every rank calls this together.

    Returns the committed ``iter_*`` directory, or None when the write failed (counted,
    logged, training continues). Raises CheckpointError when rotation fails, and when the
    write of the run's ``final`` save fails.
    """
    task_dir = ck.root / ck.task
    iter_dir = task_dir / layout.iter_name(step)
    t0 = time.perf_counter()
    _rotate(ck, task_dir, step)

    ok, cause = True, ""
    try:
        _write(ck, step, iter_dir)
    except (Exception, CheckpointException) as exc:
        cause = describe_failure(exc, written=iter_dir)
        log.error("checkpoint write of %s failed on rank %d: %s", iter_dir, ck.rank, cause,
                  exc_info=not isinstance(exc, (OSError, CheckpointException)))
        ok = False
    if not all_ranks_ok(ok):
        causes = failures_by_rank(None if ok else cause)
        _remove_partial(ck, iter_dir)
        _count_failure(ck, step, f"writing {iter_dir} failed on " + "; ".join(
            f"rank {rank} ({text})" for rank, text in sorted(causes.items())), task_dir, final)
        return None

    error = None
    if ck.rank == 0:
        try:
            _commit(ck, step, iter_dir)
        except Exception as exc:
            error = describe_failure(exc, written=iter_dir)
            log.error("committing %s failed: %s", iter_dir, error)
            if not (iter_dir / layout.COMMITTED).exists():
                _remove_partial(ck, iter_dir)
    error = broadcast_from_rank0(error)
    if error is not None:
        _count_failure(ck, step, f"committing {iter_dir} failed on rank 0 ({error})",
                       task_dir, final)
        return None
    log.info("checkpoint %s committed in %.2fs", iter_dir, time.perf_counter() - t0)
    return iter_dir
