"""Each algorithm trains the shipped toy model end to end (rollout -> reward -> update -> sync):
finite loss, weights moved, reward logged, and each rollout's SDE steps chosen by the algorithm.
Kept to two small rollouts each: the CPU is shared."""
from __future__ import annotations

import json
import math

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

SMALL = ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
         "train.micro_batch_size=4", "train.num_rollouts=2", "logging.progress=false",
         "logging.tensorboard=false", "data.eval_max_prompts=4"]
SHARED = 'rollout.sampling=' + json.dumps({"init_same_noise": True, "num_inference_steps": 8,
                                           "sde_pool": [0, 1, 2, 3]})

ALGORITHMS = {
    "flowgrpo_guard": ["train.grpo_guard=true"],
    "flowgrpo_fast": ["train.algorithm=flowgrpo_fast", "train.fast_branch_range=[0,4]",
                      "train.fast_branch_steps=2", SHARED],
    "mixgrpo": ["train.algorithm=mixgrpo", "train.mix_window_size=2",
                "train.mix_shift_interval=1", SHARED],
    "mixgrpo_flash": ["train.algorithm=mixgrpo", "train.mix_window_size=2",
                      "train.mix_shift_interval=1", "train.mix_flash_ratio=0.4", SHARED],
    # two noise levels per sample (0.2 of the 10 steps) keep it short
    "diffusionnft": ["train.algorithm=diffusionnft", 'rollout.sampling=' + json.dumps(
        {"sde_resample_per_rollout": False, "timestep_fraction": 0.2})],
}


def _run(tmp_path, extra):
    from trainer.config import load_config
    from trainer.loop import Trainer

    cfg = load_config("toy", [*SMALL, f"logging.run_dir={tmp_path / 'run'}", *extra])
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    steps_seen = []
    generate = trainer.driver.generate

    def recording(*args, **kw):
        batch = generate(*args, **kw)
        steps_seen.append(list(batch.sde_indices))
        return batch
    trainer.driver.generate = recording
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                  if p.requires_grad}
        metrics = [trainer.train_step(r) for r in range(2)]
        moved = [n for n, p in trainer.model.named_parameters()
                 if p.requires_grad and not torch.equal(p, before[n])]
    finally:
        trainer.close()
    return metrics, moved, steps_seen


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_algorithm_trains_the_toy_model(name, tmp_path):
    metrics, moved, steps_seen = _run(tmp_path, ALGORITHMS[name])
    for m in metrics:
        assert math.isfinite(m["train/loss"]), m
        assert math.isfinite(m["reward/mean"]) and m["train/optimizer_steps"] > 0
    assert moved, "no trainable weight changed"
    if name == "flowgrpo_fast":
        assert all(len(s) == 2 and s[1] == s[0] + 1 and 0 <= s[0] <= 2 for s in steps_seen)
    if name in ("mixgrpo", "mixgrpo_flash"):
        assert steps_seen == [[0, 1], [1, 2]]
    if name == "diffusionnft":
        assert steps_seen == [[], []]  # ODE rollouts
        assert all(m["train/nft_levels_per_sample"] == 2.0 for m in metrics)
        assert all(math.isfinite(m["train/positive_loss"]) for m in metrics)
    if name == "flowgrpo_guard":
        assert all("train/ratio_mean_bias" in m for m in metrics)
