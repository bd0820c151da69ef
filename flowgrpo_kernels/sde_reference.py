"""Readable torch reference of the Flow-GRPO SDE transition and its Gaussian log-density.

This module is the oracle: the Triton kernels in ``sde_triton.py`` beside it are tested against it,
and it is the production path wherever Triton is not used (CPU, other devices). Everything here
works in float64 when the inputs are float64 and in float32 otherwise (bf16/fp16 inputs are
upcast before any arithmetic).

Notation: latent ``x`` at noise level ``s = sigma``, velocity ``v``, next level ``s' = sigma_next``
(``s' < s``), ``dt = s' - s < 0``, noise level ``eta``. Each transition is an isotropic Gaussian
``x' ~ N(mean, std^2)`` whose mean is affine in ``x`` and ``v``: ``mean = a * x + b * v`` with
per-sample scalars ``a``, ``b``. The formulas, written plainly (Flow-GRPO paper, appendix A.4):

- ``sde`` (Flow-GRPO): ``std_dev_t = eta * sqrt(s / (1 - s))``,
  ``mean = x * (1 + std_dev_t^2 / (2 s) * dt) + v * (1 + std_dev_t^2 * (1 - s) / (2 s)) * dt``,
  ``std = std_dev_t * sqrt(-dt)``.
- ``dance`` (DanceGRPO): ``std_dev_t = eta``, same mean, ``std = eta * sqrt(-dt)``.
- ``cps`` (coefficient-preserving sampling): ``std_dev_t = s' * sin(eta * pi / 2)``,
  ``x0 = x - s * v``, ``n = x + (1 - s) * v``,
  ``mean = x0 * (1 - s') + n * sqrt(s'^2 - std_dev_t^2)``, ``std = std_dev_t``.
- ``ode`` (also any type with ``eta == 0``): ``mean = x + v * dt``, ``std = 0``; this is
  diffusers' ``FlowMatchEulerDiscreteScheduler.step``.

Undefined transitions: ``sde`` at ``s == 1`` has an infinite coefficient and ``cps`` at
``s' == 0`` has zero variance. ``sigma_one`` chooses the ``sde`` treatment at ``s == 1``:

- ``"refuse"``: the sample takes the deterministic Euler (ODE) step with ``std = 0`` and its
  Gaussian log-density is NaN; ``kernels.sde_log_prob`` refuses it when validating.
- ``"clamp_to_next"`` (the Flow-GRPO reference): ``std_dev_t = eta * sqrt(s / (1 - s'))``
  where ``s == 1``, ``s'`` being the schedule's second sigma (step 0 goes from sigma 1 to it),
  with the same mean formula: ``a = 1 + eta^2 dt / (2 (1 - s'))``, ``b = dt``,
  ``var = eta^2 s / (1 - s') (-dt)``. The step is then an ordinary Gaussian and trainable.

Log-density, ``log_prob_form``, averaged over all non-batch elements (Flow-GRPO's convention),
so ``log_prob`` has shape ``[B]``:

- ``"gaussian"``: ``log N(x'; mean, std^2) = -(x' - mean)^2 / (2 std^2) - log(std) -
  log(sqrt(2 pi))``, a true log-density; NaN where ``std == 0``.
- ``"squared_residual"``: ``-(x' - mean)^2`` with no variance and no constants, the Flow-GRPO
  reference's ``cps`` log-prob. It is NOT the Gaussian up to a constant: its log-ratio is the
  Gaussian one times ``2 std^2``, so the clip range acts on a different scale at every step.
  It is defined where ``std == 0`` (0 for the sampled ``x' == mean``).

KL between the policy's and the reference model's transition from the same ``x``
(``sde_kl_ref``), ``kl_form``:

- ``"gaussian"``: the closed-form ``KL(N(mean, std^2) || N(mean_ref, std^2))`` =
  ``mean((mean - mean_ref)^2) / (2 std^2)``.
- ``"reference"`` (Flow-GRPO): ``mean((mean - mean_ref)^2) / (2 std_dev_t^2)`` with the
  ``std_dev_t`` of the formulas above (for ``sde`` and ``dance`` without the ``sqrt(-dt)``
  factor, so it is the Gaussian KL times ``-dt``; for ``cps`` the two forms agree).
"""
from __future__ import annotations

import math

import torch

from .sde_types import is_deterministic  # noqa: F401  (the kernels' callers import it here)

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (all math is fp32 for bf16/fp16 inputs)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def per_sample(value, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A python float, 0-dim tensor or ``[B]`` tensor as a ``[B]`` tensor of ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(-1).expand(batch)
    return torch.full((batch,), float(value), dtype=dtype, device=device)


def _as_column(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """``[B]`` -> ``[B, 1, ..., 1]`` broadcastable against a ``ndim``-dimensional latent."""
    return t.reshape((t.shape[0],) + (1,) * (ndim - 1))


def transition_coefficients_ref(sigma, sigma_next, *, eta: float, sde_type: str, batch: int,
                                dtype: torch.dtype, device, sigma_one: str = "refuse"
                                ) -> tuple[torch.Tensor, ...]:
    """Per-sample ``(a, b, var)`` with ``mean = a * x + b * v`` and noise variance ``var``.

    Algebraically equal to the literal formulas in ``sde_transition_ref`` (the tests check that in
    float64); the Triton kernels evaluate this form, and ``sde_kl`` uses ``b`` because the KL
    between two transitions from the same ``x`` depends on ``v - v_ref`` only.
    For ``sde``: ``std_dev_t^2 / (2 s) = eta^2 / (2 (1 - s))`` and ``std_dev_t^2 (1 - s) / (2 s) =
    eta^2 / 2``. For ``cps``: ``sqrt(s'^2 - std_dev_t^2) = s' cos(eta pi / 2)``.
    Undefined samples (``sde`` at ``s == 1`` under ``sigma_one="refuse"``, ``cps`` at
    ``s' == 0``) get ``var = 0`` (and, for ``sde``, the ODE step).
    """
    s = per_sample(sigma, batch, dtype, device)
    sn = per_sample(sigma_next, batch, dtype, device)
    dt = sn - s
    one = torch.ones_like(s)
    if is_deterministic(eta, sde_type):
        return one, dt, torch.zeros_like(s)
    eta2 = eta * eta
    if sde_type == "sde":
        singular = s >= 1.0
        if sigma_one == "clamp_to_next":  # 1 - s replaced by 1 - s' where s == 1
            one_minus = torch.where(singular, 1.0 - sn, 1.0 - s)
            a = 1.0 + eta2 * dt / (2.0 * one_minus)
            b = (1.0 + eta2 * (1.0 - s) / (2.0 * one_minus)) * dt
            return a, b, eta2 * s / one_minus * (-dt)
        one_minus = torch.where(singular, one, 1.0 - s)
        a = torch.where(singular, one, 1.0 + eta2 * dt / (2.0 * one_minus))
        b = torch.where(singular, dt, (1.0 + 0.5 * eta2) * dt)
        var = torch.where(singular, torch.zeros_like(s), eta2 * s / one_minus * (-dt))
        return a, b, var
    if sde_type == "dance":
        a = 1.0 + eta2 * dt / (2.0 * s)
        b = (1.0 + eta2 * (1.0 - s) / (2.0 * s)) * dt
        return a, b, eta2 * (-dt)
    # cps
    c = sn * math.cos(eta * math.pi / 2.0)
    std_dev_t = sn * math.sin(eta * math.pi / 2.0)
    return (1.0 - sn) + c, (1.0 - s) * c - s * (1.0 - sn), std_dev_t * std_dev_t


def sde_transition_ref(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, *, eta: float,
                       sde_type: str = "sde", sigma_one: str = "refuse"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` of the transition ``x -> x'``; mean like ``x`` in the compute dtype, std ``[B]``.

    Written in the paper's form (not in the ``a, b`` form), so that it is a readable oracle.
    """
    dtype = compute_dtype(x, v)
    batch, ndim, device = x.shape[0], x.dim(), x.device
    xf, vf = x.to(dtype), v.to(dtype)
    s_b = per_sample(sigma, batch, dtype, device)
    sn_b = per_sample(sigma_next, batch, dtype, device)
    s, sn = _as_column(s_b, ndim), _as_column(sn_b, ndim)
    dt = sn - s
    if is_deterministic(eta, sde_type):
        return xf + vf * dt, torch.zeros_like(s_b)
    if sde_type in ("sde", "dance"):
        if sde_type == "sde" and sigma_one == "clamp_to_next":
            # the reference's literal form: 1 - sigma, with sigma replaced by the schedule's
            # second sigma where sigma == 1
            singular_b = torch.zeros_like(s_b, dtype=torch.bool)
            safe_s = s
            std_dev_t = eta * torch.sqrt(s / (1.0 - torch.where(s == 1.0, sn, s)))
        elif sde_type == "sde":
            singular_b = s_b >= 1.0
            safe_s = torch.where(_as_column(singular_b, ndim), torch.full_like(s, 0.5), s)
            std_dev_t = eta * torch.sqrt(safe_s / (1.0 - safe_s))
        else:
            singular_b = torch.zeros_like(s_b, dtype=torch.bool)
            safe_s = s
            std_dev_t = torch.full_like(s, eta)
        mean = (xf * (1.0 + std_dev_t ** 2 / (2.0 * safe_s) * dt)
                + vf * (1.0 + std_dev_t ** 2 * (1.0 - safe_s) / (2.0 * safe_s)) * dt)
        std = (std_dev_t * torch.sqrt(-dt)).reshape(batch)
        singular = _as_column(singular_b, ndim)
        mean = torch.where(singular, xf + vf * dt, mean)
        return mean, torch.where(singular_b, torch.zeros_like(std), std)
    # cps
    std_dev_t = sn * math.sin(eta * math.pi / 2.0)
    x0_pred = xf - s * vf
    noise_pred = xf + (1.0 - s) * vf
    mean = x0_pred * (1.0 - sn) + noise_pred * torch.sqrt((sn ** 2 - std_dev_t ** 2).clamp_min(0.0))
    return mean, std_dev_t.reshape(batch)


def gaussian_log_prob_ref(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                          log_prob_form: str = "gaussian") -> torch.Tensor:
    """Mean over non-batch elements of ``log N(sample; mean, std^2)``; NaN where ``std == 0``.

    ``log_prob_form="squared_residual"``: ``-mean((sample - mean)^2)`` instead (no variance, no
    constants; defined everywhere). ``sample`` is data: it is detached, so gradients reach
    ``mean`` (hence ``v``) only.
    """
    dtype = mean.dtype
    sample = sample.detach().to(dtype)
    if log_prob_form == "squared_residual":
        sq = -((sample - mean) ** 2)
        return sq.mean(dim=tuple(range(1, mean.dim()))) if mean.dim() > 1 else sq
    std_col = _as_column(std.to(dtype), mean.dim())
    elementwise = (-((sample - mean) ** 2) / (2.0 * std_col ** 2)
                   - torch.log(std_col) - LOG_SQRT_2PI)
    log_prob = elementwise.mean(dim=tuple(range(1, mean.dim()))) if mean.dim() > 1 else elementwise
    return torch.where(std > 0, log_prob, torch.full_like(log_prob, float("nan")))


def sde_log_prob_ref(x, v, prev_sample, sigma, sigma_next, *, eta: float, sde_type: str = "sde",
                     sigma_one: str = "refuse", log_prob_form: str = "gaussian") -> torch.Tensor:
    """Replay step: ``log p(prev_sample | x)`` per sample, differentiable w.r.t. ``v`` (autograd)."""
    mean, std = sde_transition_ref(x.detach(), v, sigma, sigma_next, eta=eta, sde_type=sde_type,
                                   sigma_one=sigma_one)
    return gaussian_log_prob_ref(prev_sample, mean, std, log_prob_form)


@torch.no_grad()
def sde_step_ref(x, v, sigma, sigma_next, *, eta: float, sde_type: str, noise: torch.Tensor | None,
                 sigma_one: str = "refuse", log_prob_form: str = "gaussian"):
    """Sampling step: ``(prev_sample, log_prob or None, mean, std)``.

    ``prev_sample`` is rounded to ``x.dtype`` *before* its log-density is taken, so the recorded
    log-prob is the density of exactly the tensor that is stored and later replayed.
    """
    mean, std = sde_transition_ref(x, v, sigma, sigma_next, eta=eta, sde_type=sde_type,
                                   sigma_one=sigma_one)
    if is_deterministic(eta, sde_type):
        return mean.to(x.dtype), None, mean, std
    prev_sample = (mean + _as_column(std, x.dim()) * noise.to(mean.dtype)).to(x.dtype)
    # Same functions and operands as sde_log_prob_ref: bitwise-equal log-probs on replay.
    return prev_sample, gaussian_log_prob_ref(prev_sample, mean, std, log_prob_form), mean, std


def std_dev_t_sq_ref(sigma, sigma_next, *, eta: float, sde_type: str, batch: int,
                     dtype: torch.dtype, device, sigma_one: str = "refuse") -> torch.Tensor:
    """``std_dev_t^2`` per sample: ``var / (-dt)`` for ``sde`` / ``dance``, ``var`` for ``cps``."""
    _, _, var = transition_coefficients_ref(sigma, sigma_next, eta=eta, sde_type=sde_type,
                                            batch=batch, dtype=dtype, device=device,
                                            sigma_one=sigma_one)
    if sde_type == "cps":
        return var
    dt = per_sample(sigma_next, batch, dtype, device) - per_sample(sigma, batch, dtype, device)
    return var / (-dt)


def sde_kl_ref(v, v_ref, sigma, sigma_next, *, eta: float, sde_type: str = "sde",
               sigma_one: str = "refuse", kl_form: str = "gaussian") -> torch.Tensor:
    """Per-sample KL between the transitions of ``v`` and ``v_ref`` from the same ``x``, ``[B]``.

    Both means share ``a * x``, so ``mean_v - mean_ref = b * (v - v_ref)``. ``kl_form``:
    ``"gaussian"``: ``mean(b^2 (v - v_ref)^2) / (2 var)``, the closed-form KL (for ``sde`` the
    paper's ``(dt / 2) (std_dev_t (1 - s) / (2 s) + 1 / std_dev_t)^2 (v - v_ref)^2``);
    ``"reference"``: ``mean(b^2 (v - v_ref)^2) / (2 std_dev_t^2)`` (Flow-GRPO's code).
    Differentiable w.r.t. both velocities; NaN where the transition has no variance.
    """
    dtype = compute_dtype(v, v_ref)
    batch = v.shape[0]
    _, b, var = transition_coefficients_ref(sigma, sigma_next, eta=eta, sde_type=sde_type,
                                            batch=batch, dtype=dtype, device=v.device,
                                            sigma_one=sigma_one)
    if kl_form == "reference":
        var = std_dev_t_sq_ref(sigma, sigma_next, eta=eta, sde_type=sde_type, batch=batch,
                               dtype=dtype, device=v.device, sigma_one=sigma_one)
    diff = (v.to(dtype) - v_ref.to(dtype)).reshape(batch, -1)
    kl = (b[:, None] ** 2 * diff ** 2 / (2.0 * var[:, None])).mean(dim=1)
    return torch.where(var > 0, kl, torch.full_like(kl, float("nan")))
