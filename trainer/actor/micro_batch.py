"""``train.micro_batch_size = "auto"``: the largest micro-batch whose replay fits in memory.

A micro-batch of m samples is one forward of m * S rows (all trained steps at once), so the
activation memory grows with m. On a GPU, the first policy update measures it: one sample's
forward + backward is run once (a probe, its gradient discarded) and the peak memory it added,
less the gradients it allocated, is the cost of one sample. The micro-batch is then the largest
divisor of the update's sample count whose cost fits the memory free at that moment (the
engine asleep) times ``train.micro_batch_memory_fraction``, the same on every rank (MIN).

On the CPU there is nothing to measure and memory is rarely the limit: the whole update is
one micro-batch. ``train.micro_batch_memory_gb`` replaces the measured free memory on a GPU
(e.g. to leave room for something else sharing it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import logging

import torch
import torch.distributed as dist

from trainer.actor.micro_step import forward_backward

if TYPE_CHECKING:
    from trainer.actor.actor import Actor

log = logging.getLogger("actor")

_GB = float(2 ** 30)


def largest_fitting_divisor(per_update: int, bytes_per_sample: float,
                            budget_bytes: float) -> int:
    """The largest divisor m of ``per_update`` with m * bytes_per_sample <= budget_bytes.

    Raises ValueError when not even one sample fits (refusing beats an OOM mid-step)."""
    if per_update < 1:
        raise ValueError(f"an update of {per_update} samples cannot be split into micro-batches")
    if bytes_per_sample <= 0:
        return per_update
    fits = [m for m in range(1, per_update + 1)
            if per_update % m == 0 and m * bytes_per_sample <= budget_bytes]
    if not fits:
        raise ValueError(
            f"micro_batch_size=auto: one sample's replay needs {bytes_per_sample / _GB:.2f} GiB "
            f"but only {max(budget_bytes, 0) / _GB:.2f} GiB is available for it; lower the "
            f"resolution or the trained steps, enable fsdp.activation_checkpointing, or use more "
            f"GPUs")
    return fits[-1]


def resolve_micro_batch(actor: Actor, batch, advantages: torch.Tensor, per_update: int) -> int:
    """The micro-batch size for this run: the configured integer, or ``auto`` resolved once
    (on the first update) and kept for the run."""
    t = actor.train_cfg
    if t.micro_batch_size != "auto":
        return int(t.micro_batch_size)
    cached = actor.auto_micro_batch
    if cached is not None and per_update % cached == 0:
        return cached
    per_sample, budget, how = _cost_and_budget(actor, batch, advantages)
    micro = largest_fitting_divisor(per_update, per_sample, budget)
    if dist.is_available() and dist.is_initialized():
        dev = actor.coll_device()
        m = torch.tensor([micro], dtype=torch.int64, device=dev)
        dist.all_reduce(m, op=dist.ReduceOp.MIN)
        micro = int(m.item())  # every rank's choice divides the same per_update
    log.info("micro_batch_size=auto -> %d of %d samples per update (%s)", micro, per_update,
             how)
    actor.auto_micro_batch = micro
    return micro


def _cost_and_budget(actor: Actor, batch, advantages) -> tuple[float, float, str]:
    t = actor.train_cfg
    if actor.device.type != "cuda":
        return 0.0, 0.0, "CPU: the whole update"
    per_sample = probe_sample_bytes(actor, batch, advantages)
    if t.micro_batch_memory_gb is not None:
        return per_sample, t.micro_batch_memory_gb * _GB, (
            f"probe {per_sample / _GB:.2f} GiB per sample, budget "
            f"{t.micro_batch_memory_gb:g} GiB set")
    free, _ = torch.cuda.mem_get_info(actor.device)
    cached = torch.cuda.memory_reserved(actor.device) - torch.cuda.memory_allocated(
        actor.device)
    grads = _grad_bytes(actor.model)
    budget = (free + cached) * t.micro_batch_memory_fraction - grads
    return per_sample, budget, (f"probe {per_sample / _GB:.2f} GiB per sample, "
                                f"{budget / _GB:.1f} GiB available")


def _grad_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


def probe_sample_bytes(actor: Actor, batch, advantages) -> float:
    """Peak memory one sample's forward + backward adds, less its gradients (GPU only).

    The probe's loss is scaled by 0, its gradients are dropped and no optimizer step runs, so
    the policy is untouched."""
    dev = actor.device
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    actor.model.train()
    forward_backward(actor, batch.select([0]), advantages[[0]], 0.0, None)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    actor.optimizer.zero_grad(set_to_none=True)
    return max(float(peak - before - _grad_bytes(actor.model)), 1.0)
