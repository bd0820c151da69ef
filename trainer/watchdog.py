"""A run that cannot train stops: ``ProgressWatch.check`` after every rollout counts consecutive
rollouts that ended with no optimizer step (every group degenerate, every reward check
failed, every update skipped for a non-finite gradient) and raises ``TrainingStalledError``
after ``train.max_rollouts_without_step`` of them (0: never), naming the likely cause from
that rollout's metrics. ``python -m trainer launch`` turns it into exit code 1.
"""
from __future__ import annotations

import logging

log = logging.getLogger("trainer")


class TrainingStalledError(RuntimeError):
    """Too many consecutive rollouts without an optimizer step."""


def _cause(metrics: dict[str, float]) -> str:
    failed = metrics.get("reward/failed_groups", 0.0)
    skips = metrics.get("train/optimizer_skips", 0.0)
    if failed > 0:
        return (f"{failed:.0f} group(s) failed their reward checks in the last rollout "
                f"(reward.required_components / non-finite rewards), leaving no advantage")
    if metrics.get("train/grad_norm") is not None and skips > 0:
        return f"all {skips:.0f} updates were skipped for a non-finite gradient norm"
    return ("every group's rewards were identical, so every advantage was 0 (a reward that "
            "does not depend on the image, or a group size too small to vary)")


class ProgressWatch:
    """The stall guard of one run: ``check(rollout_id, metrics)`` after every rollout."""

    def __init__(self, max_rollouts_without_step: int) -> None:
        self.limit = int(max_rollouts_without_step or 0)  # 0: never stop
        self.streak = 0  # consecutive rollouts without an optimizer step

    def check(self, rollout_id: int, metrics: dict[str, float]) -> None:
        """Count this rollout's optimizer steps; raise when the limit of empty ones is
        reached. Adds ``train/rollouts_without_step`` to ``metrics``."""
        steps = float(metrics.get("train/optimizer_steps", 1.0))
        self.streak = 0 if steps > 0 else self.streak + 1
        metrics["train/rollouts_without_step"] = float(self.streak)
        streak, limit = self.streak, self.limit
        if streak:
            log.warning("rollout %d made no optimizer step (%d in a row, limit %s): %s",
                        rollout_id, streak, limit or "none", _cause(metrics))
        if limit and streak >= limit:
            raise TrainingStalledError(
                f"no optimizer step in the last {streak} rollouts ({rollout_id - streak + 1}.."
                f"{rollout_id}; train.max_rollouts_without_step={limit}): {_cause(metrics)}")
