"""The learning tests' measurement: eval under several generation seeds, train, eval again.

The spread across seeds at fixed weights is the eval's own noise; the gain is the change of the
seed mean. Shared by test_train_learns.py (a dense reward) and test_toy_learning.py (the toy
task's compositional reward).
"""
from __future__ import annotations

from typing import Callable

SEEDS = (1234, 7, 99)


def train_and_measure(trainer, rollouts: int, check_step: Callable[[int, dict], None],
                      seeds=SEEDS) -> tuple[list[float], list[float], float, float]:
    """(before, after, gain, noise) over ``rollouts`` training steps; ``check_step(rollout,
    metrics)`` asserts per-step invariants. Closes the trainer."""
    try:
        before = trainer.eval_over_seeds(seeds)
        for rollout_id in range(rollouts):
            check_step(rollout_id, trainer.train_step(rollout_id))
        after = trainer.eval_over_seeds(seeds)
    finally:
        trainer.close()
    noise = max(max(before) - min(before), max(after) - min(after))
    gain = sum(after) / len(after) - sum(before) / len(before)
    return before, after, gain, noise
