"""What the rollout wire asks of a model family: the few facts a request is built from and a
response is checked against. ``trainer.models.base.GenerativeModelAdapter`` meets it (every
method below is the adapter's own), and the wire names this protocol instead of the adapter
class, so the adapter can hand its wire methods over to the wire without an import circle."""
from __future__ import annotations

from typing import Any, Protocol

import torch


class WireModel(Protocol):
    """The adapter methods and attributes the wire reads (see GenerativeModelAdapter)."""

    family: str
    condition_keys: tuple[str, ...]

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]: ...

    def init_noise_shape(self, height: int, width: int) -> tuple[int, ...]: ...

    def scheduler_sigmas(self, num_inference_steps: int, height: int,
                         width: int) -> torch.Tensor: ...

    def timesteps_from_sigmas(self, sigmas: torch.Tensor) -> torch.Tensor: ...

    def resolution_problems(self, height: int, width: int) -> list[str]: ...

    def check_guidance(self, guidance_scale: Any) -> None: ...
