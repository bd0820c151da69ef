"""GRPO advantages: hand-made groups checked against plain-Python statistics (the oracle),
for every std mode, with weights, NaN, missing components and degenerate groups. The oracle
follows kernels.normalize_grouped's documented conventions (population std, std + eps, groups
with variance < 1e-6 get 0)."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from trainer.rewards import compute_advantages

EPS = 1e-4
# three groups with non-contiguous, unsorted ids and interleaved members
GROUPS = [7, 3, 7, 100, 3, 7, 100, 3, 100]
PICK = [0.80, 0.86, 0.84, 0.90, 0.82, 0.81, 0.95, 0.88, 0.91]
AES = [5.0, 6.5, 4.0, 6.0, 6.0, 5.5, 7.0, 5.0, 6.5]


def members(groups):
    out = {}
    for i, g in enumerate(groups):
        out.setdefault(g, []).append(i)
    return out


def oracle(values, groups, mode, skip=()):
    """Per-sample normalised value, plain Python; samples in ``skip`` groups ignored."""
    out = [0.0] * len(values)
    usable = [i for i, g in enumerate(groups) if g not in skip and math.isfinite(values[i])]
    batch_std = statistics.pstdev([values[i] for i in usable])
    for g, idx in members(groups).items():
        idx = [i for i in idx if i in usable]
        if not idx:
            continue
        mean = statistics.fmean(values[i] for i in idx)
        std = statistics.pstdev([values[i] for i in idx])
        if std * std < 1e-6:
            continue  # degenerate group: advantage 0
        for i in idx:
            centred = values[i] - mean
            out[i] = {"group": centred / (std + EPS), "batch": centred / (batch_std + EPS),
                      "none": centred}[mode]
    return out


def run(components, groups=GROUPS, **kwargs):
    kwargs.setdefault("weights", {"pickscore": 1.0})
    kwargs.setdefault("required", ["pickscore"])
    kwargs.setdefault("eps", EPS)
    comps = {k: torch.tensor(v, dtype=torch.float32) for k, v in components.items()}
    return compute_advantages(comps, torch.tensor(groups, dtype=torch.int64), **kwargs)


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_single_component_per_std_mode(mode):
    adv, metrics, failed = run({"pickscore": PICK}, std_mode=mode)
    assert adv.dtype == torch.float32 and adv.shape == (9,) and failed == []
    torch.testing.assert_close(adv, torch.tensor(oracle(PICK, GROUPS, mode)), rtol=1e-5, atol=1e-6)
    # group-centred: every group's advantages sum to zero
    for idx in members(GROUPS).values():
        assert abs(sum(adv[i].item() for i in idx)) < 1e-5
    assert metrics["reward/num_groups"] == 3.0 and metrics["reward/failed_groups"] == 0.0


def test_group_mode_numbers_by_hand():
    # group 3 holds 0.86, 0.82, 0.88: mean 0.8533.., population std 0.0249444
    adv, _, _ = run({"pickscore": PICK})
    std = math.sqrt(((0.86 - 0.85333333) ** 2 + (0.82 - 0.85333333) ** 2
                     + (0.88 - 0.85333333) ** 2) / 3)
    assert abs(std - 0.0249444) < 1e-6
    assert adv[4].item() == pytest.approx((0.82 - 0.8533333) / (std + EPS), rel=1e-4)


def test_weighted_components_are_normalised_separately_then_summed():
    adv, metrics, _ = run({"pickscore": PICK, "aesthetic": AES},
                          weights={"pickscore": 1.0, "aesthetic": 0.25},
                          required=["pickscore"], std_mode="group")
    expected = [p + 0.25 * a for p, a in zip(oracle(PICK, GROUPS, "group"),
                                              oracle(AES, GROUPS, "group"))]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for name, values in (("pickscore", PICK), ("aesthetic", AES)):
        assert metrics[f"reward/{name}_mean"] == pytest.approx(statistics.fmean(values))
        assert metrics[f"reward/{name}_std"] == pytest.approx(statistics.pstdev(values), rel=1e-5)
        assert metrics[f"reward/{name}_min"] == pytest.approx(min(values))
        assert metrics[f"reward/{name}_max"] == pytest.approx(max(values))
    assert metrics["reward/advantage_mean"] == pytest.approx(statistics.fmean(expected), abs=1e-6)
    assert metrics["reward/advantage_std"] == pytest.approx(statistics.pstdev(expected), rel=1e-5)
    combined = [p + 0.25 * a for p, a in zip(PICK, AES)]
    group_stds = [statistics.pstdev([combined[i] for i in idx])
                  for idx in members(GROUPS).values()]
    assert metrics["reward/group_std_mean"] == pytest.approx(statistics.fmean(group_stds), rel=1e-5)


def test_unweighted_component_is_logged_not_trained_on():
    adv, metrics, _ = run({"pickscore": PICK, "aesthetic": AES})
    torch.testing.assert_close(adv, torch.tensor(oracle(PICK, GROUPS, "group")), rtol=1e-5,
                               atol=1e-6)
    assert "reward/aesthetic_mean" in metrics


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_required_component_fails_only_its_group(bad):
    pick = list(PICK)
    pick[3] = bad  # sample 3 is in group 100
    adv, metrics, failed = run({"pickscore": pick}, std_mode="batch")
    assert failed == [100] and metrics["reward/failed_groups"] == 1.0
    assert all(adv[i].item() == 0.0 for i in members(GROUPS)[100])
    # the other groups are normalised as if group 100 were not there (batch std too)
    expected = oracle(pick, GROUPS, "batch", skip={100})
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert metrics["reward/pickscore_nonfinite"] == 1.0
    assert math.isfinite(metrics["reward/pickscore_mean"])


def test_missing_required_component_fails_every_group(caplog):
    with caplog.at_level("WARNING"):
        adv, metrics, failed = run({"aesthetic": AES},
                                   weights={"pickscore": 1.0, "aesthetic": 1.0})
    assert failed == [3, 7, 100] and adv.abs().sum().item() == 0.0
    assert metrics["reward/failed_groups"] == 3.0
    assert "required component 'pickscore' is missing" in caplog.text


def test_gaps_in_an_optional_component_only_drop_those_samples():
    aes = list(AES)
    aes[1] = float("nan")  # group 3
    adv, _, failed = run({"pickscore": PICK, "aesthetic": aes},
                         weights={"pickscore": 1.0, "aesthetic": 1.0})
    assert failed == []
    expected = [p + a for p, a in zip(oracle(PICK, GROUPS, "group"), oracle(aes, GROUPS, "group"))]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_absent_optional_component_warns_and_contributes_nothing():
    with pytest.warns(RuntimeWarning, match=r"\['aesthetic'\] were not produced"):
        adv, _, failed = run({"pickscore": PICK}, weights={"pickscore": 1.0, "aesthetic": 0.5})
    assert failed == []
    torch.testing.assert_close(adv, torch.tensor(oracle(PICK, GROUPS, "group")), rtol=1e-5,
                               atol=1e-6)


def test_degenerate_groups_and_batch():
    pick = list(PICK)
    for i in members(GROUPS)[7]:
        pick[i] = 0.5  # no variance in group 7
    adv, metrics, _ = run({"pickscore": pick})
    assert metrics["reward/degenerate_groups"] == 1.0 and metrics["reward/degenerate"] == 0.0
    assert all(adv[i].item() == 0.0 for i in members(GROUPS)[7])
    adv, metrics, _ = run({"pickscore": [0.7] * 9})
    assert metrics["reward/degenerate"] == 1.0 and metrics["reward/degenerate_groups"] == 3.0
    assert metrics["reward/group_std_mean"] == 0.0 and adv.abs().max().item() == 0.0


def test_tiny_variance_group_is_zeroed_not_amplified():
    pick = list(PICK)
    for i, v in zip(members(GROUPS)[3], (0.5, 0.5005, 0.4995)):  # variance 1.7e-7
        pick[i] = v
    adv, metrics, _ = run({"pickscore": pick}, std_mode="group")
    assert all(adv[i].item() == 0.0 for i in members(GROUPS)[3])
    assert metrics["reward/degenerate_groups"] == 1.0
    torch.testing.assert_close(adv, torch.tensor(oracle(pick, GROUPS, "group")), rtol=1e-5,
                               atol=1e-6)


def test_default_eps_is_the_kernel_default():
    import inspect

    from flowgrpo_kernels import normalize_grouped
    default = inspect.signature(normalize_grouped).parameters["eps"].default
    a, _, _ = run({"pickscore": PICK}, eps=None)
    b, _, _ = run({"pickscore": PICK}, eps=default)
    assert torch.equal(a, b) and not torch.equal(a, run({"pickscore": PICK}, eps=0.1)[0])


def test_singleton_groups_get_zero_advantage():
    adv, metrics, _ = run({"pickscore": [0.1, 0.9, 0.4]}, groups=[0, 1, 2], std_mode="batch")
    assert adv.tolist() == [0.0, 0.0, 0.0] and metrics["reward/num_groups"] == 3.0


def test_no_weights_means_equal_weights():
    adv, _, _ = run({"pickscore": PICK, "aesthetic": AES}, weights={}, required=[])
    expected = [p + a for p, a in zip(oracle(PICK, GROUPS, "group"), oracle(AES, GROUPS, "group"))]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_reported_together():
    with pytest.raises(ValueError) as err:
        compute_advantages({"pickscore": torch.zeros(3), "aesthetic": torch.zeros(2, 2)},
                           torch.zeros(3, dtype=torch.float32),
                           weights={"aesthetic": float("nan")}, required=["pickscore"],
                           std_mode="global")
    message = str(err.value)
    for part in ("1-D integer tensor", "std_mode 'global'", "component 'aesthetic' must be",
                 "weight of 'aesthetic' is nan", "required components ['pickscore'] have no weight"):
        assert part in message
    with pytest.raises(ValueError, match=r"component 'pickscore' must be a \[4\] tensor"):
        compute_advantages({"pickscore": torch.zeros(3)}, torch.zeros(4, dtype=torch.int64),
                           weights={"pickscore": 1.0}, required=[])
