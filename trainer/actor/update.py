"""The policy update of one rollout batch: replay, clipped loss, N disjoint optimizer updates.

pi_old (the anchor of the ratio) is frozen before the first optimizer step:
- the first update's micro-batches use their own training forward, detached (the same
  parameters, so their ratio is exactly 1 by construction and no separate forward is run);
- the samples of later updates get a no-grad replay before the first optimizer step
  (``train.anchor = "replay"``), or the engine's recorded log-probs (``"engine"``, no extra
  forward; the ratio then starts within ``train/logp_parity`` of 1).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer.actor.local_adam import local_tensors, scale_gradients, step_adam_on_local_shards
from trainer.actor.micro_batch import resolve_micro_batch
from trainer.actor.micro_step import forward_backward
from trainer.actor.model import (accumulate_unsharded, ensure_train_mode, lr_at_step,
                                 reduce_each_backward)
from trainer.actor.replay import plan_updates, replay_log_probs
from trainer.algorithms.guard_step import guard_anchor
from trainer.utils.collectives import any_rank, require_same_on_all_ranks
from trainer.profiling import nvtx_range
from trainer.rewards.advantages import micro_batch_scale

if TYPE_CHECKING:
    from trainer.actor.actor import Actor


def select_micro_batches(actor: Actor, batch, advantages: torch.Tensor, plan) -> list[list[tuple]]:
    """Every planned micro-batch as (rows of ``batch``, their advantages), on the model's device,
    gathered before the stage queues any GPU work. Indexing device tensors with host row
    indices copies the indices with a stream synchronisation (so does moving host advantages):
    between micro-batches each such copy would make the host wait for the GPU to drain, and the
    host could never queue work ahead of it. Here the GPU is idle anyway."""
    device = next(actor.model.parameters()).device
    adv = advantages.to(device)
    # the sigmas come back from the response check on the host; the images (the reward's)
    # are not replayed, so no micro-batch copies them
    batch = dataclasses.replace(batch, sigmas=batch.sigmas.to(device),
                                sigmas_next=batch.sigmas_next.to(device), images=None)
    return [[(batch.select(rows), adv[rows.to(device)]) for rows in micro_batches]
            for micro_batches in plan.updates]


def anchors(actor: Actor, micro: list[list[tuple]]) -> list[list[torch.Tensor | None]]:
    """pi_old of every micro-batch's rows (``micro`` as ``select_micro_batches`` lays it out),
    frozen before the first optimizer step (module docstring). Under ``"replay"`` update 0's
    entries are None: their forward is their own anchor."""
    if actor.train_cfg.anchor == "engine":
        return [[mb.log_probs for mb, _ in micro_batches] for micro_batches in micro]
    out: list[list[torch.Tensor | None]] = [[None] * len(micro[0])]
    with torch.no_grad(), nvtx_range("train/anchor"):
        for micro_batches in micro[1:]:
            out.append([guard_anchor(actor, mb) if actor.train_cfg.grpo_guard else
                        replay_log_probs(actor.adapter, actor.model, mb,
                                         meter=actor.meter).float()
                        for mb, _ in micro_batches])
    # The gathered parameters stay for the first update's training forward (same parameters,
    # so FSDP2 skips its gather); that update's backward reshards them before any optimizer step.
    return out


def grad_norm_and_clip_coef(params: list[torch.Tensor],
                            max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(total norm, clip coefficient min(1, max_norm / norm)) of the gradients, as
    ``clip_grad_norm_`` computes them, on the local shards: one fused norm over plain tensors
    and one all-reduce per sharded mesh dimension. Dispatching every small LoRA gradient
    through DTensor (``to_local()`` too: an autograd Function call per gradient) costs more
    host time than the GPU work it launches."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(()), torch.ones(())
    local = local_tensors(grads)
    norms = torch._foreach_norm(local, 2.0)
    total_sq = torch.stack([n.float() for n in norms]).square().sum()
    if isinstance(grads[0], DTensor):
        mesh, placements = grads[0].device_mesh, grads[0].placements
        for dim, placement in enumerate(placements):
            if placement.is_shard() and mesh.size(dim) > 1:  # replicas hold equal values
                dist.all_reduce(total_sq, group=mesh.get_group(dim))
    total = total_sq.sqrt()
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0).to(local[0].device)


def optimizer_step(actor: Actor, params: list[torch.Tensor]) -> tuple[torch.Tensor, float | None]:
    """Clip, then step unless the norm is not finite; the host reads the norm first. Returns
    (grad norm, the step's lr or None when skipped)."""
    t = actor.train_cfg
    with nvtx_range("train/optimizer"), actor.outside.region("optimizer", actor.device):
        gn, coef = grad_norm_and_clip_coef(params, t.clip_grad)
        # NOTE: host sync per update: a non-finite norm must skip the step on all ranks alike
        # (the norm is already all-reduced by FSDP, so they agree).
        lr = None
        if bool(torch.isfinite(gn)):
            lr = lr_at_step(actor.lr_steps, t)
            for group in actor.optimizer.param_groups:
                group["lr"] = lr
            step_optimizer(actor, params, coef)
            actor.lr_steps += 1
            if actor.ema is not None and not actor.ema.per_micro_batch:
                actor.ema.step(actor.lr_steps - 1)
        actor.optimizer.zero_grad(set_to_none=True)
    return gn, lr


def step_optimizer(actor: Actor, params: list[torch.Tensor], clip_coef: torch.Tensor) -> None:
    """One optimizer step with the gradient clip's coefficient, on the local shards unless
    ``train.adam_on_local_shards`` is off. There, under ``train.fold_clip``, the step applies
    the coefficient itself (``step_adam_on_local_shards``: in fused AdamW's kernel); otherwise
    the gradients are scaled first."""
    t = actor.train_cfg
    if t.adam_on_local_shards and t.fold_clip:
        step_adam_on_local_shards(actor.optimizer, clip_coef)
        return
    scale_gradients(params, clip_coef)
    if t.adam_on_local_shards:
        step_adam_on_local_shards(actor.optimizer)
    else:
        actor.optimizer.step()


class HostSkips:
    """Optimizer steps of one rollout batch through ``optimizer_step`` (the host reads each
    norm); the same interface as ``DeviceSkips``."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor
        self.lr = lr_at_step(actor.lr_steps, actor.train_cfg)

    def step(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        gn, stepped_lr = optimizer_step(self.actor, params)
        self.lr = self.lr if stepped_lr is None else stepped_lr
        return gn, torch.tensor(float(stepped_lr is None))

    def finish(self, skipped: int) -> float:
        """The last taken step's lr (the schedule already moved step by step)."""
        return self.lr


def skips_on_device(actor: Actor) -> bool:
    """train.skip_on_device where it applies: fused AdamW takes the skip as a device flag
    (found_inf); the EMA steps on the host's knowledge of each step, so it keeps the host check."""
    return (actor.train_cfg.skip_on_device and actor.ema is None
            and bool(actor.optimizer.defaults.get("fused")))


class DeviceSkips:
    """Optimizer steps of one rollout batch that skip a non-finite norm without a host sync.

    Every step runs fused AdamW with ``found_inf`` = "the norm is not finite" (the kernel then
    leaves parameters and state untouched and undoes its step count) and a learning rate
    taken from a device table of the schedule's next values, indexed by the steps taken so
    far, so a skip shifts the schedule exactly as the host path does. The table is float32
    (the fused CUDA kernel reads a float32 lr; the host path passes a double): an lr not
    representable in float32 moves by its rounding, 6e-8 relative. ``finish`` advances
    ``actor.lr_steps`` by the steps taken, read after the batch."""

    def __init__(self, actor: Actor, updates: int, device: torch.device) -> None:
        self.actor = actor
        first = actor.lr_steps
        self.table = torch.tensor([lr_at_step(first + k, actor.train_cfg) for k in range(updates)],
                                  dtype=torch.float32, device=device)
        self.first = first
        self.taken = torch.zeros((), dtype=torch.long, device=device)

    def step(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and step; returns (grad norm, 1.0 if the step was skipped else 0.0)."""
        actor = self.actor
        optimizer = actor.optimizer
        with nvtx_range("train/optimizer"), actor.outside.region("optimizer", actor.device):
            gn, coef = grad_norm_and_clip_coef(params, actor.train_cfg.clip_grad)
            finite = torch.isfinite(gn).to(self.taken.device)
            lr = self.table.index_select(0, self.taken.view(1)).view(())  # no host read
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.found_inf = (~finite).float()
            step_optimizer(actor, params, coef)
            optimizer.zero_grad(set_to_none=True)
            self.taken += finite.long()
        return gn, (~finite).float()

    def finish(self, skipped: int) -> float:
        """Advance the schedule by the steps taken; returns the last taken step's lr (the
        host path's ``train/lr``)."""
        actor, t = self.actor, self.actor.train_cfg
        optimizer = actor.optimizer
        optimizer.__dict__.pop("found_inf", None)  # no stale flag for a later step
        taken = len(self.table) - skipped
        actor.lr_steps = self.first + taken
        for group in optimizer.param_groups:  # a float again, as checkpoints store it
            group["lr"] = lr_at_step(actor.lr_steps, t)
        return lr_at_step(self.first + taken - 1 if taken else self.first, t)


def ema_after_micro_batch(actor: Actor) -> None:
    """``ema.per_micro_batch`` (the reference's placement): the EMA steps after every micro-batch
    with the count of optimizer steps taken so far (after the optimizer step, for an update's
    last micro-batch), so it moves once per micro-batch on every ``update_interval``-th step."""
    if actor.ema is not None and actor.ema.per_micro_batch:
        actor.ema.step(actor.lr_steps)


def run_updates(actor: Actor, selected, scales, pi_old, steps, params):
    """Each update's micro-batches (forward, loss, backward), then its optimizer step; returns
    the micro-batches' stats by name, and each step's grad norm and skip flag (device tensors:
    nothing here waits for the GPU). Under ``fsdp.accumulate_unsharded`` (on by default at
    world 1) only an update's last backward reduces the gradients and reshards the parameters."""
    sums: dict[str, list[torch.Tensor]] = {}
    grad_norms, skip_flags = [], []
    accumulate = accumulate_unsharded(actor.fsdp_cfg)
    reducing = True  # FSDP2's default; an update of one micro-batch never changes it
    try:
        for u, micro_batches in enumerate(selected):
            last = len(micro_batches) - 1
            for m, (mb, adv) in enumerate(micro_batches):
                if accumulate and last and m in (0, last):  # switch only where it changes
                    reducing = m == last
                    reduce_each_backward(actor.model, reducing)
                stats = forward_backward(actor, mb, adv, scales[u][m], pi_old[u][m])
                if m < last:
                    ema_after_micro_batch(actor)
                if u == 0:
                    sums.setdefault("first_update_ratio_mean", []).append(stats["ratio_mean"])
                for k, v in stats.items():
                    sums.setdefault(k, []).append(v.detach().float())
            gn, skipped = steps.step(params)
            ema_after_micro_batch(actor)
            grad_norms.append(gn)
            skip_flags.append(skipped.to(gn.device))
    finally:  # FSDP2's defaults again, for whatever runs the model next
        if not reducing:
            reduce_each_backward(actor.model, True)
    return sums, grad_norms, skip_flags


def train_on(actor: Actor, batch, advantages: torch.Tensor, rollout_id: int) -> dict[str, float]:
    """Replay and update: the local slice split into --num-updates-per-batch disjoint
    optimizer updates of micro-batches (``train.micro_batch_size``, or ``auto``)."""
    t = actor.train_cfg
    per_update = len(batch) // max(1, t.num_updates_per_batch)
    micro = resolve_micro_batch(actor, batch, advantages, per_update)
    gen = torch.Generator().manual_seed(t.seed * 1_000_003 + rollout_id)
    plan = plan_updates(len(batch), t.num_updates_per_batch, micro, generator=gen)
    require_same_on_all_ranks(plan.num_micro_batches, "micro-batches")
    base = {"train/num_microbatches": float(plan.num_micro_batches),
            "train/micro_batch_size": float(micro)}
    if not any_rank(bool(advantages.abs().max() > 0)):
        # No rank has any advantage signal: every update would be a zero-gradient step.
        return {**base, "train/optimizer_steps": 0.0,
                "train/optimizer_skips": float(len(plan.updates))}
    ensure_train_mode(actor.model)
    # everything that copies between host and device, before any GPU work is queued
    # (select_micro_batches says why)
    selected = select_micro_batches(actor, batch, advantages, plan)
    scales = [[micro_batch_scale(advantages, rows, micro_batches,
                                 drop_zero_advantage=t.drop_zero_advantage)
               for rows in micro_batches] for micro_batches in plan.updates]
    # the tensors the optimizer steps (FSDP2's sharded parameters), whatever the module holds
    params = [p for group in actor.optimizer.param_groups for p in group["params"]]
    steps = (DeviceSkips(actor, len(plan.updates), params[0].device)
             if skips_on_device(actor) else HostSkips(actor))
    pi_old = anchors(actor, selected)
    sums, grad_norms, skip_flags = run_updates(actor, selected, scales, pi_old, steps, params)
    out = {f"train/{k}": torch.stack(v).mean() for k, v in sums.items()}
    out["train/optimizer_skips"] = torch.stack(skip_flags).sum()
    out["train/ratio_max"] = torch.stack(sums["ratio_max"]).max()
    out["train/ratio_min"] = torch.stack(sums["ratio_min"]).min()
    if "logp_parity" in sums:
        out["train/logp_parity"] = torch.stack(sums["logp_parity"]).max()
    out["train/grad_norm"] = torch.stack(grad_norms).mean()
    out = {k: float(v) for k, v in out.items()}  # NOTE: one host sync for all of them
    skips = int(out.pop("train/optimizer_skips"))
    out.update({**base, "train/lr": steps.finish(skips),
                "train/optimizer_steps": float(len(plan.updates) - skips),
                "train/optimizer_skips": float(skips)})
    return out
