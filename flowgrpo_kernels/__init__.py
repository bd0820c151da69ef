"""FlowGRPO math, once: the SDE transition, its Gaussian log-prob, the clipped GRPO loss and
group advantage normalisation. A torch reference (float64-capable) and fused Triton kernels.

Imports torch only; Triton is imported when a Triton kernel is first needed.
"""
from .advantages import normalize_grouped
from .grpo_loss import grpo_clip_loss
from .sde import (SDEStepOutput, check_schedule, resolve_backend, sde_kl, sde_log_prob,
                  sde_step)

__all__ = ["SDEStepOutput", "check_schedule", "grpo_clip_loss", "normalize_grouped",
           "resolve_backend", "sde_kl", "sde_log_prob", "sde_step"]
