"""Every consumer of the SDE-type table agrees with it: the kernels accept and refuse exactly
what the table says (eta range, undefined points, kernel codes), and the sampling config,
preflight, the request builder and the engine's request parser refuse the same things with the
table's own words. A source check keeps the type names out of comparisons in the consumers."""
from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch

import flowgrpo_kernels as kernels
from flowgrpo_kernels import sde_types
from flowgrpo_kernels.sde_types import SDE_TYPES, TABLE, TRAINED
from trainer.config import ConfigError, load_config
from trainer.config.sampling import SamplingConfig, SamplingError
from trainer.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
ETAS = (0.0, 0.5, 1.0, 1.5)


def _xv(batch: int = 2, n: int = 12):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(batch, n, generator=gen), torch.randn(batch, n, generator=gen)


@pytest.mark.parametrize("name", sde_types.KERNEL_SDE_TYPES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_accept_exactly_the_tables_eta_range(name, backend):
    x, v = _xv()
    row = TABLE[name]
    for eta in ETAS:
        problem = row.eta_problem(eta, noise_required=False)
        if problem is None:
            kernels.sde_step(x, v, 0.5, 0.4, eta=eta, sde_type=name, backend=backend)
        else:
            with pytest.raises(ValueError) as info:
                kernels.sde_step(x, v, 0.5, 0.4, eta=eta, sde_type=name, backend=backend)
            assert problem in str(info.value)
    assert (TABLE["cps"].eta_max, TABLE["sde"].eta_max) == (1.0, math.inf)


@pytest.mark.parametrize("row", TRAINED, ids=[r.name for r in TRAINED])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_refuse_exactly_the_tables_undefined_points(row, backend):
    x, v = _xv()
    for sigma_one in sde_types.SIGMA_ONE_TREATMENTS:
        out = kernels.sde_step(x, v, 1.0, 0.9, eta=0.5, sde_type=row.name, sigma_one=sigma_one,
                               backend=backend)
        replay = lambda: kernels.sde_log_prob(x, v, out.prev_sample, 1.0, 0.9, eta=0.5,  # noqa: E731
                                              sde_type=row.name, sigma_one=sigma_one,
                                              backend=backend)
        if row.refuses_sigma_one(sigma_one):
            with pytest.raises(ValueError) as info:
                replay()
            assert row.sigma_one_problem() in str(info.value)
        else:
            assert torch.isfinite(replay()).all()
    for form in sde_types.LOG_PROB_FORMS:
        out = kernels.sde_step(x, v, 0.2, 0.0, eta=0.5, sde_type=row.name, log_prob_form=form,
                               backend=backend)
        replay = lambda: kernels.sde_log_prob(x, v, out.prev_sample, 0.2, 0.0, eta=0.5,  # noqa: E731
                                              sde_type=row.name, log_prob_form=form,
                                              backend=backend)
        if row.refuses_last_step(form):
            with pytest.raises(ValueError) as info:
                replay()
            assert row.last_step_problem() in str(info.value)
        else:
            assert torch.isfinite(replay()).all()


def test_triton_codes_are_the_tables():
    from flowgrpo_kernels import sde_triton

    codes = {}
    for name, row in TABLE.items():
        for sigma_one in sde_types.SIGMA_ONE_TREATMENTS:
            code = sde_triton.step_params(name, 0.5, sigma_one).code
            assert code == row.kernel_code(0.5, sigma_one)
            codes.setdefault(code, set()).add((name, sigma_one if row.singular_at_sigma_one else ""))
        assert sde_triton.step_params(name, 0.0).code == TABLE["ode"].code  # eta 0: the ODE step
    assert all(len(owners) == 1 for owners in codes.values()), codes  # one branch per code


@pytest.mark.parametrize("row", TRAINED, ids=[r.name for r in TRAINED])
def test_sampling_config_and_preflight_refuse_what_the_table_refuses(row):
    for eta in ETAS[1:]:
        problem = row.eta_problem(eta, noise_required=True)
        config, problems = SamplingConfig.check({"sde_type": row.name, "eta": eta,
                                                 "sde_indices": [2]})
        assert (problem in problems) if problem else not problems, (eta, problems)
    for sigma_one in sde_types.SIGMA_ONE_TREATMENTS:
        table = {"sde_type": row.name, "sde_indices": [0, 2], "sigma_one": sigma_one, "eta": 0.5}
        cfg = load_config("tiny", ["rollout.sampling=" + json.dumps(table)])
        if row.refuses_sigma_one(sigma_one):
            with pytest.raises(ConfigError) as info:
                preflight(cfg)
            assert any(p.startswith("rollout.sampling.sde_indices") and row.sigma_one_problem() in p
                       for p in info.value.problems), info.value.problems
        else:
            assert preflight(cfg) == []
    for form in ("gaussian", "reference"):
        table = {"sde_type": row.name, "sde_indices": [6, 7], "cps_log_prob": form, "eta": 0.5,
                 "num_inference_steps": 8}
        form_of_kernels = SamplingConfig(sde_type=row.name, cps_log_prob=form).log_prob_form
        if row.refuses_last_step(form_of_kernels):
            with pytest.raises(SamplingError) as info:
                SamplingConfig.from_dict(table)
            assert any(row.last_step_problem() in p for p in info.value.problems)
        else:
            SamplingConfig.from_dict(table)


@pytest.mark.parametrize("row", TRAINED, ids=[r.name for r in TRAINED])
def test_request_builder_and_engine_parser_refuse_what_the_table_refuses(row):
    from engine_fixtures import SAMPLING, FixtureAdapter  # no model files needed here
    from trainer.engine.embedded.request import RequestError, parse_generate_request

    adapter = FixtureAdapter("unused")
    for sigma_one in sde_types.SIGMA_ONE_TREATMENTS:
        sampling = {**SAMPLING, "sde_type": row.name, "eta": 0.5, "sigma_one": sigma_one,
                    "sde_indices": [1, 2]}
        build = lambda: adapter.build_rollout_request(  # noqa: E731 (driver-resolved step 0)
            ["a", "b"], ["s0", "s1"], sampling, rollout_id=0, seed=1, sde_indices=[0, 2])
        good = adapter.build_rollout_request(["a", "b"], ["s0", "s1"], sampling, rollout_id=0,
                                             seed=1)
        at_one = dict(good, rollout_sde_step_indices=[0, 2])
        if row.refuses_sigma_one(sigma_one):
            with pytest.raises(ValueError, match="sigma == 1") as info:
                build()
            assert row.sigma_one_problem() in str(info.value)
            with pytest.raises(RequestError) as info:
                parse_generate_request(adapter, at_one)
            assert any(row.sigma_one_problem() in p for p in info.value.problems)
        else:
            assert build()["rollout_sde_step_indices"] == [0, 2]
            assert parse_generate_request(adapter, at_one).sde_indices == [0, 2]
    good = adapter.build_rollout_request(["a"], ["s0"], {**SAMPLING, "sde_type": row.name},
                                         rollout_id=0, seed=1)
    for eta in ETAS[1:]:  # eta 0 with SDE steps is refused for every type (no noise)
        problem = row.eta_problem(eta, noise_required=False)
        request = dict(good, rollout_noise_level=eta)
        if problem is None:
            parse_generate_request(adapter, request)
        else:
            with pytest.raises(RequestError) as info:
                parse_generate_request(adapter, request)
            assert any(problem in p for p in info.value.problems)


CONSUMERS = ("trainer/config/sampling.py", "trainer/preflight/static.py",
             "trainer/engine/embedded/request.py", "trainer/engine/embedded/sampler.py",
             "trainer/models/wire/request.py", "trainer/models/wire/response.py",
             "flowgrpo_kernels/sde.py", "flowgrpo_kernels/sde_triton.py")


@pytest.mark.parametrize("path", CONSUMERS)
def test_consumers_compare_no_sde_type_names(path):
    """A rule about a type is asked of the table, never written as ``sde_type == "cps"``."""
    tree = ast.parse((ROOT / path).read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and "sde_type" in ast.unparse(node).lower():
            for operand in [node.left, *node.comparators]:
                if isinstance(operand, ast.Constant) and operand.value in TABLE:
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not found, found
    assert set(SDE_TYPES) <= set(TABLE)
