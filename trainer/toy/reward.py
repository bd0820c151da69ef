"""Rule-based reward for the toy world: colour, count and position, each in [0, 1].

Pipeline per image (batched in torch, so it runs on the rollout GPU as well as on CPU):

1. Pixel classes: every pixel goes to the nearest palette colour or to the background, and to
   the background when it is farther than ``max_color_distance`` from every palette colour.
2. Blobs: 8-connected components of each colour class (label propagation by 3x3 max-pooling),
   blobs smaller than ``min_blob_fraction`` of the image dropped as noise.
3. Matching: group g of the spec is matched to the blobs of its own colour when there are any,
   else to the largest-area *unrequested* colour still free (a stand-in), so that an image
   with the right objects in a wrong colour loses colour reward only.
4. Components:
   * ``color`` = mean over groups of [group's own colour found] x purity, where purity is the
     share of all blob area that is in requested colours (an extra object in another colour
     costs colour, not count).
   * ``count`` = mean over groups of 0.5 ** |k - n|, k = blobs matched (>= 1), n = asked; 0
     for an unmatched group. Partial credit halves per object off, so a scatter of many
     blobs earns next to nothing (min(k, n) / max(k, n) gave such images 0.4-0.6).
   * ``position`` = for a relation, the share of (a, b) blob pairs whose centroids satisfy it
     with a margin of ``position_margin`` px along its axis; for one group, 1 when the group is
     matched at all (no relation to get wrong, but an empty image still scores 0).

Shape is not scored: at 32 px a circle, a square and a triangle differ by a few edge pixels,
and a rule-based shape test on blurry generated blobs is noise. Groups of a relational prompt
have different colours by construction of the grammar (see ``world``), which is what lets
colour identify the group.
"""
from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F

from trainer.rewards.base import RewardScorer, check_score_inputs
from trainer.toy import world

_COLOR_NAMES = tuple(world.COLORS)


def connected_components(mask: torch.Tensor, *, check_every: int = 4) -> torch.Tensor:
    """8-connected component labels of a bool mask [N, H, W] -> int64 [N, H, W], 0 = off.

    Each on-pixel starts with its own id (flat index + 1) and takes the max over its 3x3
    neighbourhood until nothing changes; ids stay unique per plane, so float32 max-pooling is
    exact up to 2^24 pixels. Convergence is checked every ``check_every`` rounds (one host
    sync each); compact blobs of a 32 px image settle in under 10 rounds.
    """
    n, h, w = mask.shape
    if h * w >= 2 ** 24:
        raise ValueError(f"image of {h}x{w} pixels is too large for float32 labels")
    ids = torch.arange(1, h * w + 1, device=mask.device, dtype=torch.float32).view(1, h, w)
    labels = torch.where(mask, ids, torch.zeros((), device=mask.device)).unsqueeze(1)
    on = mask.unsqueeze(1)
    for it in range(h * w):
        nxt = torch.where(on, F.max_pool2d(labels, 3, stride=1, padding=1), labels)
        if (it + 1) % check_every == 0 and torch.equal(nxt, labels):  # host sync
            break
        labels = nxt
    return labels.squeeze(1).long()


class ToyCompositionScorer(RewardScorer):
    """Scores toy-world images against their prompts; no learned weights.

    Args:
        min_blob_fraction: blobs smaller than this share of the image are noise (0.006 is
            6 px at 32x32, under the smallest rendered object).
        max_color_distance: RGB distance beyond which a pixel is background even if a palette
            colour is its nearest: low enough that decoded noise yields almost no blobs, high
            enough that rendered truth (colour jitter +-12) scores 1.0 (figures:
            bench/reports/2026-12-04_cpu-h200_comment-figures.md).
        position_margin: pixels by which centroids must be apart along the relation's axis.
        device: where to score (default: the images' device).
    """

    components: ClassVar[tuple[str, ...]] = ("color", "count", "position")
    required_tracks: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, *, min_blob_fraction: float = 0.006, max_color_distance: float = 70.0,
                 position_margin: float = 0.5, device: str | torch.device | None = None) -> None:
        problems = []
        if not 0.0 <= min_blob_fraction < 1.0:
            problems.append(f"min_blob_fraction={min_blob_fraction} not in [0, 1)")
        if max_color_distance <= 0:
            problems.append(f"max_color_distance={max_color_distance} must be > 0")
        if position_margin < 0:
            problems.append(f"position_margin={position_margin} must be >= 0")
        if problems:
            raise ValueError("ToyCompositionScorer: " + "; ".join(problems))
        self.min_blob_fraction = min_blob_fraction
        self.max_color_distance = max_color_distance
        self.position_margin = position_margin
        self.device = None if device is None else torch.device(device)

    # ---- input checks -----------------------------------------------------------------
    def _specs(self, images: Any, prompts: Sequence[str],
               metadata: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
        # The shared batch checks (images, prompts, metadata lengths), then the specs: every
        # problem of both goes into the one error.
        problems = []
        try:
            check_score_inputs(images, prompts, metadata or [{} for _ in prompts])
        except ValueError as exc:
            problems.append(str(exc))
        specs: list[dict[str, Any]] = []
        for i, prompt in enumerate(prompts):
            meta = metadata[i] if metadata and i < len(metadata) else None
            spec = meta.get("spec") if isinstance(meta, dict) else None
            if spec is None:
                try:
                    spec = world.parse_prompt(prompt)
                except ValueError as exc:
                    problems.append(f"sample {i}: no metadata spec and {exc}")
                    continue
            bad = world.validate_spec(spec)
            if bad:
                problems.append(f"sample {i}: " + "; ".join(bad))
            specs.append(spec)
        if problems:
            raise ValueError("ToyCompositionScorer.score: " + "; ".join(problems))
        return specs

    # ---- blobs ------------------------------------------------------------------------
    def blobs(self, images: torch.Tensor, min_blob_fraction: float | None = None
              ) -> list[list[tuple[str, float, float, float]]]:
        """Per image, the kept blobs as (colour, area px, centroid x, centroid y): those of at
        least ``min_blob_fraction`` of the image (default: the scorer's)."""
        device = self.device or images.device
        x = images.to(device=device, dtype=torch.float32)
        b, h, w, _ = x.shape
        palette = torch.tensor([world.BACKGROUND] + [world.COLORS[c] for c in _COLOR_NAMES],
                               dtype=torch.float32, device=device)
        # Squared distances of integer RGB values are exact in fp32 (< 2^24), so the pixel
        # classes, and every score, are identical on CPU and GPU (cdist's matmul path is not).
        dist2 = (x.view(b, h * w, 1, 3) - palette).square().sum(-1)  # [B, HW, K+1]
        best, cls = dist2.min(dim=-1)
        cls = torch.where(best <= self.max_color_distance ** 2, cls, torch.zeros_like(cls))
        k = len(_COLOR_NAMES)
        masks = cls.view(b, 1, h, w) == torch.arange(1, k + 1, device=device).view(1, k, 1, 1)
        labels = connected_components(masks.view(b * k, h, w)).view(b * k, h * w)
        plane = torch.arange(b * k, device=device).view(-1, 1).expand_as(labels)
        on = labels > 0
        keys = plane[on] * (h * w + 1) + labels[on]
        uniq, inverse, area = torch.unique(keys, return_inverse=True, return_counts=True)
        pix = torch.arange(h * w, device=device).expand(b * k, -1)[on]
        cx = torch.zeros(len(uniq), device=device).index_add_(0, inverse, (pix % w).float())
        cy = torch.zeros(len(uniq), device=device).index_add_(0, inverse, (pix // w).float())
        area_f = area.float()
        table = torch.stack([(uniq // (h * w + 1)).float(), area_f,
                             cx / area_f + 0.5, cy / area_f + 0.5], dim=1).cpu()  # host sync
        floor = self.min_blob_fraction if min_blob_fraction is None else min_blob_fraction
        min_area = floor * h * w
        out: list[list[tuple[str, float, float, float]]] = [[] for _ in range(b)]
        for p, a, bx, by in table.tolist():
            if a >= min_area:
                out[int(p) // k].append((_COLOR_NAMES[int(p) % k], a, bx, by))
        return out

    # ---- components -------------------------------------------------------------------
    def _score_one(self, spec: dict[str, Any], blobs: list[tuple[str, float, float, float]]
                   ) -> tuple[float, float, float]:
        groups = spec["objects"]
        by_color: dict[str, list[tuple[float, float, float]]] = {}
        for color, a, bx, by in blobs:
            by_color.setdefault(color, []).append((a, bx, by))
        requested = {g["color"] for g in groups}
        matched: list[str | None] = [g["color"] if g["color"] in by_color else None
                                     for g in groups]
        spare = sorted((c for c in by_color if c not in requested),
                       key=lambda c: -sum(a for a, _, _ in by_color[c]))
        for i, m in enumerate(matched):
            if m is None and spare:
                matched[i] = spare.pop(0)
        total_area = sum(a for _, a, _, _ in blobs)
        purity = (sum(a for c, a, _, _ in blobs if c in requested) / total_area
                  if total_area > 0 else 0.0)
        color = purity * sum(m == g["color"] for m, g in zip(matched, groups)) / len(groups)
        count = 0.0
        for m, g in zip(matched, groups):
            k = len(by_color[m]) if m is not None else 0
            count += 0.5 ** abs(k - g["count"]) if k else 0.0
        count /= len(groups)
        if any(m is None for m in matched):
            position = 0.0
        elif spec["relation"] is None:
            position = 1.0
        else:
            position = self._relation_share(spec["relation"], by_color[matched[0]],
                                            by_color[matched[1]])
        return color, count, position

    def _relation_share(self, relation: str, first, second) -> float:
        axis = 1 if relation in ("left of", "right of") else 2
        sign = 1.0 if relation in ("left of", "above") else -1.0   # image y grows downwards
        ok = sum(sign * (b[axis] - a[axis]) > self.position_margin for a in first for b in second)
        return ok / (len(first) * len(second))

    def score(self, images: torch.Tensor, prompts: Sequence[str],
              metadata: Sequence[dict[str, Any]] | None = None) -> dict[str, torch.Tensor]:
        """images uint8 [B, H, W, 3] -> {"color", "count", "position"}: fp32 [B] in [0, 1].

        The spec comes from ``metadata[i]["spec"]`` when present, else from parsing the prompt.
        Results are on the images' device.
        """
        specs = self._specs(images, prompts, metadata)
        per_image = [self._score_one(s, bl) for s, bl in zip(specs, self.blobs(images))]
        scores = torch.tensor(per_image, dtype=torch.float32).view(len(specs), 3)
        # this class's three, also when a subclass scores more components
        return {name: scores[:, j].to(images.device)
                for j, name in enumerate(ToyCompositionScorer.components)}

    __call__ = score
