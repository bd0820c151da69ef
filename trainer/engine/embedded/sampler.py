"""The denoising loop of the engine: driver sigmas, SDE at the resolved steps, ODE elsewhere.

Every step is ``kernels.sde_step`` (``sde_type="ode"`` off the SDE set), the very function the
actor's replay pairs with ``kernels.sde_log_prob``, so the recorded log-prob and the replayed one
come from the same code. The loop is kept lean for the GPU:

- no host-device sync inside it but the value checks: sigmas reach ``sde_step`` as fp32 [B]
  views of one device tensor built before the loop (the tensors the actor's replay passes, so
  recorded and replayed log-probs match bit for bit), the same views the transformer takes;
  ``sde_step`` validates its inputs (a host sync) only at the first step and the first SDE
  step; the SDE-step bookkeeping is Python ints;
- outputs are preallocated once (``trajectory`` [B, S, 2, *latent], ``log_probs`` [B, S]) and
  filled with device copies;
- step noise is requested lazily (``noise_fn(step)``) inside the loop, so drawing it on the host
  (the driver's CPU recipe) overlaps the forwards the host has already queued on the device
  instead of adding up before the loop starts;
- no CUDA graph: the host already queues the loop ahead of the GPU, so replaying the compiled
  forward from a graph saves little of it, while the graph would tie the loop to fixed
  input and weight buffers (weight sync and the LoRA merge write in place) and keep a memory
  pool of its own (``bench/reports/2026-12-03_h200_clip-fold-and-graphs/``).

The latent state is kept in the dtype of ``x_T`` (fp32 by the engine's choice): the stored
trajectory is then exactly what the transformer saw after its own cast, and the log-prob is the
density of the stored tensor (kernels' contract).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

import flowgrpo_kernels as kernels
from trainer.profiling import nvtx_range

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
NoiseFn = Callable[[int], torch.Tensor]


@dataclass
class DenoiseOutput:
    final: torch.Tensor        # x_0 [B, *latent]
    trajectory: torch.Tensor   # [B, S, 2, *latent]: (x_i, x_{i+1}) at each SDE step i
    log_probs: torch.Tensor    # [B, S] fp32


def denoise(velocity_fn: VelocityFn, x: torch.Tensor, sigmas: Sequence[float],
            sde_indices: Sequence[int], *, eta: float, sde_type: str, noise_fn: NoiseFn,
            record: bool = True, backend: str = "auto",
            sde_options: dict | None = None) -> DenoiseOutput:
    """Run ``len(sigmas) - 1`` steps from ``x`` (= x_T, not modified) and record SDE steps.

    ``velocity_fn(x, sigma)`` is the transformer forward (sigma: [B] device tensor);
    ``noise_fn(i)`` returns the standard-normal noise of SDE step ``i`` shaped like ``x``.
    With ``record=False`` the trajectory is not kept (evaluation) and ``trajectory`` is empty.
    ``sde_options``: further ``kernels.sde_step`` keywords (sigma_one, log_prob_form).
    """
    batch, num_steps = x.shape[0], len(sigmas) - 1
    sde_slot = {int(i): k for k, i in enumerate(sde_indices)}
    n_sde = len(sde_slot)
    trajectory = torch.empty((batch, n_sde if record else 0, 2, *x.shape[1:]), dtype=x.dtype,
                             device=x.device)
    log_probs = torch.empty((batch, n_sde), dtype=torch.float32, device=x.device)
    # every step's sigma values checked once, on the host, before any step is queued: the
    # steps then skip validation, which with their sigma tensors would sync with the GPU
    kernels.check_schedule(sigmas, sde_slot, eta=eta, sde_type=sde_type, **(sde_options or {}))
    sigma_dev = torch.tensor([float(s) for s in sigmas], dtype=torch.float32)
    # a pageable host copy would wait for the GPU; a pinned one is queued like a kernel
    sigma_dev = (sigma_dev.pin_memory().to(x.device, non_blocking=True)
                 if x.device.type == "cuda" else sigma_dev.to(x.device))
    with nvtx_range("rollout/denoise"):
        for i in range(num_steps):
            # The kernels get the same fp32 [B] sigma tensors the actor's replay passes
            # (RolloutBatch.sigmas): with Python floats the GPU kernels take another
            # specialisation, and recorded and replayed log-probs would differ in the last bits.
            s, s_next = sigma_dev[i].expand(batch), sigma_dev[i + 1].expand(batch)
            v = velocity_fn(x, s)
            slot = sde_slot.get(i)
            if slot is None:
                x = kernels.sde_step(x, v, s, s_next, eta=0.0, sde_type="ode", backend=backend,
                                     validate=False).prev_sample
                continue
            out = kernels.sde_step(x, v, s, s_next, eta=eta, sde_type=sde_type, noise=noise_fn(i),
                                   backend=backend, validate=False,
                                   **(sde_options or {}))
            if record:
                trajectory[:, slot, 0].copy_(x)
                trajectory[:, slot, 1].copy_(out.prev_sample)
            log_probs[:, slot].copy_(out.log_prob)
            x = out.prev_sample
    return DenoiseOutput(final=x, trajectory=trajectory, log_probs=log_probs)
