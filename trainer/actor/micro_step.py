"""One micro-batch of the policy update: the replay forward of its rows, the clipped loss
(plus the KL term), its backward. ``trainer.actor.update`` runs it over a rollout batch;
``trainer.actor.micro_batch`` runs it once on one sample to measure its memory."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import flowgrpo_kernels as kernels
from trainer.actor.replay import replay_kl, replay_rows, rows_velocity
from trainer.algorithms.guard_step import guard_loss
from trainer.profiling import nvtx_range
from trainer.rewards.advantages import kl_term

if TYPE_CHECKING:
    from trainer.actor.actor import Actor


def forward_backward(actor: Actor, mb, adv: torch.Tensor, scale: float,
                     anchor: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One micro-batch: a forward of all its (sample, step) rows, the loss, its backward.

    ``anchor`` is pi_old for these rows; None means "this forward is itself the anchor" (an
    update-0 micro-batch: no optimizer step has happened yet)."""
    t = actor.train_cfg
    model, adapter = actor.model, actor.adapter
    rows = replay_rows(mb, next(model.parameters()).device)
    with nvtx_range("train/replay"):
        v = rows_velocity(adapter, model, rows, mb, actor.meter)
        logp = kernels.sde_log_prob(rows.x, v, rows.x_next, rows.sigma, rows.sigma_next,
                                    **mb.kernel_options(),
                                    validate=False).reshape(rows.samples, rows.steps)
    if t.grpo_guard:  # anchor: a GuardAnchor (trainer.algorithms.guard_step)
        loss, stats = guard_loss(mb, rows, v, logp, adv, anchor, t)
    else:
        old = logp.detach() if anchor is None else anchor.to(logp.device)
        loss, stats = kernels.grpo_clip_loss(logp, old, adv.to(logp.device), eps=t.eps_clip,
                                             eps_high=t.eps_clip_high)
    if t.kl_coef > 0:
        kl = replay_kl(adapter, model, mb, rows, v=v, meter=actor.meter, kl_form=t.kl_form)
        loss = loss + t.kl_coef * kl_term(kl, adv, drop_zero_advantage=t.drop_zero_advantage)
        stats["kl"] = kl.mean().detach()
    with nvtx_range("train/backward"), \
            actor.meter.region("transformer_backward", actor.device):
        (loss * scale).backward()
    stats["loss"] = loss.detach()
    if anchor is None:  # replay vs the engine's own sampling log-prob, same weights
        stats["logp_parity"] = (logp.detach() - mb.log_probs.to(logp.device)).abs().max()
    return stats
