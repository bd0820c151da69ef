"""CLIPScore (Hessel et al., 2021): reference-free text-image alignment."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from trainer.rewards.base import RewardScorer
from trainer.rewards.hf_clip import HFClip


class CLIPScoreScorer(RewardScorer):
    """``clipscore = weight * max(cos(text, image), 0)``.

    Args:
        model_path: transformers CLIP directory (e.g. a ViT-L/14 saved with its processor).
        processor_path, device, dtype, batch_size: as for PickScoreScorer.
        weight: 2.5, the paper's rescaling (scores then spread over roughly [0, 1]); the
            torchmetrics variant uses 100. Group normalisation makes the scale irrelevant to
            training, but it shows in the logged reward/clipscore_* metrics.
    """

    components: ClassVar[tuple[str, ...]] = ("clipscore",)
    required_tracks: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, *, model_path: str, processor_path: str | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 batch_size: int = 64, weight: float = 2.5) -> None:
        self.clip = HFClip(model_path, processor_path=processor_path, device=device, dtype=dtype,
                           batch_size=batch_size)
        self.weight = float(weight)

    def to(self, device: str | torch.device) -> "CLIPScoreScorer":
        self.clip.to(device)
        return self

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        cos = (self.clip.image_embeds(images) * self.clip.text_embeds(prompts)).sum(dim=-1)
        return {"clipscore": self.weight * cos.clamp_min(0.0)}
