"""An experiment scorer for the toy task: the rule-based reward plus ``count_soft``.

``count_soft`` counts every blob of the group's colour, however small (no 6-pixel floor), as
min(1, area / 16 px) of an object, then scores 0.5 ** |k - n| as ``count`` does: a fragment
costs a fraction of an object instead of nothing (under the floor) or a whole one (over it),
so the score moves smoothly as fragments grow or shrink. Merged objects still count as one, and
the smallest rendered objects (about 10 px) count as less than one: a rendered scene can score
under 1.
Used by ``lab/sweeps/toy_soft-count.txt`` (run with ``lab/toy`` on PYTHONPATH) to ask whether
the policy gradient follows a count signal that is smooth in the image; the shipped recipe
does not use it.
"""
from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from trainer.toy.reward import ToyCompositionScorer

FULL_OBJECT_PX = 16.0   # a blob this large or larger counts as one whole object


class SoftCountScorer(ToyCompositionScorer):
    components: ClassVar[tuple[str, ...]] = ("color", "count", "position", "count_soft")

    def score(self, images: torch.Tensor, prompts: Sequence[str],
              metadata: Sequence[dict[str, Any]] | None = None) -> dict[str, torch.Tensor]:
        out = super().score(images, prompts, metadata)
        specs = self._specs(images, prompts, metadata)
        every_blob = self.blobs(images, min_blob_fraction=0.0)
        out["count_soft"] = torch.tensor([soft_count(s, b) for s, b in zip(specs, every_blob)],
                                         dtype=torch.float32).to(images.device)
        return out

    __call__ = score


def soft_count(spec: dict[str, Any], blobs: list[tuple[str, float, float, float]]) -> float:
    """Mean over the spec's groups of 0.5 ** |k - n|, k = sum of min(1, area / 16 px) over the
    group colour's blobs (0 when it has none)."""
    scores = []
    for group in spec["objects"]:
        k = sum(min(1.0, area / FULL_OBJECT_PX) for color, area, _, _ in blobs
                if color == group["color"])
        scores.append(0.5 ** abs(k - group["count"]) if k > 0 else 0.0)
    return sum(scores) / len(scores)
