"""PickScore: a CLIP-H fine-tuned on Pick-a-Pic human preferences (text-image alignment and
preference in one number). The reward the Qwen-Image recipes train on."""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from trainer.rewards.base import RewardScorer
from trainer.rewards.hf_clip import HFClip


class PickScoreScorer(RewardScorer):
    """``pickscore = logit_scale.exp() * cos(text, image) * score_scale``.

    Args:
        model_path: local PickScore directory in the transformers CLIP format (model +
            processor, or see ``processor_path``).
        processor_path: directory of the tokenizer + preprocessor_config.json when they are
            not next to the model.
        device, dtype: where and in what precision to score (default CPU fp32; bf16 on CUDA).
        batch_size: images per forward.
        score_scale: 1/26 by default, the convention of the Flow-GRPO reference code: raw
            PickScores sit around 20-23, so scaled scores read like Flow-GRPO's reported eval
            values (about 0.86). Group normalisation makes the scale irrelevant to training.
    """

    components: ClassVar[tuple[str, ...]] = ("pickscore",)
    required_tracks: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, *, model_path: str, processor_path: str | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 batch_size: int = 64, score_scale: float = 1.0 / 26.0) -> None:
        self.clip = HFClip(model_path, processor_path=processor_path, device=device, dtype=dtype,
                           batch_size=batch_size)
        self.score_scale = float(score_scale)

    def to(self, device: str | torch.device) -> "PickScoreScorer":
        self.clip.to(device)
        return self

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        image = self.clip.image_embeds(images)
        text = self.clip.text_embeds(prompts)
        cos = (image * text).sum(dim=-1)
        return {"pickscore": cos * self.clip.logit_scale * self.score_scale}
