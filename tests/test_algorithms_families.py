"""Each new algorithm trains the tiny model of every family (Qwen-Image, SD3, FLUX) one rollout
on the CPU through the real adapters: finite loss, a weight moved, the reward logged."""
from __future__ import annotations

import json
import math

import pytest
import torch
from test_train_loop import _overrides
from tiny_models import ADAPTER_PATHS, FAMILIES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

ALGORITHMS = {
    "flowgrpo_fast+guard": ["train.algorithm=flowgrpo_fast", "train.grpo_guard=true",
                            "train.fast_branch_range=[1,5]", "train.fast_branch_steps=2",
                            'rollout.sampling=' + json.dumps({"init_same_noise": True})],
    "mixgrpo": ["train.algorithm=mixgrpo", "train.mix_window_size=2",
                "train.mix_shift_interval=1",
                'rollout.sampling=' + json.dumps({"sigma_one": "clamp_to_next"})],
    "diffusionnft": ["train.algorithm=diffusionnft",
                     'rollout.sampling=' + json.dumps({"sde_resample_per_rollout": False,
                                                       "timestep_fraction": 0.25})],
}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("family", FAMILIES)
def test_algorithm_trains_each_familys_tiny_model(family, algorithm, tiny_model_dir, tmp_path):
    from trainer.config import load_config
    from trainer.loop import Trainer

    overrides = _overrides(tiny_model_dir(family), tmp_path,
                           [f"model.adapter_path={ADAPTER_PATHS[family]}",
                            "train.num_rollouts=1", *ALGORITHMS[algorithm]])
    trainer = Trainer(load_config("tiny", overrides), rank=0, world=1, device="cpu")
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
                  if p.requires_grad}
        metrics = trainer.train_step(0)
        moved = [n for n, p in trainer.model.named_parameters()
                 if p.requires_grad and not torch.equal(p, before[n])]
    finally:
        trainer.close()
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["reward/mean"])
    assert metrics["train/optimizer_steps"] > 0 and moved
