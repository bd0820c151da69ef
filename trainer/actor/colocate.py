"""When the colocated actor and engine give the GPU to each other (``fsdp.offload_policy``).

``rollout.offload_rollout`` (the engine releases its memory while the actor trains) and
``fsdp.offload_train`` (the actor moves its parameters and optimizer state to pinned host
memory while the engine generates) exist to make room. Where the GPU holds both at their peaks,
they are pure cost: every step copies the actor's state through PCIe twice.

- ``always``: each enabled offload runs every step.
- ``as_needed`` (default): the first step releases the engine's memory for its update and
  measures what each side needs: the engine's resident memory and its peak during a rollout
  (reported by the engine), the actor's resident memory after its update and its peak during
  it. From the end of that update on (the actor's first offload included), the offloads are
  skipped when ``max(actor resident + engine peak, actor peak + engine resident) + margin``
  fits in the device's memory (``margin``: 10 % of it, for allocator slack and each process's
  CUDA context); otherwise they keep running. The decision and its figures are logged once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("trainer")

OFFLOAD_POLICIES = ("always", "as_needed")
_MARGIN = 0.10
_GB = float(2 ** 30)


@dataclass
class Footprint:
    """Bytes measured on the first step (see the module docstring)."""

    total: int
    actor_resident: int
    actor_peak: int
    engine_resident: int
    engine_peak: int

    def fits_together(self) -> bool:
        need = max(self.actor_resident + self.engine_peak, self.actor_peak + self.engine_resident)
        return need + _MARGIN * self.total <= self.total

    def describe(self) -> str:
        return (f"actor {self.actor_resident / _GB:.1f} GiB resident / {self.actor_peak / _GB:.1f} "
                f"GiB peak, engine {self.engine_resident / _GB:.1f} / {self.engine_peak / _GB:.1f} "
                f"GiB, device {self.total / _GB:.1f} GiB")


class OffloadPolicy:
    """Whether this step's offloads run; ``measure()`` after the first step decides."""

    def __init__(self, policy: str, *, offload_rollout: bool, offload_train: bool,
                 device: torch.device) -> None:
        if policy not in OFFLOAD_POLICIES:
            raise ValueError(f"offload_policy must be one of {OFFLOAD_POLICIES}, got {policy!r}")
        self.policy = policy
        self.cuda = torch.device(device).type == "cuda"
        self.engine_release = offload_rollout
        self.actor_offload = offload_train and self.cuda
        self.decided = policy == "always" or not (self.engine_release or self.actor_offload)
        self.footprint: Footprint | None = None

    def measure(self, footprint: Footprint) -> None:
        """Called once, after the first step's update, before its offload."""
        if self.decided:
            return
        self.decided, self.footprint = True, footprint
        if footprint.fits_together():
            self.engine_release = self.actor_offload = False
            log.info("offload_policy=as_needed: actor and engine fit together (%s): colocate "
                     "offloads skipped from now on", footprint.describe())
        else:
            log.info("offload_policy=as_needed: actor and engine do not fit together (%s): "
                     "colocate offloads kept", footprint.describe())

    def metrics(self, offloaded=None) -> dict[str, float]:
        """Whether the offloads run; with this step's ``offloaded`` actor (an OffloadState),
        the bytes it moved each way over PCIe."""
        out = {"perf/offload_active": float(self.engine_release or self.actor_offload)}
        if offloaded is not None:
            out["perf/offload_gb"] = offloaded.nbytes / 1e9
        return out


def actor_footprint(device: torch.device) -> tuple[int, int]:
    """(allocated now, peak since the last reset) of this process on ``device``."""
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
