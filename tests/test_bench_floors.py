"""The step benches' floors, on the CPU: each optimizer variant bench/bench_optimizer.py times
(floors.optimizer_step) takes the clipped AdamW step the actor's fused path takes, and
bench_step.py gives an offloading row its PCIe floor."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from floors import optimizer_step  # noqa: E402


def _after_two_steps(variant: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).requires_grad_() for shape in
              ((48, 16), (16,), (7, 5, 3))]
    for p in params:
        p.grad = 10 * torch.randn(p.shape, generator=gen)  # norm well over 1: the clip acts
    _, step = optimizer_step(variant, params)
    for _ in range(2):
        step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("variant", ["foreach", "compiled"])
def test_each_variant_takes_the_actors_step(variant):
    fused = _after_two_steps("fused")
    other = _after_two_steps(variant)
    gen = torch.Generator().manual_seed(0)
    initial = torch.randn((48, 16), generator=gen)
    assert not torch.equal(fused[0], initial)  # the step moved the parameters
    for a, b in zip(other, fused):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_an_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer variant 'sgd'"):
        optimizer_step("sgd", [torch.zeros(2, requires_grad=True)])


def test_offloading_rows_get_their_pcie_floor(monkeypatch):
    """bench_step.py: a row whose actor was offloaded gets the out-and-back time of the bytes
    it moved at the measured copy rates; a row that did not offload gets nothing."""
    import bench_step

    monkeypatch.setattr(bench_step, "pcie_gb_per_s", lambda: {"d2h": 50.0, "h2d": 25.0})
    moved = {"stage_times": {"perf/offload_gb": 10.0, "perf/offload_time": 0.3}}
    resident = {"stage_times": {"perf/offload_active": 0.0}}
    extra = bench_step.add_pcie_floor([moved, resident])
    assert extra == {"pcie_gb_per_s": {"d2h": 50.0, "h2d": 25.0}}
    assert moved["pcie_floor_s"] == pytest.approx(10 / 50 + 10 / 25)
    assert moved["offload_floor_ratio"] == pytest.approx(0.3 / (10 / 50))
    assert "pcie_floor_s" not in resident
    assert bench_step.add_pcie_floor([resident]) == {}
