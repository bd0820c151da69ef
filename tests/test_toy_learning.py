"""The main job learns: a CI-sized run of the `toy` recipe on the shipped toy model raises the
held-out eval reward by several times the eval's own seed-to-seed noise, with no component
falling beyond its own noise and count rising beyond it (the shipped model's caption noise
leaves count alone, so RL must not trade it for colour and position).

Noise is measured, not assumed: the recipe's eval (256 held-out prompts x 2 candidates, ODE)
is repeated under three generation seeds before and after training; the spread across seeds
is the noise, and the change of the mean over the same seeds is the gain.
"""
from __future__ import annotations

import pytest
from eval_gain import gain_and_noise, train_and_measure_metrics

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROLLOUTS = 50       # of the recipe's 100: the CI-sized run
MARGIN = 3          # the gain must be this many times the eval's seed-to-seed spread


def test_toy_run_improves_eval_reward_beyond_seed_noise(tmp_path):
    from trainer.config import load_config
    from trainer.loop import Trainer

    cfg = load_config("toy", [
        f"train.num_rollouts={ROLLOUTS}", f"logging.run_dir={tmp_path / 'run'}",
        "logging.progress=false", "logging.tensorboard=false"])

    def check_step(rollout_id: int, metrics: dict) -> None:
        assert metrics["train/first_update_ratio_mean"] == 1.0

    before, after = train_and_measure_metrics(
        Trainer(cfg, rank=0, world=1, device="cpu"), cfg.train.num_rollouts, check_step)
    keys = ["eval/reward_mean"] + [f"eval/{c}_mean" for c in cfg.reward.required_components]
    stats = {k: gain_and_noise(before, after, k) for k in keys}
    print({k: f"gain {g:+.4f} noise {n:.4f}" for k, (g, n) in stats.items()})
    gain, noise = stats["eval/reward_mean"]
    assert gain > MARGIN * noise, stats
    fallen = {k: v for k, v in stats.items() if v[0] < -v[1]}
    assert not fallen, f"components fell beyond their seed noise: {fallen}"
    count_gain, count_noise = stats["eval/count_mean"]
    assert count_gain > count_noise, f"count did not rise beyond its seed noise: {stats}"
