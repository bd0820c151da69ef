"""trainer.config.sampling.SamplingConfig: one owner of the sampling keys, the SDE types and the steps."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trainer.config import sampling as sampling_mod  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.preflight import preflight  # noqa: E402
from trainer.config.sampling import SamplingConfig, SamplingError  # noqa: E402


def test_every_step_mode_noises_all_and_trains_the_reference_fraction():
    cfg = SamplingConfig.from_dict({"num_inference_steps": 10, "sde_step_mode": "every_step",
                                    "timestep_fraction": 0.99, "sigma_one": "clamp_to_next"})
    for rollout_id in (None, 0, 7):
        noise = cfg.noise_steps(rollout_id)
        assert noise == list(range(10))
        assert cfg.trained_steps(noise) == list(range(9))  # int(10 * 0.99) = 9: steps 0..8
    assert cfg.reachable_trained_steps() == list(range(9))
    half = SamplingConfig.from_dict({"num_inference_steps": 12, "sde_step_mode": "every_step",
                                     "timestep_fraction": 0.5, "sigma_one": "clamp_to_next"})
    assert half.trained_steps(half.noise_steps(3)) == list(range(6))


def test_indices_mode_trains_exactly_its_noise_steps():
    cfg = SamplingConfig.from_dict(sampling_mod.RELAX_SAMPLING)
    assert cfg.noise_steps(None) == [3, 4, 5]
    drawn = cfg.noise_steps(11)
    assert cfg.trained_steps(drawn) == drawn and set(drawn) <= {1, 2, 3, 4, 5}


@pytest.mark.parametrize("table, fragment", [
    ({"sde_step_mode": "every_step"}, "sde_step_mode='every_step' puts noise on step 0"),
    ({"sde_step_mode": "every_step", "sigma_one": "clamp_to_next", "timestep_fraction": 0.05},
     "trains no step"),
    ({"sde_type": "cps", "sde_indices": [10, 11]}, "cannot put noise on the last step 11"),
    # the last step is noisy (and records a log-prob) even when it is not trained
    ({"sde_type": "cps", "sde_step_mode": "every_step", "timestep_fraction": 0.9},
     "cannot put noise on the last step 11"),
    ({"sigma_one": "clamp"}, "sigma_one must be one of refuse, clamp_to_next"),
    ({"cps_log_prob": "l2"}, "cps_log_prob must be one of gaussian, reference"),
    ({"timestep_fraction": 1.5}, "timestep_fraction must be in (0, 1]"),
    ({"guidance_scale": 0.0}, "guidance_scale must be a number >= 1.0"),
    ({"eta": 1.5, "sde_type": "cps", "sde_indices": [2]}, "eta must be in (0, 1] with sde_type='cps'"),
    ({"sigma_max": 0.9}, "unknown sampling keys ['sigma_max']"),
])
def test_bad_tables_are_named(table, fragment):
    with pytest.raises(SamplingError) as info:
        SamplingConfig.from_dict(table)
    assert any(fragment in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("table", [
    {"sde_step_mode": "every_step", "sigma_one": "clamp_to_next"},  # step 0 sampled as the reference
    {"sde_indices": [0, 1], "sigma_one": "clamp_to_next"},
    {"sde_type": "cps", "sde_indices": [10, 11], "cps_log_prob": "reference"},  # 0 at the last step
    {"sde_type": "cps", "sde_step_mode": "every_step", "timestep_fraction": 0.9,
     "cps_log_prob": "reference"},  # steps 0..9 of 12 trained
    {"guidance_scale": 4.5, "sde_indices": [2, 3]},
])
def test_reference_options_are_accepted(table):
    cfg = SamplingConfig.from_dict(table)
    assert SamplingConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_kernel_options_map_the_cps_form():
    cps = SamplingConfig.from_dict({"sde_type": "cps", "sde_indices": [2], "cps_log_prob": "reference"})
    assert cps.kernel_options() == {"eta": 0.7, "sde_type": "cps", "sigma_one": "refuse",
                                    "log_prob_form": "squared_residual"}
    sde = SamplingConfig.from_dict({"sde_indices": [2], "cps_log_prob": "reference"})
    assert sde.kernel_options()["log_prob_form"] == "gaussian"  # the option is cps's only


def test_one_list_of_sde_types():
    """Preflight, the request schema, the engine's request parser and the kernels read one table."""
    from flowgrpo_kernels import sde_types
    from trainer.engine.embedded import request

    assert request.SDE_TYPES is sampling_mod.SDE_TYPES is sde_types.SDE_TYPES
    assert set(sde_types.KERNEL_SDE_TYPES) == set(sampling_mod.SDE_TYPES) | {"ode"}
    assert sampling_mod.KL_FORMS is sde_types.KL_FORMS
    assert sampling_mod.SIGMA_ONE_TREATMENTS is sde_types.SIGMA_ONE_TREATMENTS
    assert set(sde_types.LOG_PROB_FORMS) == {SamplingConfig.from_dict(
        {"sde_type": "cps", "sde_indices": [2], "cps_log_prob": f}).log_prob_form
        for f in sampling_mod.CPS_LOG_PROB_FORMS} == set(request.LOG_PROB_FORMS)


def test_a_cps_config_that_passes_preflight_is_served_by_the_engine():
    """The old failure: preflight accepted cps and the request schema refused it."""
    from engine_fixtures import HEIGHT, WIDTH, FixtureAdapter  # no model files needed here
    from trainer.engine.embedded.request import parse_generate_request

    table = {"sde_type": "cps", "sde_indices": [2, 3], "sde_pool": [1, 2, 3],
             "num_inference_steps": 6, "cps_log_prob": "reference"}
    cfg = load_config("tiny", ["rollout.sampling=" + json.dumps(table)])
    assert preflight(cfg) == []
    adapter = FixtureAdapter("unused")
    sampling, _ = cfg.rollout.sampling.merged({"height": HEIGHT, "width": WIDTH})
    request = adapter.build_rollout_request(["a", "a"], ["s0", "s1"], sampling, rollout_id=1, seed=3)
    spec = parse_generate_request(adapter, request)
    assert spec.sde_type == "cps" and spec.log_prob_form == "squared_residual"
    assert spec.sde_indices == sampling.noise_steps(1)
