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
    """(before, after, gain, noise) of the eval reward over ``rollouts`` training steps;
    ``check_step(rollout, metrics)`` asserts per-step invariants. Closes the trainer."""
    before, after = train_and_measure_metrics(trainer, rollouts, check_step, seeds)
    return (*(_values(m, "eval/reward_mean") for m in (before, after)),
            *gain_and_noise(before, after, "eval/reward_mean"))


def train_and_measure_metrics(trainer, rollouts: int, check_step: Callable[[int, dict], None],
                              seeds=SEEDS) -> tuple[list[dict], list[dict]]:
    """Every eval metric under each seed, before and after ``rollouts`` training steps."""
    try:
        before = trainer.eval_metrics_over_seeds(seeds)
        for rollout_id in range(rollouts):
            check_step(rollout_id, trainer.train_step(rollout_id))
        after = trainer.eval_metrics_over_seeds(seeds)
    finally:
        trainer.close()
    return before, after


def _values(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics]


def gain_and_noise(before: list[dict], after: list[dict], key: str) -> tuple[float, float]:
    """(change of the seed mean, larger of the two seed spreads) of one eval metric."""
    b, a = _values(before, key), _values(after, key)
    noise = max(max(b) - min(b), max(a) - min(a))
    return sum(a) / len(a) - sum(b) / len(b), noise
