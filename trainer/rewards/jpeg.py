"""JPEG (in)compressibility (the DDPO rewards): the size of the image encoded as JPEG.

No weights. Encoding runs on the host with PIL (libjpeg); PIL releases the GIL while it
encodes, so a small thread pool scores a batch in parallel.
"""
from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from trainer.rewards.base import RewardScorer


def jpeg_kilobytes(images: torch.Tensor, *, quality: int = 95,
                   workers: int | None = None) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> fp32 [B]: JPEG size in kB (1000 bytes) at ``quality``."""
    arrays = images.detach().to("cpu").numpy()

    def encode(array: np.ndarray) -> float:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        return buffer.tell() / 1000.0

    workers = workers or min(8, os.cpu_count() or 1, max(1, len(arrays)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        sizes = list(pool.map(encode, arrays))
    return torch.tensor(sizes, dtype=torch.float32)


class _JpegScorer(RewardScorer):
    required_tracks: ClassVar[tuple[str, ...]] = ("image",)
    sign: ClassVar[float] = 1.0

    def __init__(self, *, quality: int = 95, device: str | torch.device | None = None) -> None:
        """Args: quality: JPEG quality (95 as in DDPO); device: ignored (host encoding)."""
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"{type(self).__name__}: quality={quality} not in [1, 100]")
        self.quality = int(quality)

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {self.components[0]: self.sign * jpeg_kilobytes(images, quality=self.quality)}


class JpegCompressibilityScorer(_JpegScorer):
    """``jpeg_compressibility = -kB``: smaller files score higher."""

    components: ClassVar[tuple[str, ...]] = ("jpeg_compressibility",)
    sign: ClassVar[float] = -1.0


class JpegIncompressibilityScorer(_JpegScorer):
    """``jpeg_incompressibility = +kB``: larger files score higher."""

    components: ClassVar[tuple[str, ...]] = ("jpeg_incompressibility",)
    sign: ClassVar[float] = 1.0
