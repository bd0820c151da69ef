"""trainer.models.guidance: CFG in one batched forward, the gradient through the conditional half."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.models.geometry import Geometry
from trainer.models.guidance import (NEGATIVE_PREFIX, guided_velocity, split_conditions,
                                     with_negative)


class CountingAdapter:
    """velocity = W x * c + sigma: both halves depend on the weights and on their condition."""

    def __init__(self):
        self.batches = []

    def velocity(self, model, x, sigma, cond, geometry):
        self.batches.append(x.shape[0])
        return model(x) * cond["c"][:, :1] + sigma[:, None]


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(5, 5, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.randn(5, 5, generator=g, dtype=torch.float64))
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    sigma = torch.full((3,), 0.6, dtype=torch.float64)
    cond = {"c": torch.randn(3, 4, generator=g, dtype=torch.float64)}
    neg = {"c": torch.randn(3, 2, generator=g, dtype=torch.float64)}  # shorter: zero-padded
    return model, x, sigma, cond, neg


def test_one_forward_of_both_halves_gives_the_cfg_combination():
    adapter = CountingAdapter()
    model, x, sigma, cond, neg = _setup()
    scale = 4.5
    v = guided_velocity(adapter, model, x, sigma, with_negative(cond, neg, scale), Geometry(8, 8), scale)
    assert adapter.batches == [6]  # one forward, 2B rows
    with torch.no_grad():
        v_c = adapter.velocity(model, x, sigma, cond, Geometry(8, 8))
        neg_padded = {"c": torch.nn.functional.pad(neg["c"], (0, 2))}
        v_u = adapter.velocity(model, x, sigma, neg_padded, Geometry(8, 8))
    torch.testing.assert_close(v, v_u + scale * (v_c - v_u), rtol=1e-14, atol=1e-14)


def test_gradient_flows_through_the_conditional_half_only():
    """The reference detaches the unconditional prediction: d loss / d W = g * d(v_c term)."""
    adapter = CountingAdapter()
    model, x, sigma, cond, neg = _setup(1)
    scale = 3.0
    weights = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (guided_velocity(adapter, model, x, sigma, with_negative(cond, neg, scale), Geometry(8, 8), scale)
     * weights).sum().backward()
    got = model.weight.grad.clone()
    model.weight.grad = None
    (scale * adapter.velocity(model, x, sigma, cond, Geometry(8, 8)) * weights).sum().backward()
    torch.testing.assert_close(got, model.weight.grad, rtol=1e-12, atol=1e-12)
    # ... and not the gradient of the full combination (which the test could not tell apart
    # if both halves had the same gradient)
    model.weight.grad = None
    neg_padded = {"c": torch.nn.functional.pad(neg["c"], (0, 2))}
    v_u = adapter.velocity(model, x, sigma, neg_padded, Geometry(8, 8))
    v_c = adapter.velocity(model, x, sigma, cond, Geometry(8, 8))
    ((v_u + scale * (v_c - v_u)) * weights).sum().backward()
    assert (got - model.weight.grad).abs().max() > 1e-3


def test_scale_one_is_the_plain_forward_and_negatives_are_required_above_it():
    adapter = CountingAdapter()
    model, x, sigma, cond, neg = _setup()
    assert with_negative(cond, neg, 1.0) == cond
    torch.testing.assert_close(guided_velocity(adapter, model, x, sigma, cond, Geometry(8, 8), 1.0),
                               adapter.velocity(model, x, sigma, cond, Geometry(8, 8)))
    with pytest.raises(ValueError, match=NEGATIVE_PREFIX + "c"):
        guided_velocity(adapter, model, x, sigma, cond, Geometry(8, 8), 2.0)
    both = with_negative(cond, neg, 2.0)
    pos, negative = split_conditions(both)
    assert pos.keys() == cond.keys() and torch.equal(negative["c"], neg["c"])
