"""GRPO-Guard in the actor (``train.grpo_guard``): the old policy's transition mean beside its
log-prob, and the loss of one micro-batch (``flowgrpo_kernels.guard``).

The ratio normalisation needs ``mean_old``, the old policy's transition mean at the replayed
rows. Under ``train.anchor = "replay"`` (preflight requires it) the first update's micro-batches
are their own anchor (the detached current mean), and the later updates' no-grad anchor replay
keeps the mean with the log-prob (``GuardAnchor``): one latent-sized tensor per replayed row,
held until that micro-batch trains. The transition mean and std come from the torch reference
of the SDE step, the same formulas the kernels evaluate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import flowgrpo_kernels as kernels
from flowgrpo_kernels.guard import guard_clip_loss, mean_shift_sq
from flowgrpo_kernels.sde_reference import sde_transition_ref
from trainer.actor.replay import ReplayRows, replay_rows, rows_velocity


@dataclass
class GuardAnchor:
    log_prob: torch.Tensor  # [b, S]
    mean: torch.Tensor      # [b * S, *latent], the old policy's transition mean per row


def transition(rows: ReplayRows, v: torch.Tensor, mb) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [b*S, *latent], std [b*S]) of the replayed rows' transitions."""
    options = {k: w for k, w in mb.kernel_options().items() if k != "log_prob_form"}
    return sde_transition_ref(rows.x, v, rows.sigma, rows.sigma_next, **options)


@torch.no_grad()
def guard_anchor(actor, mb) -> GuardAnchor:
    """pi_old of a later update's micro-batch: its log-prob and transition mean."""
    rows = replay_rows(mb, next(actor.model.parameters()).device)
    v = rows_velocity(actor.adapter, actor.model, rows, mb, actor.meter)
    logp = kernels.sde_log_prob(rows.x, v, rows.x_next, rows.sigma, rows.sigma_next,
                                **mb.kernel_options(), validate=False)
    return GuardAnchor(logp.reshape(rows.samples, rows.steps).float(),
                       transition(rows, v, mb)[0].detach())


def guard_loss(mb, rows: ReplayRows, v: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor,
               anchor: GuardAnchor | None, train) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard's loss of a micro-batch; ``anchor`` None: this forward is its own anchor."""
    mean, std = transition(rows, v, mb)
    old_mean = mean.detach() if anchor is None else anchor.mean.to(mean.device)
    old_logp = logp.detach() if anchor is None else anchor.log_prob.to(logp.device)
    shape = (rows.samples, rows.steps)
    return guard_clip_loss(logp, old_logp, adv.to(logp.device),
                           mean_shift_sq(mean, old_mean).reshape(shape), std.reshape(shape),
                           (rows.sigma - rows.sigma_next).reshape(shape),
                           eps=train.eps_clip, eps_high=train.eps_clip_high)
