"""Python's garbage collection kept out of the stages where the host feeds the GPU.

A CUDA train stage is host-bound: the GPU waits whenever the host falls behind, so every
collection that pauses the host inside it (a generation-0 pass every few hundred container
allocations, and rarer older ones over a heap of compiled graphs and modules) shows up as GPU
idle time. With ``train.gc = "rollout"`` (the default on CUDA) automatic collection is off;
after the first step everything alive (the model, compiled graphs, caches) is frozen out of
collection (``gc.freeze``), and one full collection of what later steps allocated runs while
the engine generates each rollout, when the trainer's host has nothing else to do. Nothing
stays uncollected for more than one step. ``"python"`` (the default on CPU, where the host is
the compute and the placement changes nothing) leaves Python's own schedule.
"""
from __future__ import annotations

import gc

import torch


def resolve_gc_mode(setting: str, device: torch.device) -> str:
    """train.gc with "auto" resolved by device."""
    if setting == "auto":
        return "rollout" if device.type == "cuda" else "python"
    return setting


class HostGarbageCollection:
    """The process's collection schedule while a Trainer runs (module docstring)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.collections = 0  # full collections run by ``while_engine_works``
        self.frozen = False
        self._was_enabled = gc.isenabled()
        if mode == "rollout":
            gc.disable()

    def while_engine_works(self) -> None:
        """Called by the rollout driver once its requests are out, before it waits."""
        if self.mode != "rollout":
            return
        gc.collect()
        self.collections += 1

    def step_done(self) -> None:
        """After the first step the objects it made long-lived (compiled graphs, optimizer
        state, caches) leave the collected heap; a full collection first frees its garbage."""
        if self.mode == "rollout" and not self.frozen:
            gc.collect()
            gc.freeze()
            self.frozen = True

    def close(self) -> None:
        """Restore the process's schedule: unfreeze, and re-enable if it was enabled."""
        if self.mode != "rollout":
            return
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
        if self._was_enabled:
            gc.enable()
        self.mode = "python"
