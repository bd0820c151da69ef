"""Where it is cheap: the new algorithms (and GRPO-Guard on Flow-GRPO) raise a learnable
reward on the toy model.

The same measurement as test_train_learns.py (the dense "redness" reward, eval under three
generation seeds before and after, gain against the seeds' own spread), with the training
step of each algorithm. A wrong sign or a broken old policy would leave the eval flat or
lower it."""
from __future__ import annotations

import json

import pytest
from eval_gain import train_and_measure

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

BASE = ["train.num_rollouts=8", "rollout.rollout_batch_size=4",
        "reward.custom_reward_path=test_train_learns.redness", "reward.scorer_path=none",
        "reward.required_components=[]", "reward.component_weights={}",
        "data.eval_max_prompts=32", "logging.progress=false", "logging.tensorboard=false",
        "fsdp.trainable_mode=full", "lora.rank=0", "lora.alpha=0", "train.kl_coef=0"]

CASES = {
    "diffusionnft": ["train.algorithm=diffusionnft", "train.lr=3e-5", "data.eval_mode=ode",
                     'rollout.sampling=' + json.dumps({"sde_resample_per_rollout": False,
                                                       "timestep_fraction": 0.3,
                                                       "init_same_noise": False})],
    "flowgrpo_fast": ["train.algorithm=flowgrpo_fast", "train.lr=1e-4", "data.eval_mode=ode",
                      "train.fast_branch_range=[1,5]", "train.fast_branch_steps=2",
                      'rollout.sampling=' + json.dumps({"init_same_noise": True,
                                                        "sigma_one": "refuse",
                                                        "sde_pool": [1, 2, 3, 4]})],
    # a three-step window from step 0 (clamp_to_next, the toy's) that moves once, to 1-3
    "mixgrpo": ["train.algorithm=mixgrpo", "train.lr=1e-4", "data.eval_mode=ode",
                "train.mix_window_size=3", "train.mix_shift_interval=4",
                'rollout.sampling=' + json.dumps({"init_same_noise": False})],
    # test_train_learns.py's Flow-GRPO settings with the guard's re-centred, scaled ratio (each
# case names its algorithm and x_T sharing: the toy recipe's own are Flow-GRPO-Fast's)
    "grpo_guard": ["train.algorithm=flowgrpo", "train.grpo_guard=true", "train.lr=1e-4",
                   "data.eval_mode=sde",
                   'rollout.sampling=' + json.dumps({"sde_pool": [1, 2, 3, 4], "num_sde_steps": 2,
                                                     "sigma_one": "refuse",
                                                     "init_same_noise": False})],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_algorithm_raises_a_learnable_reward_beyond_its_noise(name, tmp_path):
    from trainer.config import load_config
    from trainer.loop import Trainer

    cfg = load_config("toy", [*BASE, f"logging.run_dir={tmp_path / 'run'}", *CASES[name]])
    before, after, gain, noise = train_and_measure(
        Trainer(cfg, rank=0, world=1, device="cpu"), cfg.train.num_rollouts,
        lambda rollout_id, metrics: None)
    print(f"{name}: redness eval before {before} after {after}: gain {gain:.4f}, noise {noise:.4f}")
    assert gain > 2 * noise, (before, after)
