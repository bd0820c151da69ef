"""A run that made no optimizer step has nothing to save and did not do its job.

Every rollout can end without an optimizer step (every reward NaN, every group degenerate,
every update skipped for a non-finite gradient); ``trainer.watchdog`` stops a run after
``train.max_rollouts_without_step`` such rollouts in a row, but a run shorter than that limit
would end "successfully" and commit checkpoints of the untrained model as if trained. Here:

* a save due while the model has had no optimizer step (``lr_steps == 0``: none since step 0,
  resumed runs included) is skipped with a warning: a checkpoint of the base model is not a
  result, and a resume from it would skip rollouts that never trained;
* the run's last rollout ending with no optimizer step ever raises ``UntrainedRunError`` (a
  ``TrainingStalledError``: ``python -m trainer launch`` prints it in one line and exits 1),
  whether or not the run saves at all.
"""
from __future__ import annotations

import logging

from trainer.watchdog import TrainingStalledError

log = logging.getLogger("trainer.checkpoint")


class UntrainedRunError(TrainingStalledError):
    """The run ended without a single optimizer step."""


def worth_saving(trainer, step: int, is_last: bool) -> bool:
    """Whether the loop's save at ``step`` may go ahead (see the module docstring); raises
    UntrainedRunError at the run's last step when no optimizer step was ever taken."""
    if int(getattr(trainer, "lr_steps", 0)) > 0:
        return True
    streak = int(getattr(trainer, "_rollouts_without_step", 0))
    if is_last:
        raise UntrainedRunError(
            f"the run ended after rollout {step} without a single optimizer step ({streak} "
            f"rollout(s) in this launch made none), so nothing was trained and no checkpoint "
            f"was saved; see the warnings above for why each rollout made no step (NaN or "
            f"failed rewards, identical rewards in every group, non-finite gradients)")
    ck = trainer.cfg.checkpoint
    if ck.save_interval > 0 and step % ck.save_interval == 0:
        log.warning("skipping the checkpoint of step %d: no optimizer step has been taken yet, "
                    "so it would hold the untrained model", step)
    return False
