"""FlowGRPO math, once: the SDE transition, its Gaussian log-prob, the clipped GRPO loss and
group advantage normalisation. A torch reference (float64-capable) and fused Triton kernels,
and the torch-free table of SDE types (``sde_types``) that every rule about a type asks.

The names below load their module on first use (PEP 562), so that importing
``flowgrpo_kernels.sde_types`` (preflight, before anything heavy) does not import torch.
Triton is imported when a Triton kernel is first needed.
"""
from __future__ import annotations

import importlib

_HOMES = {
    "normalize_grouped": "advantages",
    "grpo_clip_loss": "grpo_loss",
    "SDEStepOutput": "sde", "check_schedule": "sde", "resolve_backend": "sde", "sde_kl": "sde",
    "sde_log_prob": "sde", "sde_step": "sde",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value
