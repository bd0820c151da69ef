"""The Flow-GRPO reference's options in the SDE kernels, against float64 formulas written out here:
sigma == 1 clamped to the next sigma, the squared-residual (cps) log-prob, the reference KL.

Triton runs under TRITON_INTERPRET=1 without CUDA; the torch reference in float64 is the oracle.
"""
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import flowgrpo_kernels as kernels  # noqa: E402
from flowgrpo_kernels import sde_reference as ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ETA = 0.7
EPS32 = torch.finfo(torch.float32).eps
# a 10-step schedule's first and two later steps, and the last one (sigma_next == 0)
S = torch.tensor([1.0, 0.93, 0.61, 0.27], dtype=torch.float64, device=DEVICE)
SN = torch.tensor([0.93, 0.81, 0.55, 0.0], dtype=torch.float64, device=DEVICE)


def _inputs(shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(DEVICE, dtype) for _ in range(3)]


def _clamped_by_hand(x, v, s, sn):
    """The reference's sde_step_with_logprob, literally: sigma_max = the schedule's sigmas[1]."""
    col = (-1,) + (1,) * (x.dim() - 1)
    s, sn = s.view(col), sn.view(col)
    dt = sn - s
    sigma_max = torch.where(s == 1.0, sn, s)  # step 0 goes from 1 to sigmas[1]
    std_dev_t = torch.sqrt(s / (1 - sigma_max)) * ETA
    mean = x * (1 + std_dev_t ** 2 / (2 * s) * dt) + v * (1 + std_dev_t ** 2 * (1 - s) / (2 * s)) * dt
    return mean, (std_dev_t * torch.sqrt(-dt)).flatten(), std_dev_t.flatten()


def _gaussian_by_hand(sample, mean, std):
    std = std.view((-1,) + (1,) * (mean.dim() - 1))
    lp = -((sample - mean) ** 2) / (2 * std ** 2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return lp.flatten(1).mean(1)


# ------------------------------------------------------------------ sigma == 1: clamp_to_next
def test_clamp_to_next_is_the_reference_formula_in_float64():
    x, v, noise = _inputs((4, 3, 5))
    s, sn = S[:3], SN[:3]
    mean, std, _ = _clamped_by_hand(x[:3], v[:3], s, sn)
    got_mean, got_std = ref.sde_transition_ref(x[:3], v[:3], s, sn, eta=ETA, sde_type="sde",
                                               sigma_one="clamp_to_next")
    torch.testing.assert_close(got_mean, mean, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(got_std, std, rtol=1e-13, atol=0)
    a, b, var = ref.transition_coefficients_ref(s, sn, eta=ETA, sde_type="sde", batch=3,
                                                dtype=torch.float64, device=DEVICE,
                                                sigma_one="clamp_to_next")
    col = (3, 1, 1)
    torch.testing.assert_close(a.view(col) * x[:3] + b.view(col) * v[:3], mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, std ** 2, rtol=1e-12, atol=0)
    # away from sigma == 1 the treatment changes nothing
    refused, _ = ref.sde_transition_ref(x[1:3], v[1:3], s[1:], sn[1:], eta=ETA, sde_type="sde")
    torch.testing.assert_close(got_mean[1:], refused, rtol=0, atol=0)
    out = kernels.sde_step(x[:3], v[:3], s, sn, eta=ETA, noise=noise[:3], backend="torch",
                           sigma_one="clamp_to_next")
    prev = mean + std.view(col) * noise[:3]
    torch.testing.assert_close(out.prev_sample, prev, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(out.log_prob, _gaussian_by_hand(prev, mean, std), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_clamp_to_next_step0_trains_and_replays_bitwise(backend):
    x, v, noise = _inputs((3, 4, 33), torch.float32, seed=1)
    s, sn = S[:3].float(), SN[:3].float()
    out = kernels.sde_step(x, v, s, sn, eta=ETA, noise=noise, backend=backend, sigma_one="clamp_to_next")
    assert torch.isfinite(out.log_prob).all() and (out.std > 0).all()
    with pytest.raises(ValueError, match="singular at sigma == 1"):  # today's refusal stays
        kernels.sde_log_prob(x, v, out.prev_sample, s, sn, eta=ETA, backend=backend)
    vv = v.clone().requires_grad_()
    lp = kernels.sde_log_prob(x, vv, out.prev_sample, s, sn, eta=ETA, backend=backend,
                              sigma_one="clamp_to_next")
    assert torch.equal(lp.detach(), out.log_prob)
    lp.sum().backward()
    # float64 oracle of the value and the gradient
    v64 = v.double().requires_grad_()
    mean, std, _ = _clamped_by_hand(x.double(), v64, s.double(), sn.double())
    lp64 = _gaussian_by_hand(out.prev_sample.double(), mean, std)
    lp64.sum().backward()
    torch.testing.assert_close(lp.detach().double(), lp64.detach(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(vv.grad.double(), v64.grad, rtol=2e-4, atol=1e-6)


# ------------------------------------------------------------- the squared-residual log-prob
@pytest.mark.parametrize("sde_type", ("sde", "dance", "cps"))
@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_squared_residual_value_and_gradient_vs_float64(sde_type, backend):
    x, v, noise = _inputs((3, 5, 17), torch.float32, seed=2)
    s, sn = S[1:].float(), SN[1:].float()  # includes cps's last step, sigma_next == 0
    opts = dict(eta=ETA, sde_type=sde_type, log_prob_form="squared_residual")
    prev = kernels.sde_step(x, v, s, sn, noise=noise, backend="torch", **opts).prev_sample
    v_moved = (v + 0.05 * noise).requires_grad_()  # a policy that moved: non-zero residuals
    lp = kernels.sde_log_prob(x, v_moved, prev, s, sn, backend=backend, **opts)
    lp.sum().backward()
    v64 = v_moved.detach().double().requires_grad_()
    mean, _ = ref.sde_transition_ref(x.double(), v64, s.double(), sn.double(), eta=ETA, sde_type=sde_type)
    lp64 = (-((prev.double() - mean) ** 2)).flatten(1).mean(1)  # the reference: no variance
    lp64.sum().backward()
    torch.testing.assert_close(lp.detach().double(), lp64.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v_moved.grad.double(), v64.grad, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_cps_squared_residual_is_zero_at_the_last_step_when_sampling(backend):
    x, v, noise = _inputs((2, 19), torch.float32, seed=3)
    s, sn = torch.tensor([0.27, 0.5], device=DEVICE), torch.tensor([0.0, 0.3], device=DEVICE)
    out = kernels.sde_step(x, v, s, sn, eta=ETA, sde_type="cps", noise=noise, backend=backend,
                           log_prob_form="squared_residual")
    assert out.log_prob[0].item() == 0.0 and out.log_prob[1].item() < 0.0
    replay = kernels.sde_log_prob(x, v, out.prev_sample, s, sn, eta=ETA, sde_type="cps",
                                  backend=backend, log_prob_form="squared_residual")
    assert torch.equal(replay, out.log_prob)


def test_squared_residual_log_ratio_is_the_gaussian_one_times_two_variances():
    """Why the docstring says the ratio changes: log r_sq = 2 std^2 * log r_gauss, per step."""
    x, v, noise = _inputs((3, 4, 9))
    s, sn = S[1:], SN[1:].clone()
    sn[-1] = 0.05
    prev = kernels.sde_step(x, v, s, sn, eta=ETA, sde_type="cps", noise=noise, backend="torch").prev_sample
    v_new = v + 0.01 * torch.randn_like(v)
    _, std = ref.sde_transition_ref(x, v, s, sn, eta=ETA, sde_type="cps")
    ratios = {}
    for form in ("gaussian", "squared_residual"):
        new = kernels.sde_log_prob(x, v_new, prev, s, sn, eta=ETA, sde_type="cps", log_prob_form=form)
        old = kernels.sde_log_prob(x, v, prev, s, sn, eta=ETA, sde_type="cps", log_prob_form=form)
        ratios[form] = new - old
    torch.testing.assert_close(ratios["squared_residual"], 2 * std ** 2 * ratios["gaussian"],
                               rtol=1e-9, atol=1e-15)


# ------------------------------------------------------------------------------------- KL
@pytest.mark.parametrize("sde_type", ("sde", "dance", "cps"))
def test_reference_kl_is_mean_squared_mean_gap_over_two_std_dev_t_squared(sde_type):
    x, v, _ = _inputs((3, 6, 7))
    v_ref = v + 0.1 * torch.randn_like(v)
    s, sn = S[:3], SN[:3]
    opts = dict(eta=ETA, sde_type=sde_type, sigma_one="clamp_to_next")
    kl = kernels.sde_kl(v, v_ref, s, sn, kl_form="reference", **opts)
    mean, _ = ref.sde_transition_ref(x, v, s, sn, **opts)
    mean_ref, _ = ref.sde_transition_ref(x, v_ref, s, sn, **opts)
    if sde_type == "sde":
        std_dev_t = _clamped_by_hand(x, v, s, sn)[2]
    elif sde_type == "dance":
        std_dev_t = torch.full_like(s, ETA)
    else:
        std_dev_t = sn * math.sin(ETA * math.pi / 2)
    expect = ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * std_dev_t ** 2)
    torch.testing.assert_close(kl, expect, rtol=1e-10, atol=0)
    gaussian = kernels.sde_kl(v, v_ref, s, sn, kl_form="gaussian", **opts)
    factor = (s - sn) if sde_type != "cps" else torch.ones_like(s)  # |dt| (no sqrt(-dt) in std_dev_t)
    torch.testing.assert_close(kl, gaussian * factor, rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match="kl_form"):
        kernels.sde_kl(v, v_ref, s, sn, kl_form="k3", **opts)
