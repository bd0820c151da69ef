"""Clipped GRPO objective over a [B, S] (sample, SDE step) matrix of log-probs.

Plain torch by design: the matrix is a few hundred elements (batch x trained SDE steps) and the
call happens once per micro-batch next to a transformer forward+backward that takes orders of
magnitude longer, so a fused kernel could save only a few launches; autograd through these ops is
also the readable reference. Everything is computed in fp32 (float64 if the inputs are float64).
"""
from __future__ import annotations

import math

import torch


def _problems(log_prob, old_log_prob, advantages, eps, eps_high) -> list[str]:
    problems = []
    for name, value, upper in (("eps", eps, 1.0), ("eps_high", eps_high, None)):
        if value is None and name == "eps_high":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(f"{name} must be a finite python float, got {value!r}")
        elif value <= 0 or (upper is not None and value >= upper):
            bound = f"in (0, {upper:g})" if upper else "> 0"
            problems.append(f"{name} must be {bound}, got {value}")
    tensors_ok = True
    for name, t in (("log_prob", log_prob), ("old_log_prob", old_log_prob), ("advantages", advantages)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            tensors_ok = False
            problems.append(f"{name} must be a floating tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not tensors_ok:
        return problems
    if log_prob.dim() != 2 or log_prob.numel() == 0:
        problems.append(f"log_prob must be a non-empty [B, S] matrix, got shape {tuple(log_prob.shape)}")
    if old_log_prob.shape != log_prob.shape:
        problems.append(f"old_log_prob has shape {tuple(old_log_prob.shape)}, "
                        f"expected {tuple(log_prob.shape)}")
    if log_prob.dim() == 2 and advantages.shape not in (log_prob.shape[:1], log_prob.shape):
        problems.append(f"advantages must have shape [B]={tuple(log_prob.shape[:1])} or "
                        f"[B, S]={tuple(log_prob.shape)}, got {tuple(advantages.shape)}")
    devices = {t.device for t in (log_prob, old_log_prob, advantages)}
    if len(devices) > 1:
        problems.append("log_prob, old_log_prob and advantages must share a device, got "
                        f"{sorted(map(str, devices))}")
    return problems


def grpo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, *,
                   eps: float, eps_high: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped GRPO loss, mean over samples and steps, and its health statistics.

    ``loss = mean(max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high)))`` with
    ``r = exp(log_prob - old_log_prob)``; ``eps_high`` defaults to ``eps``. ``old_log_prob`` and
    ``advantages`` are constants (detached); ``advantages`` of shape ``[B]`` apply to every step.

    Statistics (0-dim fp32 tensors, detached; no host sync here, the caller decides when to read):
    ``ratio_mean``, ``ratio_std`` (population std, defined for a single element),
    ``ratio_min``, ``ratio_max``, ``clip_fraction`` (share of elements with ``r`` outside
    ``[1 - eps, 1 + eps_high]``, i.e. where the clipped surrogate is in play, Flow-GRPO's
    ``clipfrac``) and ``approx_kl = 0.5 * mean((log_prob - old_log_prob)^2)`` (Flow-GRPO's k2
    estimator).
    """
    problems = _problems(log_prob, old_log_prob, advantages, eps, eps_high)
    if problems:
        raise ValueError("grpo_clip_loss: invalid input:\n  - " + "\n  - ".join(problems))
    eps_high = eps if eps_high is None else eps_high
    dtype = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    log_ratio = log_prob.to(dtype) - old_log_prob.detach().to(dtype)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        adv = adv[:, None]
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "ratio_mean": r.mean(),
            "ratio_std": r.std(correction=0),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
            "clip_fraction": ((r < 1.0 - eps) | (r > 1.0 + eps_high)).to(dtype).mean(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        }
    return loss, stats
