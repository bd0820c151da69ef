"""``load_checkpoint(checkpointer, path)``: exact resume from the newest COMMITTED iteration.

Restores every DCP part of the ``Checkpointer`` (``trainer.checkpoint.save``): the actor's
model (LoRA: the adapter; the base was already reloaded from --model-path) and optimizer, the
EMA; then hands ``trainer_state.json`` and this rank's RNG to the run state's
``load_state_dict`` (``trainer.state.TrainerState``: policy version, LR step, next rollout,
failure counters, RNG), after checking that the adapter contract (``contract()``, the
current run's) matches the saved one.

Design choices:

* ``path`` may be the --save root, its task directory or one ``iter_*`` directory; only
  committed iterations are trusted, and rank 0 picks one and broadcasts it, so all ranks load
  the same iteration even if a save lands on the filesystem meanwhile.
* The engine already holds the base weights from the trainer's construction, so after the
  restore the weights are pushed again as the saved policy version
  (``TrainerState.resync_engine``);
  without this the first resumed rollout would sample from the base model.
* Only an iteration whose content checksums verify is loaded; newer ones that fail are
  logged and renamed ``iter_N.rejected-<time>`` (kept for inspection, out of the timeline, so
  the next save does not mistake them for another run's checkpoints).
* ``metrics.jsonl`` and TensorBoard are cut back to the resumed iteration
  (``MetricsLogger.truncate_after``): the steps after it are about to be trained again.
* The RNG is restored last, after everything else that might draw from it.
* A missing RNG file for this rank (a different world size) is a warning: per-rank RNG is
  best effort (docs/design.md#checkpoints). The rest still resumes exactly.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from trainer.checkpoint import layout
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.contract import ContractMismatchError, contract_mismatches
from trainer.checkpoint.rng import read_rng
from trainer.checkpoint.save import Checkpointer
from trainer.checkpoint.shards import _shape_problems, _single_process_ok
from trainer.utils.collectives import broadcast_from_rank0

log = logging.getLogger("trainer.checkpoint")


def _set_aside_rejected(chosen: Path) -> None:
    """Rename every committed-looking iteration newer than ``chosen`` (it failed
    verification, or resolve would have chosen it) out of the ``iter_*`` namespace."""
    for n, d in layout.iteration_dirs(chosen.parent):
        if n > layout.parse_iter(chosen.name) and (d / layout.COMMITTED).exists():
            target = d.with_name(f"{d.name}.rejected-{time.time_ns()}")
            os.replace(d, target)
            log.warning("set aside %s as %s: it failed verification, resuming from %s", d,
                        target.name, chosen)


def read_dcp(part, directory: Path) -> None:
    """Fill ``part.state_dict()`` from ``directory`` in place (resharding to the current
    world), then hand it to ``part.load_state_dict``. A part holding a "model" checks first
    that the checkpoint's tensors fit it, naming every misfit."""
    state = part.state_dict()
    if "model" in state:
        problems = _shape_problems(state["model"], directory)
        if problems:
            raise layout.CheckpointError(f"checkpoint {directory} does not fit the model:\n  - "
                                         + "\n  - ".join(problems))
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(directory),
                 no_dist=not (dist.is_available() and dist.is_initialized()))
    part.load_state_dict(state)


def _choose(ck: Checkpointer, path: str | Path) -> Path:
    """Rank 0 picks the newest verified iteration under ``path``; every rank gets it."""
    chosen, error = None, None
    if ck.rank == 0:
        try:
            found = layout.resolve_checkpoint(path, ck.task)
            if layout.parse_iter(Path(path).name) is None:  # newest-of-a-directory resume
                _set_aside_rejected(found)
            chosen = str(found)
        except (layout.CheckpointError, OSError) as exc:
            error = str(exc)
    chosen, error = broadcast_from_rank0((chosen, error))
    if error is not None:
        raise layout.CheckpointError(f"cannot resume from --load {path}: {error}")
    return Path(chosen)


def load_checkpoint(ck: Checkpointer, path: str | Path) -> Path:
    """Restore ``ck``'s parts from the newest committed checkpoint under ``path``; every rank
    calls this together. Returns the loaded ``iter_*`` directory."""
    iter_dir = _choose(ck, path)
    saved = layout.read_json(iter_dir / layout.ADAPTER_CONTRACT)
    problems = contract_mismatches(saved, ck.contract())
    if problems:
        raise ContractMismatchError(iter_dir, problems)
    state = layout.read_json(iter_dir / layout.TRAINER_STATE)
    fingerprint = ck.fingerprint
    if state.get("sampling_fingerprint") != fingerprint:
        log.warning("resuming %s with a different sampling config (fingerprint %s -> %s): "
                    "rollouts will not continue the saved run exactly", iter_dir,
                    state.get("sampling_fingerprint"), fingerprint)
    for name, part in ck.parts.items():  # resumed exactly: the EMA's shadow and update count
        if not (iter_dir / name).is_dir():
            raise layout.CheckpointError(
                f"{iter_dir} has no EMA state but ema.enabled is set" if name == "ema"
                else f"{iter_dir} has no {name} state but this run has one")
        read_dcp(part, iter_dir / name)
    rng_path = iter_dir / layout.rng_file(ck.rank)
    rng = read_rng(rng_path) if rng_path.is_file() else None
    if rng is None:
        log.warning("%s has no RNG state for rank %d (saved with world size %s, now %d): "
                    "RNG not restored on this rank", iter_dir, ck.rank,
                    state.get("world_size"), ck.world)
    ck.state.load_state_dict({**state, "rng": rng})  # counters, engine re-sync, then the RNG
    if ck.rank == 0 and callable(getattr(ck.metrics, "truncate_after", None)):
        ck.metrics.truncate_after(int(state["iteration"]))
    log.info("resumed from %s: next rollout %d, policy version %d, lr step %d", iter_dir,
             int(state["rollout_id"]) + 1, int(state["policy_version"]),
             int(state["lr_scheduler_steps"]))
    return iter_dir
