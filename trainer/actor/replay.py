"""Replay: the trained SDE transitions through the transformer, then the fused log-prob.

The same adapter.velocity and kernels.sde_log_prob the engine sampled with, so with the same
weights and inputs the replayed log-prob equals the recorded one.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from trainer.models.base import GenerativeModelAdapter, RolloutBatch
from trainer.models.guidance import guided_velocity
from trainer.profiling import ComputeMeter


def replay_log_probs(adapter: GenerativeModelAdapter, model: nn.Module, batch: RolloutBatch,
                     *, backend: str = "auto", meter: ComputeMeter | None = None) -> torch.Tensor:
    """log pi_theta(x_next | x) for every (sample, trained step): [b, S] fp32, with grad.

    One forward per trained step over the micro-batch; each column is its own step, so a step
    drifting out of the clip range does not zero the others' gradients (mean taken later).
    ``meter`` times the transformer forwards (perf/compute/transformer).
    """
    device = next(model.parameters()).device
    cols = []
    conditions = {k: v.to(device, non_blocking=True) for k, v in batch.conditions.items()}
    for s in range(len(batch.sde_indices)):
        x = batch.latents[:, s].to(device, non_blocking=True)
        x_next = batch.next_latents[:, s].to(device, non_blocking=True)
        sigma = batch.sigmas[:, s].to(device)
        sigma_next = batch.sigmas_next[:, s].to(device)
        with meter.region("transformer", device) if meter else contextlib.nullcontext():
            v = guided_velocity(adapter, model, x, sigma, conditions, batch.height, batch.width,
                                batch.guidance_scale)
        # validate=False: the engine's sde_step already validated these sigmas when it sampled
        # the transition (and validation with tensor sigmas costs a host sync per step).
        cols.append(kernels.sde_log_prob(x, v, x_next, sigma, sigma_next, **batch.kernel_options(),
                                         backend=backend, validate=False))
    return torch.stack(cols, dim=1)


@dataclass
class UpdatePlan:
    """The local slice split into disjoint optimizer updates of equal-size micro-batches."""

    updates: list[list[torch.Tensor]]  # updates[u][m] = row indices of micro-batch m

    @property
    def num_micro_batches(self) -> int:
        return sum(len(u) for u in self.updates)


def plan_updates(num_samples: int, num_updates: int, micro_batch_size: int,
                 generator: torch.Generator | None = None) -> UpdatePlan:
    """Hard errors (spec) when the updates or micro-batches don't divide evenly: uneven
    chunks would silently change the weight of each sample in the mean."""
    problems = []
    if num_updates < 1 or num_samples % num_updates:
        problems.append(f"--num-updates-per-batch {num_updates} does not divide the "
                        f"{num_samples} samples of this rank's slice")
    per_update = num_samples // max(1, num_updates)
    if micro_batch_size < 1 or (per_update and per_update % micro_batch_size):
        problems.append(f"--micro-batch-size {micro_batch_size} does not divide the "
                        f"{per_update} samples of one update")
    if problems:
        raise ValueError("cannot plan the updates:\n  - " + "\n  - ".join(problems))
    order = torch.randperm(num_samples, generator=generator) if generator is not None \
        else torch.arange(num_samples)
    updates = []
    for u in range(num_updates):
        rows = order[u * per_update:(u + 1) * per_update]
        updates.append(list(rows.split(micro_batch_size)))
    return UpdatePlan(updates)
