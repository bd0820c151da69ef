"""MixGRPO-Flash's ODE tail: the steps after the SDE window taken by a second-order multistep
solver (DPM-Solver++(2M), Lu et al. 2022, arXiv 2211.01095, section 4) on a compressed schedule.

Flow matching as a diffusion: ``x = alpha x0 + sigma eps`` with ``alpha = 1 - sigma``; the data
prediction is ``D = x - sigma v``; ``lambda = log(alpha / sigma)``; ``h = lambda_t - lambda_s``.
From ``s`` to ``t`` (``sigma_t < sigma_s``):

- first order (DDIM): ``x_t = (sigma_t / sigma_s) x - alpha_t (exp(-h) - 1) D_s``
- second order, midpoint: the same plus ``- 0.5 alpha_t (exp(-h) - 1) D1`` with
  ``D1 = (D_s - D_prev) / r``, ``r = (lambda_s - lambda_prev) / h``.

The final step to ``sigma = 0`` is first order (``lambda = +inf``: ``x_0 = D_s``), as diffusers'
``lower_order_final`` does; MixGRPO's code keeps the second-order term there. Tail schedule
(MixGRPO ``run_sample_step`` with ``dpm_apply_strategy = "post"``): after the window's last
SDE step ``k`` of an ``N``-step sampler, ``n = max(int((N - k) * ratio), 2)`` points from the
unshifted time ``1 - (k + 1) / N`` to 0, each passed through the time shift
``shift * t / (1 + (shift - 1) t)``. ``flash_*_reference`` are the float64 twins.

The engine is handed the model's sigmas, not its shift. Every time shift of this form (the
static ``shift``, and diffusers' dynamic ``exp(mu)`` with its exponential form) adds a constant
to the logit: ``sigma / (1 - sigma) = shift * t / (1 - t)``, with the unshifted time ``t``
linear in the step index. ``fit_time_shift`` recovers ``shift`` and that line from the
schedule, so ``engine_flash_tail`` can take MixGRPO's points in unshifted time and shift them
again, as the reference does. A schedule this form does not describe (custom sigmas, a
terminal stretch) gets ``compress_tail``'s interpolation between its own points instead.
"""
from __future__ import annotations

import math

import torch


def time_shift(shift: float, t: float) -> float:
    return shift * t / (1.0 + (shift - 1.0) * t)


def flash_tail_sigmas(*, num_steps: int, last_sde_step: int, ratio: float, shift: float) -> list[float]:
    """The compressed ODE schedule after step ``last_sde_step`` (module docstring), ending at 0."""
    if not 0 <= last_sde_step < num_steps - 1 or not 0 < ratio <= 1 or shift <= 0:
        raise ValueError(f"flash_tail_sigmas: need 0 <= last_sde_step < num_steps - 1, "
                         f"0 < ratio <= 1, shift > 0; got {last_sde_step}, {num_steps}, {ratio}, {shift}")
    points = max(int((num_steps - last_sde_step) * ratio), 2)
    start = 1.0 - (last_sde_step + 1) / num_steps
    return [time_shift(shift, start * (1.0 - i / (points - 1))) for i in range(points)]


def _lam(sigma: float) -> float:
    return math.log((1.0 - sigma) / sigma)


def dpm_pp_2m_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float,
                   prev_d: torch.Tensor | None, sigma_prev: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One DPM-Solver++(2M) step; returns ``(x_next, D)`` (``D`` feeds the next step's
    ``prev_d``). First order when ``prev_d`` is None or ``sigma_next == 0``. fp32 maths
    (float64 for float64 ``x``), the result in ``x.dtype``."""
    if not 0.0 < sigma < 1.0 or not 0.0 <= sigma_next < sigma:
        raise ValueError(f"dpm_pp_2m_step: need 0 < sigma < 1 and 0 <= sigma_next < sigma, got "
                         f"{sigma}, {sigma_next}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, vf = x.to(dtype), v.to(dtype)
    d = xf - sigma * vf
    if sigma_next == 0.0:
        return d.to(x.dtype), d
    h = _lam(sigma_next) - _lam(sigma)
    alpha_next = 1.0 - sigma_next
    phi = math.expm1(-h)  # exp(-h) - 1, accurate for small h
    out = (sigma_next / sigma) * xf - alpha_next * phi * d
    if prev_d is not None:
        r = (_lam(sigma) - _lam(sigma_prev)) / h
        out = out - 0.5 * alpha_next * phi * (d - prev_d.to(dtype)) / r
    return out.to(x.dtype), d


def dpm_pp_2m_step_reference(x, v, sigma, sigma_next, prev_d, sigma_prev):
    """Float64 twin of ``dpm_pp_2m_step``, in the alpha / sigma / lambda form of the paper."""
    x, v = x.double(), v.double()
    d = x - sigma * v
    if sigma_next == 0.0:
        return d, d
    a_t, s_t, a_s, s_s = 1.0 - sigma_next, sigma_next, 1.0 - sigma, sigma
    lam_t, lam_s = math.log(a_t) - math.log(s_t), math.log(a_s) - math.log(s_s)
    h = lam_t - lam_s
    out = (s_t / s_s) * x - a_t * (math.exp(-h) - 1.0) * d
    if prev_d is not None:
        lam_p = math.log(1.0 - sigma_prev) - math.log(sigma_prev)
        d1 = (d - prev_d.double()) / ((lam_s - lam_p) / h)
        out = out - 0.5 * a_t * (math.exp(-h) - 1.0) * d1
    return out, d


def solve_tail(x: torch.Tensor, velocity, sigmas: list[float]) -> tuple[torch.Tensor, int]:
    """Run DPM-Solver++(2M) over ``sigmas`` from ``x``; ``velocity(x, sigma)`` is the model.
    Returns the final sample and the number of model calls (``len(sigmas) - 1``)."""
    prev_d, prev_sigma = None, None
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        x, d = dpm_pp_2m_step(x, velocity(x, sigma), sigma, sigma_next, prev_d, prev_sigma)
        prev_d, prev_sigma = d, sigma
    return x, len(sigmas) - 1


def compress_tail(tail: list[float], *, steps_after: int, ratio: float) -> list[float]:
    """The engine's Flash schedule: ``n = max(int(steps_after * ratio), 2)`` points spread
    evenly over the index range of ``tail`` (the model's own sigmas from the first step after
    the window to the final 0), each sigma interpolated linearly between its neighbours.
    ``steps_after`` is MixGRPO's ``N - k``. On a schedule linear in the step index this is
    ``flash_tail_sigmas``; on a shifted one it interpolates between the schedule's own points
    instead of re-applying the shift: ``engine_flash_tail``'s fallback for a schedule whose
    shift ``fit_time_shift`` cannot recover."""
    if len(tail) < 2 or tail[-1] != 0.0 or not 0 < ratio <= 1:
        raise ValueError(f"compress_tail: need a tail ending at 0 and 0 < ratio <= 1, got "
                         f"{tail}, {ratio}")
    points = max(int(steps_after * ratio), 2)
    last = len(tail) - 1
    out = []
    for j in range(points):
        pos = j * last / (points - 1)
        lo = min(int(pos), last - 1)
        frac = pos - lo
        out.append(tail[lo] * (1.0 - frac) + tail[lo + 1] * frac)
    out[-1] = 0.0
    return out


# a schedule is taken as shifted-linear when the fit reproduces every sigma this closely (the
# schedules arrive in fp32: rounding leaves ~1e-7)
SHIFT_FIT_TOLERANCE = 1e-5


def fit_time_shift(sigmas: list[float]) -> tuple[float, float] | None:
    """``(shift, c)`` with ``sigma_i = time_shift(shift, 1 - c i)`` for every nonzero sigma
    of ``sigmas`` (from 1 down to a final 0), or None when no such pair reproduces them within
    SHIFT_FIT_TOLERANCE. ``sigma (1 - t) = shift t (1 - sigma)`` with ``t = 1 - c i`` is,
    divided by ``shift``, linear in ``(c / shift, c)``: a least-squares fit in float64
    over the points after the first (which every shift maps to 1)."""
    values = [float(v) for v in sigmas]
    points = [(i, v) for i, v in enumerate(values) if v > 0.0]
    if len(points) < 3 or values[0] != 1.0 or any(not 0.0 < v < 1.0 for _, v in points[1:]):
        return None
    # sigma (1 - t) = shift t (1 - sigma), t = 1 - c i, divided by shift:
    # (c / shift) i sigma + c i (1 - sigma) = 1 - sigma, linear in (c / shift, c)
    rows = torch.tensor([[i * v, i * (1.0 - v)] for i, v in points[1:]], dtype=torch.float64)
    rhs = torch.tensor([[1.0 - v] for _, v in points[1:]], dtype=torch.float64)
    alpha, c = torch.linalg.lstsq(rows, rhs).solution.flatten().tolist()
    if alpha <= 0.0 or c <= 0.0:
        return None
    shift = c / alpha
    if any(abs(time_shift(shift, 1.0 - c * i) - v) > SHIFT_FIT_TOLERANCE for i, v in points):
        return None
    return shift, c


def engine_flash_tail(sigmas: list[float], first: int, ratio: float) -> list[float]:
    """The engine's Flash schedule from ``sigmas[first]`` (the first step after the window) of
    the model's ``N + 1`` sigmas: MixGRPO's ``max(int((N - k) * ratio), 2)`` points, ``k =
    first - 1``, spread evenly in unshifted time from that step's to 0 and shifted with the
    schedule's own shift (``fit_time_shift``); ``compress_tail`` where no shift fits."""
    values = [float(v) for v in sigmas]
    fit = fit_time_shift(values)
    if fit is None:
        return compress_tail(values[first:], steps_after=len(values) - first, ratio=ratio)
    if not 0 < first < len(values) - 1 or not 0 < ratio <= 1:
        raise ValueError(f"engine_flash_tail: need 0 < first < {len(values) - 1} and "
                         f"0 < ratio <= 1, got {first}, {ratio}")
    shift, _ = fit
    points = max(int((len(values) - first) * ratio), 2)
    sigma = values[first]
    start = sigma / (shift - (shift - 1.0) * sigma)  # the inverse of time_shift
    return [time_shift(shift, start * (1.0 - j / (points - 1))) for j in range(points)]
