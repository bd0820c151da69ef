"""train.algorithm / train.grpo_guard and the reference options: typed keys, the default
unchanged, each preflight refusal naming its reason, and the per-rollout step schedules."""
from __future__ import annotations

import json

import pytest

from trainer.algorithms.schedule import algorithm_noise_steps
from trainer.config import ConfigError, load_config
from trainer.preflight import preflight


def tiny(*overrides: str):
    return load_config("tiny", list(overrides))


def problems_of(cfg) -> list[str]:
    with pytest.raises(ConfigError) as info:
        preflight(cfg, world_size=1)
    return info.value.problems


NFT = ["train.algorithm=diffusionnft",
       'rollout.sampling=' + json.dumps({"sde_resample_per_rollout": False})]
FAST = ["train.algorithm=flowgrpo_fast", "train.fast_branch_range=[1,5]",
        'rollout.sampling=' + json.dumps({"init_same_noise": True})]


def test_defaults_keep_flowgrpo_and_its_own_steps():
    cfg = tiny()
    assert cfg.train.algorithm == "flowgrpo" and cfg.train.grpo_guard is False
    assert cfg.lora.init_a == "kaiming" and cfg.ema.per_micro_batch is False
    assert algorithm_noise_steps(cfg.train, num_inference_steps=8, seed=1) is None


@pytest.mark.parametrize("overrides", [
    FAST,
    ["train.algorithm=mixgrpo", "train.mix_window_size=2", "train.mix_shift_interval=2",
     'rollout.sampling=' + json.dumps({"sigma_one": "clamp_to_next"})],
    ["train.grpo_guard=true"],
    ["train.algorithm=flowgrpo_fast", "train.grpo_guard=true", "train.fast_branch_range=[1,5]",
     'rollout.sampling=' + json.dumps({"init_same_noise": True})],
    ["lora.init_a=gaussian", "ema.per_micro_batch=true"],
    NFT,
])
def test_valid_algorithm_configs_pass(overrides):
    assert preflight(tiny(*overrides), world_size=1) == []


# (overrides, substrings one problem must all contain)
REFUSALS = [
    (["train.algorithm=ppo"], ["train.algorithm (--algorithm)", "'ppo'"]),
    (["train.algorithm=diffusionnft", "train.grpo_guard=true"],
     ["train.grpo_guard", "no likelihood ratio"]),
    (["train.grpo_guard=true", "train.anchor=engine"], ["train.anchor", "'replay'", "mean"]),
    (["train.grpo_guard=true", 'rollout.sampling=' + json.dumps(
        {"sde_type": "cps", "cps_log_prob": "reference", "eta": 0.5})],
     ["train.grpo_guard", "Gaussian log-density"]),
    (FAST + ["train.fast_branch_steps=5"], ["train.fast_branch_steps", "no window fits"]),
    (FAST[:1] + FAST[2:] + ["train.fast_branch_range=[0,9]"],
     ["train.fast_branch_range", "num_inference_steps=8"]),
    (FAST[:1] + FAST[2:] + ["train.fast_branch_range=[0,4]"],
     ["step 0", "sigma_one='refuse'", "clamp_to_next"]),
    (["train.algorithm=mixgrpo", "train.mix_window_size=7",
      'rollout.sampling=' + json.dumps({"sigma_one": "clamp_to_next"})],
     ["train.mix_window_size", "larger than the 6 steps"]),
    (["train.algorithm=mixgrpo", "train.mix_window_size=2", "train.mix_shift_interval=1",
      'rollout.sampling=' + json.dumps({"sigma_one": "clamp_to_next"}), "train.num_rollouts=10"],
     ["mixgrpo", "no step to train", "mix_roll_back"]),
    (["train.algorithm=mixgrpo", 'rollout.sampling=' + json.dumps(
        {"sde_step_mode": "every_step", "sigma_one": "clamp_to_next"})],
     ["chooses the SDE steps itself", "every_step"]),
    (["train.algorithm=diffusionnft"], ["diffusionnft", "sde_resample_per_rollout", "ODE"]),
    (NFT + ["rollout.engine=sglang"], ["diffusionnft", "embedded engine"]),
    (NFT + ["train.micro_batch_size=auto"], ["diffusionnft", "micro_batch_size", "'auto'"]),
    (NFT + ["train.nft_old_decay_cap=1.0"], ["train.nft_old_decay_cap", "[0, 1)"]),
    (NFT + ["train.nft_beta=0"], ["train.nft_beta (--nft-beta)", "> 0"]),
    (["lora.init_a=xavier"], ["lora.init_a (--lora-init-a)", "kaiming, gaussian"]),
    (FAST + ["train.mix_flash_ratio=0.4"], ["train.mix_flash_ratio", "no window to follow"]),
    (["train.algorithm=mixgrpo", "train.mix_window_size=2", "train.mix_flash_ratio=1.5",
      'rollout.sampling=' + json.dumps({"sigma_one": "clamp_to_next"})],
     ["train.mix_flash_ratio", "(0, 1]"]),
]


@pytest.mark.parametrize("overrides,expected", REFUSALS, ids=[str(i) for i in range(len(REFUSALS))])
def test_each_bad_combination_is_refused_with_its_reason(overrides, expected):
    problems = problems_of(tiny(*overrides))
    assert any(all(e in p for e in expected) for p in problems), problems


def test_fast_schedule_is_a_function_of_the_rollout_id_inside_the_range():
    cfg = tiny(*FAST)
    steps = algorithm_noise_steps(cfg.train, num_inference_steps=8, seed=7)
    drawn = [steps(r) for r in range(200)]
    assert drawn == [steps(r) for r in range(200)]          # every rank, every restart
    assert {tuple(d) for d in drawn} == {(1, 2), (2, 3), (3, 4)}


def test_nft_training_rollouts_sample_with_the_ode_table():
    from trainer.algorithms import training_sampling
    from trainer.config.sampling import SamplingConfig

    cfg = tiny(*NFT)
    assert algorithm_noise_steps(cfg.train, num_inference_steps=8, seed=7) is None
    table = SamplingConfig.from_dict(training_sampling(cfg.train.algorithm, cfg.data, cfg.rollout.sampling))
    assert table.sde_step_mode == "ode" and table.noise_steps(3) == []
    assert table.num_inference_steps == 8 and table.guidance_scale == 1.0
    assert training_sampling(tiny().train.algorithm, tiny().data, tiny().rollout.sampling) == tiny().rollout.sampling


def test_mix_schedule_slides_with_the_rollout_id():
    cfg = tiny("train.algorithm=mixgrpo", "train.mix_window_size=2", "train.mix_shift_interval=3")
    steps = algorithm_noise_steps(cfg.train, num_inference_steps=8, seed=7)
    assert [steps(r) for r in (0, 2, 3, 6, 15)] == [[0, 1], [0, 1], [1, 2], [2, 3], [5]]


def test_fast_without_a_shared_x_t_is_warned_not_refused():
    warnings = preflight(tiny("train.algorithm=flowgrpo_fast", "train.fast_branch_range=[1,5]"),
                         world_size=1)
    assert any("init_same_noise" in w and "no shared trunk" in w for w in warnings), warnings
