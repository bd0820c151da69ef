"""Classifier-free guidance for sampling and replay: one batched forward of both halves.

With ``guidance_scale`` g > 1 the velocity is ``v = v_u + g * (v_c - v_u)``, ``v_c`` the
conditional and ``v_u`` the empty-prompt (negative) prediction, combined before ``sde_step``
in the engine and before ``sde_log_prob`` in the replay. Both halves go through the
transformer in one forward of ``2B`` rows, negative half first (the Flow-GRPO reference's
order, so a batch-dependent kernel sees the same layout in both places).

Gradient (as in the reference): the unconditional half is detached, so the gradient reaches
the weights through the conditional branch only, ``dv/dv_c = g``. With ``grad`` disabled
(sampling, pi_old) the detach changes nothing.

The negative conditions travel with the positive ones in one dict (the rollout's
``denoising_env`` and ``RolloutBatch.conditions``), under the key prefix ``NEGATIVE_PREFIX``,
so they are selected, concatenated and moved with the batch like any other condition.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.models.batch import pad_and_cat

NEGATIVE_PREFIX = "neg:"


def with_negative(conditions: dict[str, torch.Tensor], negative: dict[str, torch.Tensor],
                  guidance_scale: float) -> dict[str, torch.Tensor]:
    """``conditions`` plus the negative halves under ``NEGATIVE_PREFIX`` (none at g == 1)."""
    if float(guidance_scale) == 1.0:
        return dict(conditions)
    missing = sorted(set(conditions) - set(negative))
    if missing:
        raise ValueError(f"negative conditions lack {missing}")
    return {**conditions, **{NEGATIVE_PREFIX + k: negative[k] for k in conditions}}


def split_conditions(conditions: dict[str, torch.Tensor]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(positive, negative)``; negative is empty when the dict holds no negative halves."""
    positive = {k: v for k, v in conditions.items() if not k.startswith(NEGATIVE_PREFIX)}
    negative = {k[len(NEGATIVE_PREFIX):]: v for k, v in conditions.items()
                if k.startswith(NEGATIVE_PREFIX)}
    return positive, negative


def _stack_halves(negative: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """``[neg; pos]`` along the batch, the shorter sequence zero-padded (masks: 0 = masked)."""
    return pad_and_cat([negative, positive])


def guided_velocity(adapter: Any, model: nn.Module, x: torch.Tensor, sigma: torch.Tensor,
                    conditions: dict[str, torch.Tensor], geometry: Any,
                    guidance_scale: float) -> torch.Tensor:
    """The velocity the SDE step takes: plain at g == 1, else CFG from one 2B-row forward."""
    positive, negative = split_conditions(conditions)
    if float(guidance_scale) == 1.0:
        return adapter.velocity(model, x, sigma, positive, geometry)
    missing = sorted(set(positive) - set(negative))
    if missing:
        raise ValueError(f"guidance_scale={guidance_scale} needs the negative conditions "
                         f"{[NEGATIVE_PREFIX + k for k in missing]}")
    batch = x.shape[0]
    sigma = torch.as_tensor(sigma, device=x.device).reshape(-1).expand(batch)
    both = {k: _stack_halves(negative[k], positive[k]) for k in positive}
    v = adapter.velocity(model, torch.cat([x, x]), torch.cat([sigma, sigma]), both, geometry)
    v_uncond, v_cond = v[:batch].detach(), v[batch:]
    return v_uncond + guidance_scale * (v_cond - v_uncond)
