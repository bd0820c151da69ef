"""Built-in rewards for image editing, scored against each sample's source image.

* ``image_similarity`` (``ImageSimilarityScorer``): how much of the source an edit kept, so a
  policy is not paid for repainting what the instruction did not mention. Both images are
  downsampled to ``size`` x ``size`` (PIL's box filter: an area average, so the score looks at
  layout and colour, not at the noise of single pixels), and the score is
  ``1 - mean |result - source| / 255`` in [0, 1] (1: identical). A pixel metric rather than
  CLIP embeddings: it needs no weights, runs anywhere, and is exact in tests; mix it with a
  semantic reward through the component weights.
* ``clip_image_similarity`` (``CLIPImageSimilarityScorer``): the same intent judged
  semantically, ``cos(CLIP(result), CLIP(source))`` in [-1, 1] with the image tower and
  preprocessing of the CLIP scorers (``hf_clip.HFClip``; ``model_path``: a transformers CLIP
  directory). It forgives a shifted or recoloured background that the pixel metric punishes,
  and costs a model.
* ``red_to_blue`` (``RedToBlueScorer``): a dense edit reward for tests and CPU runs, the edit
  counterpart of the toy world's reward ("make the red things blue"). Each source pixel weighs
  its redness ``max(0, r - max(g, b)) / 255``; the score is the weighted mean, over the result
  resized to the source's size, of the blueness ``(b - max(r, g)) / 255`` in [-1, 1]. It moves
  with every pixel that changes colour, so a few rollouts show it rising; a source with no red
  at all cannot be scored and gives NaN for that sample.

Both compare against a sample's first reference image (the one being edited, as
Qwen-Image-Edit-Plus and FLUX.1 Kontext order them); a batch without sources (text-to-image)
is refused with one clear error, since neither has anything to compare with.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from trainer.rewards.base import RewardError, RewardScorer, check_score_inputs


def first_sources(name: str, sources: Sequence[tuple[np.ndarray, ...]] | None, batch: int
                  ) -> list[np.ndarray]:
    """Each sample's first reference image; RewardError naming the scorer when there is
    none (a text-to-image batch, or a sample without conditioning media)."""
    if sources is None:
        raise RewardError(f"{name} scores an edit against its source image, but this batch "
                          f"carries none (text-to-image prompts?); give the prompt records "
                          f"'images' or drop this scorer")
    missing = [i for i, sample in enumerate(sources) if not sample]
    if missing:
        raise RewardError(f"{name}: samples {missing[:8]} of {batch} have no source image")
    return [sample[0] for sample in sources]


class ImageSimilarityScorer(RewardScorer):
    """Options: ``size`` (side of the square both images are box-downsampled to, default 64)."""

    components: ClassVar[tuple[str, ...]] = ("image_similarity",)
    wants_sources: ClassVar[bool] = True

    def __init__(self, *, size: int = 64, device: str | torch.device | None = None) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size={size!r} must be a positive integer")
        self.size, self.device = size, device

    def _small(self, array: np.ndarray) -> np.ndarray:
        image = Image.fromarray(np.ascontiguousarray(array))
        return np.asarray(image.resize((self.size, self.size), Image.BOX), dtype=np.float32)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]],
              sources: Sequence[tuple[np.ndarray, ...]] | None = None
              ) -> dict[str, torch.Tensor]:
        batch = check_score_inputs(images, prompts, metadata)
        refs = first_sources("image_similarity", sources, batch)
        results = images.detach().cpu().numpy()
        values = [1.0 - float(np.abs(self._small(r) - self._small(s)).mean()) / 255.0
                  for r, s in zip(results, refs)]
        return {"image_similarity": torch.tensor(values, dtype=torch.float32)}


class CLIPImageSimilarityScorer(RewardScorer):
    """Options: ``model_path`` (transformers CLIP directory), ``processor_path``, ``dtype``,
    ``batch_size``: as for ``CLIPScoreScorer``."""

    components: ClassVar[tuple[str, ...]] = ("clip_image_similarity",)
    wants_sources: ClassVar[bool] = True

    def __init__(self, *, model_path: str, processor_path: str | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 batch_size: int = 64) -> None:
        from trainer.rewards.hf_clip import HFClip  # local: transformers is a slow import

        self.clip = HFClip(model_path, processor_path=processor_path, device=device,
                           dtype=dtype, batch_size=batch_size)

    def to(self, device: str | torch.device) -> "CLIPImageSimilarityScorer":
        self.clip.to(device)
        return self

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]],
              sources: Sequence[tuple[np.ndarray, ...]] | None = None
              ) -> dict[str, torch.Tensor]:
        batch = check_score_inputs(images, prompts, metadata)
        refs = first_sources("clip_image_similarity", sources, batch)
        result_embeds = self.clip.image_embeds(images)
        # a group's candidates share one source: each distinct array is embedded once, alone
        # (sources may differ in size, so they are not stacked)
        embedded: dict[int, torch.Tensor] = {}
        for ref in refs:
            if id(ref) not in embedded:
                embedded[id(ref)] = self.clip.image_embeds(
                    torch.from_numpy(np.ascontiguousarray(ref)).unsqueeze(0))[0]
        source_embeds = torch.stack([embedded[id(ref)] for ref in refs])
        return {"clip_image_similarity": (result_embeds * source_embeds).sum(dim=-1)}


class RedToBlueScorer(RewardScorer):
    """No options: a rule, exact on any device (the images' own)."""

    components: ClassVar[tuple[str, ...]] = ("red_to_blue",)
    wants_sources: ClassVar[bool] = True

    def __init__(self, *, device: str | torch.device | None = None) -> None:
        self.device = device

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]],
              sources: Sequence[tuple[np.ndarray, ...]] | None = None
              ) -> dict[str, torch.Tensor]:
        batch = check_score_inputs(images, prompts, metadata)
        refs = first_sources("red_to_blue", sources, batch)
        values = []
        for result, ref in zip(images, refs):
            src = torch.from_numpy(np.ascontiguousarray(ref)).to(result.device).float()
            out = result.float().permute(2, 0, 1).unsqueeze(0)
            out = F.interpolate(out, size=src.shape[:2], mode="bilinear", align_corners=False,
                                antialias=True)[0].permute(1, 2, 0)
            redness = (src[..., 0] - src[..., 1:].amax(-1)).clamp_min(0) / 255
            blueness = (out[..., 2] - out[..., :2].amax(-1)) / 255
            total = float(redness.sum())  # host sync, one per sample: a test reward
            values.append(float((redness * blueness).sum()) / total if total > 1e-6
                          else math.nan)
        return {"red_to_blue": torch.tensor(values, dtype=torch.float32)}
