"""DiffusionNFT's loss: negative-aware fine-tuning on the forward (noising) process.

No trajectory and no log-prob: a finished sample ``x0`` is noised again to ``x_t = (1 - t) x0 +
t eps`` at a training time ``t``, the current policy's velocity ``v`` and the old policy's
``v_old`` are evaluated there, and two implicit policies are built from them (NVlabs/DiffusionNFT,
``scripts/train_nft_sd3.py``; arXiv 2509.16117, section 3):

- positive: ``v_pos = beta * v + (1 - beta) * v_old``
- negative: ``v_neg = (1 + beta) * v_old - beta * v``

Each is scored by a flow-matching loss in x0-space, ``|x_t - t * v_* - x0|^2`` averaged over the
sample's elements and divided by its own detached mean absolute error (the reference's
"adaptive weighting", floored at 1e-5). The reward weight of a sample is its advantage clipped
to ``[-C, C]`` and mapped to ``r = clip(A / C / 2 + 1/2, 0, 1)``; the loss is
``C * mean_i (r_i * L_pos_i + (1 - r_i) * L_neg_i) / beta``. A sample with a high reward pulls
the policy toward its own image, a low one pushes it away (through the negative policy).

Plain torch: the loss is a few elementwise ops over the latents next to a transformer forward and
backward; the fused kernel the issue mentions waits for a profile that says it pays.
``nft_loss_reference`` is the float64 oracle written sample by sample.
"""
from __future__ import annotations

import math

import torch

WEIGHT_FLOOR = 1e-5  # the reference's clip(min=0.00001) of the adaptive weight


def reward_weight(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """``r = clip(clip(A, -C, C) / C / 2 + 0.5, 0, 1)``: 1 for the best, 0 for the worst."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def old_policy_decay(step: int, *, delay: int, ramp: float, cap: float) -> float:
    """Weight of the old policy when it is pulled toward the current one after an update:
    ``old <- d * old + (1 - d) * current`` with ``d = 0`` before ``delay`` steps, then
    ``min((step - delay) * ramp, cap)`` (the reference's ``return_decay``; its decay_type 1 is
    delay 0, ramp 0.001, cap 0.5; decay_type 2 is 75, 0.0075, 0.999)."""
    if step < delay:
        return 0.0
    return min((step - delay) * ramp, cap)


def _problems(v, v_old, x_t, x0, t, advantages, beta, adv_clip_max) -> list[str]:
    problems = []
    for name, value in (("beta", beta), ("adv_clip_max", adv_clip_max)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            problems.append(f"{name} must be a finite float > 0, got {value!r}")
    named = (("v", v), ("v_old", v_old), ("x_t", x_t), ("x0", x0), ("t", t),
             ("advantages", advantages))
    bad = [n for n, x in named if not isinstance(x, torch.Tensor) or not x.is_floating_point()]
    if bad:
        return problems + [f"{', '.join(bad)} must be floating tensors"]
    if v.dim() < 2:
        problems.append(f"v must be [B, ...] with at least one element dimension, got {tuple(v.shape)}")
    for name, x in named[1:4]:
        if x.shape != v.shape:
            problems.append(f"{name} has shape {tuple(x.shape)}, expected {tuple(v.shape)}")
    for name, x in named[4:]:
        if x.shape != v.shape[:1]:
            problems.append(f"{name} must have shape [B]={tuple(v.shape[:1])}, got {tuple(x.shape)}")
    if len({x.device for _, x in named}) > 1:
        problems.append("all tensors must share a device")
    return problems


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor,
             t: torch.Tensor, advantages: torch.Tensor, *, beta: float, adv_clip_max: float
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT policy loss over a batch (module docstring), and its statistics.

    ``v`` carries the gradient; ``v_old``, ``x_t``, ``x0``, ``t`` ([B], in (0, 1]) and
    ``advantages`` ([B]) are constants (detached here). Computed in fp32 (float64 for float64
    ``v``). Statistics, 0-dim and detached: ``positive_loss``, ``negative_loss``,
    ``reward_weight`` (mean r), ``old_deviation`` (mean (v - v_old)^2).
    """
    problems = _problems(v, v_old, x_t, x0, t, advantages, beta, adv_clip_max)
    if problems:
        raise ValueError("nft_loss: invalid input:\n  - " + "\n  - ".join(problems))
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    dims = tuple(range(1, v.dim()))
    vf = v.to(dtype)
    old = v_old.detach().to(dtype)
    xt, target = x_t.detach().to(dtype), x0.detach().to(dtype)
    tcol = t.detach().to(dtype).reshape(-1, *([1] * (v.dim() - 1)))
    r = reward_weight(advantages.detach().to(dtype), adv_clip_max)

    def weighted_error(velocity: torch.Tensor) -> torch.Tensor:
        err = xt - tcol * velocity - target
        with torch.no_grad():
            weight = err.abs().mean(dim=dims, keepdim=True).clamp_min(WEIGHT_FLOOR)
        return (err ** 2 / weight).mean(dim=dims)

    positive = weighted_error(beta * vf + (1.0 - beta) * old)
    negative = weighted_error((1.0 + beta) * old - beta * vf)
    per_sample = (r * positive + (1.0 - r) * negative) / beta
    loss = per_sample.mean() * adv_clip_max
    with torch.no_grad():
        stats = {"positive_loss": positive.mean(), "negative_loss": negative.mean(),
                 "reward_weight": r.mean(), "old_deviation": ((vf - old) ** 2).mean()}
    return loss, stats


def nft_loss_reference(v, v_old, x_t, x0, t, advantages, *, beta: float,
                       adv_clip_max: float) -> torch.Tensor:
    """The float64 oracle of ``nft_loss``: one sample at a time, the formulas as written."""
    v = v.double()
    total = torch.zeros((), dtype=torch.float64, device=v.device)
    for i in range(v.shape[0]):
        a = min(max(float(advantages[i]), -adv_clip_max), adv_clip_max)
        r = min(max(a / adv_clip_max / 2.0 + 0.5, 0.0), 1.0)
        vi, oi = v[i], v_old[i].double().detach()
        xi, x0i, ti = x_t[i].double(), x0[i].double(), float(t[i])
        x0_pos = xi - ti * (beta * vi + (1.0 - beta) * oi)
        x0_neg = xi - ti * ((1.0 + beta) * oi - beta * vi)
        w_pos = max(float((x0_pos - x0i).detach().abs().mean()), WEIGHT_FLOOR)
        w_neg = max(float((x0_neg - x0i).detach().abs().mean()), WEIGHT_FLOOR)
        l_pos = ((x0_pos - x0i) ** 2).mean() / w_pos
        l_neg = ((x0_neg - x0i) ** 2).mean() / w_neg
        total = total + (r * l_pos + (1.0 - r) * l_neg) / beta
    return total / v.shape[0] * adv_clip_max
