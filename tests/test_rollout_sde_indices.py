"""SDE-step resolution: priority order, the stride table, step 0."""
from __future__ import annotations

import numpy as np
import pytest

from trainer.rollout import resolve_sde_indices

RECIPE = {"height": 384, "width": 384, "num_inference_steps": 12, "guidance_scale": 1.0,
          "eta": 0.7, "sde_type": "sde", "sde_indices": [3, 4, 5], "sde_resample_per_rollout": True,
          "num_sde_steps": 3, "sde_pool": [1, 2, 3, 4, 5], "driver_xt": True,
          "sample_id_mode": "metadata"}


@pytest.mark.parametrize("sampling, expected", [
    # the example of docs/design.md: fraction [0.0, 0.5] over 12 steps, 3 steps -> stride over 0..5
    ({"num_inference_steps": 12, "sde_type": "dance", "num_sde_steps": 3,
      "sde_timestep_fraction": [0.0, 0.5]}, [0, 2, 4]),
    ({"num_inference_steps": 12, "num_sde_steps": 3, "sde_timestep_fraction": [0.25, 0.75]}, [3, 5, 7]),
    ({"num_inference_steps": 12, "num_sde_steps": 4, "sde_timestep_fraction": [0.5, 1.0]}, [6, 7, 9, 10]),
    # a fraction starting at exactly 1/N excludes step 0 (float rounding must not floor to 0)
    ({"num_inference_steps": 12, "num_sde_steps": 2, "sde_timestep_fraction": [1 / 12, 0.5]}, [1, 3]),
    ({"num_inference_steps": 10, "num_sde_steps": 1, "sde_timestep_fraction": [0.3, 0.4]}, [3]),
    # explicit indices: sorted and de-duplicated, used as given
    ({"num_inference_steps": 12, "sde_indices": [5, 1, 3, 3]}, [1, 3, 5]),
    # explicit indices beat the stride
    ({"num_inference_steps": 12, "sde_indices": [2], "num_sde_steps": 3,
      "sde_timestep_fraction": [0.5, 1.0]}, [2]),
    # nothing configured: pure ODE
    ({"num_inference_steps": 12}, []),
    # dance may train step 0
    ({"num_inference_steps": 12, "sde_type": "dance", "sde_indices": [0, 1]}, [0, 1]),
])
def test_deterministic_resolution_table(sampling, expected):
    assert resolve_sde_indices(sampling, rollout_id=None) == expected


def test_resample_per_rollout_is_numpy_default_rng_and_overrides_explicit():
    for rollout_id in range(20):
        got = resolve_sde_indices(RECIPE, rollout_id=rollout_id)
        want = sorted(np.random.default_rng(rollout_id).choice(
            np.array([1, 2, 3, 4, 5]), size=3, replace=False).tolist())
        assert got == want
        assert got == resolve_sde_indices(dict(RECIPE), rollout_id=rollout_id)  # reproducible
    draws = {tuple(resolve_sde_indices(RECIPE, rollout_id=r)) for r in range(20)}
    assert len(draws) > 3  # it really resamples
    # evaluation (no rollout id) takes the explicit, deterministic list
    assert resolve_sde_indices(RECIPE, rollout_id=None) == [3, 4, 5]


def test_resample_without_pool_draws_from_the_fraction_window():
    sampling = {"num_inference_steps": 12, "sde_type": "dance", "sde_resample_per_rollout": True,
                "num_sde_steps": 2, "sde_timestep_fraction": [0.5, 1.0]}
    for rollout_id in range(10):
        got = resolve_sde_indices(sampling, rollout_id=rollout_id)
        assert len(got) == 2 and set(got) <= set(range(6, 12)) and got == sorted(got)


@pytest.mark.parametrize("sampling, fragment", [
    ({"num_inference_steps": 12, "num_sde_steps": 3, "sde_timestep_fraction": [0.0, 0.5]},
     "window [0, 1, 2, 3, 4, 5] starting at step 0"),
    ({"num_inference_steps": 12, "sde_indices": [0, 3]}, "sde_indices contains 0"),
    ({**RECIPE, "sde_pool": [0, 1, 2, 3]}, "sde_pool contains 0"),
    # default fraction [0, 1] reachable at evaluation when no explicit list exists
    ({"num_inference_steps": 12, "sde_resample_per_rollout": True, "num_sde_steps": 3,
      "sde_pool": [1, 2, 3]}, "starting at step 0"),
])
def test_step_zero_rejected_for_sde_on_every_path(sampling, fragment):
    with pytest.raises(ValueError, match="SDE step 0 cannot be trained") as info:
        resolve_sde_indices(sampling, rollout_id=7)
    assert fragment in str(info.value)


def test_every_problem_reported_at_once():
    bad = {"num_inference_steps": 12, "sde_indices": [0, 13], "sde_pool": "1,2",
           "num_sde_steps": -1, "sde_timestep_fraction": [0.6, 0.5], "sde_type": "euler"}
    with pytest.raises(ValueError) as info:
        resolve_sde_indices(bad, rollout_id=None)
    msg = str(info.value)
    for fragment in ("sde_type must be one of", "0 <= lo < hi <= 1", "sde_pool must be a list",
                     "num_sde_steps must be a non-negative", "sde_indices [13] outside"):
        assert fragment in msg, fragment


@pytest.mark.parametrize("sampling, fragment", [
    ({"num_inference_steps": 12, "sde_resample_per_rollout": True, "sde_pool": [1, 2]},
     "num_sde_steps is 0"),
    ({"num_inference_steps": 12, "sde_resample_per_rollout": True, "num_sde_steps": 3,
      "sde_pool": [1, 2], "sde_indices": [1]}, "exceeds the 2 distinct steps"),
    ({"num_inference_steps": 12, "sde_type": "dance", "num_sde_steps": 5,
      "sde_timestep_fraction": [0.0, 0.25]}, "exceeds the 3 steps"),
    ({"num_inference_steps": 0}, "positive integer"),
])
def test_inconsistent_configs_rejected(sampling, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_sde_indices(sampling, rollout_id=1)
