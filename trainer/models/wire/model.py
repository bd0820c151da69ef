"""What the rollout wire asks of a model family: the few facts a request is built from and a
response is checked against. ``trainer.models.base.GenerativeModelAdapter`` meets it (every
method below is the adapter's own), and the wire names this protocol instead of the adapter
class, so the adapter can hand its wire methods over to the wire without an import circle."""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from trainer.models.geometry import Geometry


class WireModel(Protocol):
    """The adapter methods and attributes the wire reads (see GenerativeModelAdapter)."""

    family: str
    condition_keys: tuple[str, ...]
    max_condition_images: int

    def latent_shape(self, geometry: Geometry) -> tuple[int, ...]: ...

    def init_noise_shape(self, geometry: Geometry) -> tuple[int, ...]: ...

    def scheduler_sigmas(self, num_inference_steps: int, geometry: Geometry) -> torch.Tensor: ...

    def timesteps_from_sigmas(self, sigmas: torch.Tensor) -> torch.Tensor: ...

    def resolution_problems(self, geometry: Geometry) -> list[str]: ...

    def condition_image_problems(self, images: Sequence[Sequence[Any]] | None) -> list[str]: ...

    def check_guidance(self, guidance_scale: Any) -> None: ...
