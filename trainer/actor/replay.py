"""Replay: the trained SDE transitions through the transformer, then the fused log-prob.

The same adapter.velocity and kernels.sde_log_prob the engine sampled with, so with the same
weights and inputs the replayed log-prob equals the recorded one.

All trained steps of a micro-batch go through the transformer as ONE batch of rows (row
``i * S + s`` is sample i at its trained step s, carrying its own sigma), because a forward of
b * S rows keeps the GPU busy where S forwards of b rows leave it idle between small kernels.
The velocity is split back into steps after the forward; the log-prob (and the loss built on
it) stays per (sample, step), so a step drifting out of the clip range does not zero the
others' gradients.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

import flowgrpo_kernels as kernels
from trainer.models.base import GenerativeModelAdapter, RolloutBatch
from trainer.models.guidance import guided_velocity
from trainer.profiling import ComputeMeter


@dataclass
class ReplayRows:
    """A micro-batch laid out as b * S rows on the model's device (see the module docstring)."""

    x: torch.Tensor           # [b*S, *latent]
    x_next: torch.Tensor      # [b*S, *latent]
    sigma: torch.Tensor       # [b*S] fp32
    sigma_next: torch.Tensor  # [b*S] fp32
    conditions: dict[str, torch.Tensor]  # each row's sample's conditions, [b*S, ...]
    samples: int              # b
    steps: int                # S


def replay_rows(batch: RolloutBatch, device: torch.device) -> ReplayRows:
    """``batch`` as rows, sample-major: row i*S + s = (sample i, trained step s)."""
    b, steps = len(batch), len(batch.sde_indices)
    rows = b * steps

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(rows, *t.shape[2:]).to(device, non_blocking=True).contiguous()

    cond = {k: v.to(device, non_blocking=True).repeat_interleave(steps, dim=0)
            for k, v in batch.conditions.items()}
    return ReplayRows(x=flat(batch.latents), x_next=flat(batch.next_latents),
                      sigma=flat(batch.sigmas), sigma_next=flat(batch.sigmas_next),
                      conditions=cond, samples=b, steps=steps)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def rows_velocity(adapter: GenerativeModelAdapter, model: nn.Module, rows: ReplayRows,
                  batch: RolloutBatch, meter: ComputeMeter | None = None) -> torch.Tensor:
    """The one transformer forward over every row: v [b*S, *latent] (with CFG: one forward of
    2 * b * S rows, trainer.models.guidance)."""
    device = rows.x.device
    with meter.region("transformer", device) if meter else contextlib.nullcontext():
        return guided_velocity(adapter, model, rows.x, rows.sigma, rows.conditions,
                               batch.geometry, batch.guidance_scale)


def replay_log_probs(adapter: GenerativeModelAdapter, model: nn.Module, batch: RolloutBatch,
                     *, backend: str = "auto", meter: ComputeMeter | None = None,
                     rows: ReplayRows | None = None) -> torch.Tensor:
    """log pi_theta(x_next | x) for every (sample, trained step): [b, S] fp32, with grad.

    One forward of b * S rows (see the module docstring); ``meter`` times it
    (perf/compute/transformer). ``rows``: the batch already laid out (reused by the KL term).
    """
    rows = rows or replay_rows(batch, model_device(model))
    v = rows_velocity(adapter, model, rows, batch, meter)
    # validate=False: the engine's sde_step already validated these sigmas when it sampled
    # the transition (and validation with tensor sigmas costs a host sync).
    logp = kernels.sde_log_prob(rows.x, v, rows.x_next, rows.sigma, rows.sigma_next,
                                **batch.kernel_options(), backend=backend, validate=False)
    return logp.reshape(rows.samples, rows.steps)


def replay_log_probs_per_step(adapter: GenerativeModelAdapter, model: nn.Module,
                              batch: RolloutBatch, *, backend: str = "auto") -> torch.Tensor:
    """The same [b, S] log-probs with one forward of b rows per trained step: the layout the
    engine samples with. Kept as the reference the batched replay is tested against."""
    device = model_device(model)
    conditions = {k: v.to(device) for k, v in batch.conditions.items()}
    cols = []
    for s in range(len(batch.sde_indices)):
        x = batch.latents[:, s].to(device)
        sigma, sigma_next = batch.sigmas[:, s].to(device), batch.sigmas_next[:, s].to(device)
        v = guided_velocity(adapter, model, x, sigma, conditions, batch.geometry,
                            batch.guidance_scale)
        cols.append(kernels.sde_log_prob(x, v, batch.next_latents[:, s].to(device), sigma,
                                         sigma_next, **batch.kernel_options(),
                                         backend=backend, validate=False))
    return torch.stack(cols, dim=1)


def replay_kl(adapter: GenerativeModelAdapter, model: nn.Module, batch: RolloutBatch,
              rows: ReplayRows, v: torch.Tensor | None = None,
              meter: ComputeMeter | None = None, kl_form: str = "gaussian") -> torch.Tensor:
    """KL(pi_theta || pi_ref) per (sample, step) [b, S], pi_ref = ``model`` with its LoRA
    adapter disabled (no grad through the reference). ``v``: the policy's velocity of these
    rows when the caller has it; otherwise it is computed here."""
    if v is None:
        v = rows_velocity(adapter, model, rows, batch, meter)
    with torch.no_grad(), model.disable_adapter():
        v_ref = rows_velocity(adapter, model, rows, batch, meter)
    kl = kernels.sde_kl(v, v_ref, rows.sigma, rows.sigma_next, **batch.kernel_options(),
                        kl_form=kl_form, validate=False)
    return kl.reshape(rows.samples, rows.steps)


@dataclass
class UpdatePlan:
    """The local slice split into disjoint optimizer updates of equal-size micro-batches."""

    updates: list[list[torch.Tensor]]  # updates[u][m] = row indices of micro-batch m

    @property
    def num_micro_batches(self) -> int:
        return sum(len(u) for u in self.updates)


def plan_updates(num_samples: int, num_updates: int, micro_batch_size: int,
                 generator: torch.Generator | None = None) -> UpdatePlan:
    """Hard errors when the updates or micro-batches don't divide evenly: uneven chunks would
    silently change the weight of each sample in the mean."""
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
