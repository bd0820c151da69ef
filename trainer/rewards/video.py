"""Rewards on video: any image scorer frame by frame, a temporal-consistency term, and the
dispatch that gives every scorer the media it reads.

A video batch is uint8 [B, F, H, W, 3] (``trainer.media.as_video`` converts the channel-first
layouts engines hand out); an image batch [B, H, W, 3] is unchanged everywhere, and the
manager treats a video batch with F = 1 as the image batch it is.

* **Image scorers on video** (``score_batch``): the frames the scorer's ``FrameRule`` picks
  are scored as one image batch (prompts, metadata and sources repeated per frame), and each
  component's per-frame values become one value per video:

  - ``mean`` (the default): the mean over every frame;
  - ``min``: the worst frame (a policy cannot buy one bad frame with many good ones);
  - ``sampled`` with ``frames = K``: the mean over K evenly spread frames (first and last
    included; the middle one for K = 1; ``trainer.media.spread_indices``), the same frames
    every call, so a long video costs K scorer images instead of F and the value stays
    comparable from step to step.

  A frame the scorer could not score (NaN) leaves its video unscored under every rule: the
  advantage step then fails its group when the component is required, as for an image.
  ``[reward.scorers.NAME] frame_aggregation = "min"`` (and ``frames``) sets the rule
  (``trainer.rewards.spec``); preflight refuses an unknown rule, ``frames`` without
  ``sampled``, and a rule on a scorer that reads whole videos.

* **Scorers that read videos** set ``takes_video`` (``RewardScorer``) and get the batch as it
  is: ``temporal_consistency`` below, custom video functions (``trainer.rewards.function``,
  ``fn.media = "video"``), and the remote client (the server aggregates frames itself).

* ``temporal_consistency`` (``TemporalConsistencyScorer``): how alike consecutive frames
  are, averaged over the F - 1 pairs. By default in pixels: both frames box-averaged to at
  most ``size`` x ``size`` (an area average: layout and colour, not single-pixel noise), the
  pair scores ``1 - mean |a - b| / 255`` in [0, 1]. Pixels rather than a raw-pixel cosine:
  two all-positive pixel vectors have a cosine near 1 whatever they show, and a centred one
  is undefined on a flat frame. With ``model_path`` (a transformers CLIP directory) the pair
  scores the cosine of their CLIP image embeddings in [-1, 1] instead: it forgives motion
  that keeps the content and costs a model. A one-frame video (or an image) scores 1: there
  is no pair to differ. The term pays for stillness too: mix it, by weight, with a reward for
  what the video should show.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F

from trainer.media import spread_indices
from trainer.rewards.base import RewardError, RewardScorer, check_score_inputs, frames_of, \
    to_component_tensor
from trainer.rewards.spec import FRAME_AGGREGATIONS, frame_problems


@dataclass(frozen=True)
class FrameRule:
    """How an image scorer's per-frame values become one per video (module docstring)."""

    aggregation: str = "mean"
    frames: int | None = None

    def __post_init__(self) -> None:
        problems = frame_problems("frame rule", self.aggregation, self.frames)
        if problems:
            raise ValueError("; ".join(problems))

    def indices(self, count: int) -> list[int]:
        """The frames of a ``count``-frame video this rule scores."""
        if self.aggregation == "sampled":
            return spread_indices(count, int(self.frames))
        return list(range(count))

    def reduce(self, values: torch.Tensor) -> torch.Tensor:
        """[B, K] per-frame values -> [B] (NaN propagates: an unscored frame, an unscored
        video)."""
        return values.amin(dim=1) if self.aggregation == "min" else values.mean(dim=1)


DEFAULT_RULE = FrameRule(FRAME_AGGREGATIONS[0])


def score_batch(scorer: RewardScorer, images: torch.Tensor, prompts: list[str],
                metadata: list[dict[str, Any]], sources: Sequence[tuple] | None,
                rule: FrameRule | None = None) -> Any:
    """One scorer on one batch, as the manager calls it: an image batch, or any batch to a
    scorer that reads videos, goes to ``scorer.score`` unchanged; a video batch to an image
    scorer goes frame by frame under ``rule`` (default ``mean``)."""
    extra = {"sources": sources} if getattr(scorer, "wants_sources", False) else {}
    if images.dim() == 4 or getattr(scorer, "takes_video", False):
        return scorer.score(images, prompts, metadata, **extra)
    return score_per_frame(scorer, images, prompts, metadata, sources, rule or DEFAULT_RULE)


def score_per_frame(scorer: RewardScorer, video: torch.Tensor, prompts: list[str],
                    metadata: list[dict[str, Any]], sources: Sequence[tuple] | None,
                    rule: FrameRule) -> dict[str, torch.Tensor]:
    """uint8 [B, F, H, W, 3] through an image scorer: the rule's K frames of every video in
    one batch of B * K images (video-major), then K values -> 1 per component."""
    name = getattr(scorer, "name", type(scorer).__name__)
    batch, count = video.shape[:2]
    picked = rule.indices(count)
    k = len(picked)
    frames = video[:, picked].reshape(batch * k, *video.shape[2:])

    def repeat(items: Sequence[Any]) -> list[Any]:
        return [item for item in items for _ in range(k)]

    extra = {"sources": None if sources is None else repeat(sources)} \
        if getattr(scorer, "wants_sources", False) else {}
    out = scorer.score(frames, repeat(prompts), [dict(m) for m in repeat(metadata)], **extra)
    if not isinstance(out, dict):
        raise RewardError(f"{name}.score returned {type(out).__name__}, not a dict")
    problems: list[str] = []
    reduced = {}
    for component, values in out.items():
        if component not in scorer.components:
            problems.append(f"{name} returned undeclared component {component!r}")
            continue
        tensor = to_component_tensor(component, values, batch * k, problems)
        if tensor is not None:
            reduced[component] = rule.reduce(tensor.view(batch, k))
    if problems:
        raise RewardError(f"reward scorers (per frame, {k} of {count} frames): " +
                          "; ".join(problems))
    return reduced


class TemporalConsistencyScorer(RewardScorer):
    """Frame-to-frame similarity of each video (module docstring).

    Args:
        size: side of the square frames are box-averaged down to (never up), pixel metric.
        model_path: a transformers CLIP directory: the CLIP-feature cosine instead of pixels.
        processor_path, dtype, batch_size: the CLIP model's, as for ``CLIPScoreScorer``.
        device: where the pixel metric runs is the video's own device; the CLIP model's.
    """

    components: ClassVar[tuple[str, ...]] = ("temporal_consistency",)
    required_tracks: ClassVar[tuple[str, ...]] = ("video",)
    takes_video: ClassVar[bool] = True

    def __init__(self, *, size: int = 64, model_path: str | None = None,
                 processor_path: str | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, batch_size: int = 64) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"temporal_consistency: size={size!r} must be a positive integer")
        self.size, self.device, self.clip = size, device, None
        if model_path is not None:
            from trainer.rewards.hf_clip import HFClip  # local: transformers is a slow import
            self.clip = HFClip(model_path, processor_path=processor_path, device=device,
                               dtype=dtype, batch_size=batch_size)

    def to(self, device: str | torch.device) -> "TemporalConsistencyScorer":
        if self.clip is not None:
            self.clip.to(device)
        self.device = torch.device(device)
        return self

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = check_score_inputs(images, prompts, metadata, video=True)
        video = frames_of(images)
        count = video.shape[1]
        if count == 1:
            return {"temporal_consistency": torch.ones(batch, dtype=torch.float32)}
        pairs = self._clip_pairs(video) if self.clip is not None else self._pixel_pairs(video)
        return {"temporal_consistency": pairs.mean(dim=1)}

    def _pixel_pairs(self, video: torch.Tensor) -> torch.Tensor:
        """[B, F, H, W, 3] -> [B, F - 1]: 1 - mean |a - b| / 255 of box-averaged frames."""
        batch, count, height, width, _ = video.shape
        frames = video.reshape(batch * count, height, width, 3).permute(0, 3, 1, 2).float()
        small = F.adaptive_avg_pool2d(frames, (min(self.size, height), min(self.size, width)))
        small = small.view(batch, count, *small.shape[1:])
        return 1.0 - (small[:, 1:] - small[:, :-1]).abs().mean(dim=(2, 3, 4)) / 255.0

    def _clip_pairs(self, video: torch.Tensor) -> torch.Tensor:
        """[B, F, H, W, 3] -> [B, F - 1]: cosine of consecutive frames' CLIP embeddings."""
        batch, count = video.shape[:2]
        embeds = self.clip.image_embeds(video.reshape(batch * count, *video.shape[2:]))
        embeds = embeds.view(batch, count, -1)
        return (embeds[:, 1:] * embeds[:, :-1]).sum(dim=-1)
