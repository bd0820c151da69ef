"""GRPO-Guard: the clipped GRPO objective with a re-centred, step-normalised ratio and a
per-step gradient weight (arXiv 2510.22319, sections 4.1-4.2; Flow-GRPO reference's GRPO-Guard
training script).

Why: with ``x' = mean_old + std * eps``, the Gaussian log-ratio of one SDE step is
``-(|mean - mean_old|^2 + 2 std eps . (mean - mean_old)) / (2 std^2)`` (per element, averaged).
Its expectation is negative (the ratio's mean sits below 1, so the clip's lower edge is hit
far more often than the upper one) and its scale grows as ``1 / std``, very different from step
to step. GRPO-Guard's two fixes, each switchable:

- ratio normalisation: add back the mean shift ``b = mean(|mean - mean_old|^2) / (2 std^2)`` and
  multiply the log-ratio by ``std`` (the transition's standard deviation, ``std_dev_t *
  sqrt(-dt)`` for the ``sde`` type): ``rho = exp((log_prob - old_log_prob + b) * std)``.
- gradient re-weighting: each step's clipped term is divided by ``|dt| = sigma - sigma_next``
  (``sqrt(-dt)^2``), so the steps' gradients are of one size.

``loss = mean_{i,s} w_s * max(-A_i rho_is, -A_i clip(rho_is, 1 - eps, 1 + eps_high))`` with
``w_s = 1 / |dt_s|`` (or 1). ``mean_shift_sq`` carries the gradient through ``mean`` (the
reference does not detach it). Plain torch, for the reason ``grpo_loss`` gives;
``guard_clip_loss_reference`` is the float64 oracle written element by element.
"""
from __future__ import annotations

import math

import torch


def mean_shift_sq(mean: torch.Tensor, old_mean: torch.Tensor) -> torch.Tensor:
    """``mean(|mean - old_mean|^2)`` over every element of a sample: ``[B]`` (grad via ``mean``)."""
    diff = mean.float() - old_mean.detach().float() if mean.dtype != torch.float64 \
        else mean - old_mean.detach().double()
    return (diff ** 2).mean(dim=tuple(range(1, mean.dim())))


def _problems(log_prob, old_log_prob, advantages, shift_sq, std, dt, eps, eps_high) -> list[str]:
    problems = []
    for name, value in (("eps", eps), ("eps_high", eps if eps_high is None else eps_high)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            problems.append(f"{name} must be a finite float > 0, got {value!r}")
    named = (("log_prob", log_prob), ("old_log_prob", old_log_prob), ("mean_shift_sq", shift_sq),
             ("std", std), ("dt", dt))
    bad = [n for n, x in named + (("advantages", advantages),)
           if not isinstance(x, torch.Tensor) or not x.is_floating_point()]
    if bad:
        return problems + [f"{', '.join(bad)} must be floating tensors"]
    if log_prob.dim() != 2 or log_prob.numel() == 0:
        problems.append(f"log_prob must be a non-empty [B, S] matrix, got {tuple(log_prob.shape)}")
    for name, x in named[1:]:
        if x.shape != log_prob.shape:
            problems.append(f"{name} has shape {tuple(x.shape)}, expected {tuple(log_prob.shape)}")
    if advantages.shape not in (log_prob.shape[:1], log_prob.shape):
        problems.append(f"advantages must be [B] or [B, S], got {tuple(advantages.shape)}")
    if not problems and (bool((std <= 0).any()) or bool((dt <= 0).any())):
        problems.append("std and dt (= sigma - sigma_next) must be > 0 at every trained step "
                        "(GRPO-Guard needs a stochastic step)")
    return problems


def guard_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                    shift_sq: torch.Tensor, std: torch.Tensor, dt: torch.Tensor, *, eps: float,
                    eps_high: float | None = None, ratio_norm: bool = True,
                    reweight: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard's loss over ``[B, S]`` (module docstring) and its statistics.

    ``shift_sq``: ``mean_shift_sq(mean, old_mean)`` per (sample, step); ``std``: the transition's
    standard deviation; ``dt``: ``sigma - sigma_next`` (> 0). Statistics as ``grpo_clip_loss``
    (``ratio_*``, ``clip_fraction``) of the normalised ratio, plus ``ratio_mean_bias`` (mean b).
    """
    problems = _problems(log_prob, old_log_prob, advantages, shift_sq, std, dt, eps, eps_high)
    if problems:
        raise ValueError("guard_clip_loss: invalid input:\n  - " + "\n  - ".join(problems))
    eps_high = eps if eps_high is None else eps_high
    dtype = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    s = std.detach().to(dtype)
    log_ratio = log_prob.to(dtype) - old_log_prob.detach().to(dtype)
    bias = shift_sq.to(dtype) / (2.0 * s * s)
    if ratio_norm:
        log_ratio = (log_ratio + bias) * s
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    term = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps_high))
    if reweight:
        term = term / dt.detach().to(dtype)
    loss = term.mean()
    with torch.no_grad():
        r = ratio.detach()
        stats = {"ratio_mean": r.mean(), "ratio_std": r.std(correction=0), "ratio_min": r.min(),
                 "ratio_max": r.max(),
                 "clip_fraction": ((r < 1.0 - eps) | (r > 1.0 + eps_high)).to(dtype).mean(),
                 "ratio_mean_bias": bias.detach().mean()}
    return loss, stats


def guard_clip_loss_reference(log_prob, old_log_prob, advantages, shift_sq, std, dt, *,
                              eps: float, eps_high: float | None = None, ratio_norm: bool = True,
                              reweight: bool = True) -> torch.Tensor:
    """The float64 oracle of ``guard_clip_loss``: element by element, the formulas as written."""
    eps_high = eps if eps_high is None else eps_high
    b, steps = log_prob.shape
    total = torch.zeros((), dtype=torch.float64)
    for i in range(b):
        for j in range(steps):
            a = float(advantages[i] if advantages.dim() == 1 else advantages[i, j])
            sd = float(std[i, j])
            lr = log_prob[i, j].double() - float(old_log_prob[i, j])
            if ratio_norm:
                lr = (lr + shift_sq[i, j].double() / (2.0 * sd * sd)) * sd
            rho = torch.exp(lr)
            clipped = torch.clamp(rho, 1.0 - eps, 1.0 + eps_high)
            term = torch.maximum(-a * rho, -a * clipped)
            total = total + (term / float(dt[i, j]) if reweight else term)
    return total / (b * steps)
