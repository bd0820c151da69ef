"""``save_checkpoint(trainer, step)``: one crash-safe checkpoint of a training run.

Order (docs/design.md#checkpoints): rotation by rank 0, broadcast -> DCP shards -> per-rank RNG ->
JSON sidecars (rank 0) -> MIN all-reduce of every rank's success -> COMMITTED (rank 0) ->
``latest_checkpointed_iteration.txt`` in the task directory, then in the root.

Failure policy: a rotation failure raises on every rank (rank 0's result is broadcast, so no
rank is left waiting in a collective). A failed write (DCP, RNG, sidecars, or the commit
itself; disk full included: DCP wraps the OSError in a ``CheckpointException``, which is a
``BaseException``) on any rank is logged loudly on every rank with the OS error, counted in
``trainer.checkpoint_failures`` (the loop logs it as ``train/checkpoint_failures``), its
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
  offloaded again afterwards: DCP reads the device shards, whose storage is freed while
  offloaded.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from trainer.actor.model import offload_actor, onload_actor
from trainer.checkpoint import layout
from trainer.checkpoint.contract import adapter_contract, sampling_fingerprint, \
    weight_sync_manifest
from trainer.checkpoint.rng import write_rng
from trainer.checkpoint.shards import write_shards
from trainer.utils.collectives import all_ranks_ok, broadcast_from_rank0, failures_by_rank

log = logging.getLogger("trainer.checkpoint")


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.save or Path(cfg.logging.run_dir) / "checkpoints")


def trainer_state(trainer, step: int, counters: dict) -> dict:
    """``trainer_state.json``: the trainer's counters (``TrainerState.state_dict``) and what
    the run was."""
    cfg = trainer.cfg
    return {
        "format": layout.FORMAT_VERSION,
        "iteration": int(step),
        **counters,
        "task": cfg.model.task,
        "adapter": cfg.model.adapter_path,
        "model_path": str(trainer.model_path),
        "trainable_mode": "lora" if cfg.lora.rank > 0 else "full",
        "weight_sync_mode": cfg.sync_mode,
        "sampling": cfg.rollout.sampling.to_dict(),
        "sampling_fingerprint": sampling_fingerprint(trainer),
        "generation_seed": cfg.rollout.generation_seed,
        "world_size": int(trainer.world),
        "torch_version": torch.__version__,
        "time": time.time(),
    }


def _write(trainer, step: int, iter_dir: Path) -> None:
    """Shards, this rank's RNG, and (rank 0) the JSON sidecars, in that order."""
    lora = trainer.cfg.lora.rank > 0
    iter_dir.mkdir(parents=True, exist_ok=True)
    write_shards(trainer.model, trainer.optimizer, lora, iter_dir / layout.FSDP_DIR)
    if getattr(trainer, "ema", None) is not None:  # trainer.ema: its own DCP directory
        trainer.ema.save(iter_dir / "ema")
    state = trainer.state_dict()
    rng = state.pop("rng")
    write_rng(iter_dir / layout.rng_file(trainer.rank), rng)
    if trainer.rank == 0:
        layout.atomic_write_json(iter_dir / layout.TRAINER_STATE, trainer_state(trainer, step, state))
        layout.atomic_write_json(iter_dir / layout.WEIGHT_SYNC_MANIFEST,
                                 weight_sync_manifest(trainer.model, trainer.cfg,
                                                      trainer.adapter), indent=None)
        layout.atomic_write_json(iter_dir / layout.ADAPTER_CONTRACT,
                                 adapter_contract(trainer.cfg, trainer.adapter,
                                                  trainer.model_path))


def _commit(trainer, root: Path, task: str, step: int, iter_dir: Path) -> None:
    layout.write_commit_marker(iter_dir, step, trainer.world)
    layout.write_latest(root, task, step)


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


def _remove_partial(trainer, iter_dir: Path) -> None:
    """Rank 0 removes a failed save's directory (it was never committed)."""
    if trainer.rank != 0 or not iter_dir.exists():
        return
    try:
        layout.remove_tree(iter_dir)
        log.warning("removed the partial checkpoint directory %s", iter_dir)
    except OSError as exc:
        log.error("could not remove the partial checkpoint directory %s: %s", iter_dir,
                  describe_failure(exc))


def _count_failure(trainer, step: int, what: str, task_dir: Path, final: bool) -> None:
    """Log and count a failed save; the run's final save raises (see the module docstring)."""
    n = trainer.record_checkpoint_failure()
    log.error("!!! CHECKPOINT FAILED: %s at step %d (rank %d); no COMMITTED marker was written, "
              "the previous committed checkpoint stays the resume point; %s "
              "(train/checkpoint_failures = %d)", what, step, trainer.rank,
              "this was the run's final save" if final else "training continues", n)
    metrics = getattr(trainer, "metrics", None)
    if metrics is not None and trainer.rank == 0:
        metrics.log(step, {"train/checkpoint_failures": float(n)}, console=False)
    if final:
        committed = layout.committed_iterations(task_dir)
        newest = (f"the newest committed checkpoint is {committed[-1][1]}" if committed
                  else f"there is no committed checkpoint in {task_dir}")
        raise layout.CheckpointError(f"the run's final checkpoint (step {step}) was not saved: "
                                     f"{what}; the trained weights are not on disk ({newest})")


def save_checkpoint(trainer, step: int, *, final: bool = False) -> Path | None:
    """Save ``trainer`` as iteration ``step``; every rank calls this together.

    Returns the committed ``iter_*`` directory, or None when the write failed (counted,
    logged, training continues). Raises CheckpointError when rotation fails, and when the
    write of the run's ``final`` save fails.
    """
    cfg = trainer.cfg
    root, task = checkpoint_root(cfg), cfg.model.task
    task_dir = root / task
    iter_dir = task_dir / layout.iter_name(step)
    t0 = time.perf_counter()

    error = None
    if trainer.rank == 0:
        try:
            task_dir.mkdir(parents=True, exist_ok=True)
            removed = layout.rotate(task_dir, cfg.checkpoint.max_actor_ckpt_to_keep, step,
                                    overwrite=bool(getattr(cfg.checkpoint, "overwrite", False)))
            if removed:
                log.info("checkpoint rotation removed %s", [p.name for p in removed])
        except Exception as exc:  # reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
    error = broadcast_from_rank0(error)
    if error is not None:
        raise layout.CheckpointError(f"checkpoint rotation in {task_dir} failed on rank 0 "
                                     f"before saving iteration {step}: {error}")

    offloaded = getattr(trainer, "offloaded", None)
    ok, cause = True, ""
    try:
        if offloaded is not None:
            onload_actor(trainer.model, trainer.optimizer, offloaded)
            trainer.offloaded = None
        _write(trainer, step, iter_dir)
    except (Exception, CheckpointException) as exc:
        cause = describe_failure(exc, written=iter_dir)
        log.error("checkpoint write of %s failed on rank %d: %s", iter_dir, trainer.rank, cause,
                  exc_info=not isinstance(exc, (OSError, CheckpointException)))
        ok = False
    finally:
        if offloaded is not None:
            trainer.offloaded = offload_actor(trainer.model, trainer.optimizer)
    if not all_ranks_ok(ok):
        causes = failures_by_rank(None if ok else cause)
        _remove_partial(trainer, iter_dir)
        _count_failure(trainer, step, f"writing {iter_dir} failed on " + "; ".join(
            f"rank {rank} ({text})" for rank, text in sorted(causes.items())), task_dir, final)
        return None

    error = None
    if trainer.rank == 0:
        try:
            _commit(trainer, root, task, step, iter_dir)
        except Exception as exc:
            error = describe_failure(exc, written=iter_dir)
            log.error("committing %s failed: %s", iter_dir, error)
            if not (iter_dir / layout.COMMITTED).exists():
                _remove_partial(trainer, iter_dir)
    error = broadcast_from_rank0(error)
    if error is not None:
        _count_failure(trainer, step, f"committing {iter_dir} failed on rank 0 ({error})",
                       task_dir, final)
        return None
    log.info("checkpoint %s committed in %.2fs", iter_dir, time.perf_counter() - t0)
    return iter_dir
