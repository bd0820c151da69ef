"""GenEval-style compositional reward from a detector the user supplies.

Each prompt's metadata (GenEval's ``metadata.jsonl``, kept by ``data prepare``) lists what the
image must hold: ``include`` = [{"class": "dog", "count": 2, "color": "red",
"position": ["left of", 0]}, ...] (``color`` and ``position`` optional; ``position`` relates
this object to the objects of ``include[index]``) and ``exclude`` = [{"class": "cat",
"count": 1}] (fewer than ``count`` such objects allowed).

Rules, as GenEval evaluates them: detections below ``threshold`` are dropped; an include
passes when at least ``count`` detections of its class (and colour, when asked) exist, and,
with a position, when one of them stands in that relation to one object of the target
include; an exclude passes when fewer than ``count`` of its class are found. Relation of A to
B: the centre offset, shrunk on each axis by ``position_margin`` times the two boxes' summed
size and renormalised; "left of"/"right of" when its x component is below -0.5/above 0.5,
"above"/"below" likewise in y (image y grows downwards).

``mode = "strict"`` (default): 1 when every requirement passes, else 0 (GenEval's accuracy).
``mode = "partial"``: the fraction of requirements that pass (a denser signal for RL).
A sample without ``include`` metadata scores NaN.

No detector works out of the box: we found no PyPI package that ships a COCO detector's
weights inside its wheel (ultralytics, yolov5, torchvision's detection models, effdet,
mmdetection and the open-vocabulary detectors all download weights at first use, which a run
here never does; mediapipe's wheel holds a label map but no detector model). Two ways in: the
Flow-GRPO reference's GenEval server (Mask2Former + CLIP colours) through the
``geneval_server`` scorer (``trainer.rewards.flowgrpo_server``), or a detector of your own:

``detector`` is the dotpath of a factory ``make(**detector_options) -> detect`` with
``detect(images uint8 [B, H, W, 3] tensor) -> per image a list of {"class": str,
"score": float, "box": [x0, y0, x1, y1] in pixels, "color": str (when the detector
classifies colour)}``: Mask2Former from mmdetection as GenEval uses it, an open-vocabulary
detector, or anything else.
"""
from __future__ import annotations

import math
from typing import Any, Callable, ClassVar

import torch

from trainer.rewards.base import RewardError, RewardScorer, load_object

RELATIONS = ("left of", "right of", "above", "below")
NO_DETECTOR = ("geneval needs detector = \"pkg.mod.make_detector\": no PyPI package we know "
               "ships a COCO detector's weights in its wheel (they download them), so none "
               "works out of the box; or use [reward.scorers.geneval_server], the Flow-GRPO "
               "reference's GenEval server")
MODES = ("strict", "partial")


def relations(box_a, box_b, margin: float) -> set[str]:
    """Spatial relations of box A to box B (see the module docstring)."""
    ca = ((box_a[0] + box_a[2]) / 2, (box_a[1] + box_a[3]) / 2)
    cb = ((box_b[0] + box_b[2]) / 2, (box_b[1] + box_b[3]) / 2)
    size = (abs(box_a[2] - box_a[0]) + abs(box_b[2] - box_b[0]),
            abs(box_a[3] - box_a[1]) + abs(box_b[3] - box_b[1]))
    offset = (ca[0] - cb[0], ca[1] - cb[1])
    norm = math.hypot(*offset)
    shrunk = [math.copysign(max(abs(o) - margin * s, 0.0), o) for o, s in zip(offset, size)]
    if norm == 0 or all(abs(v) < 1e-3 for v in shrunk):
        return set()
    dx, dy = shrunk[0] / norm, shrunk[1] / norm
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def _matches(detections: list[dict], req: dict) -> list[dict]:
    return [d for d in detections if d.get("class") == req["class"]
            and ("color" not in req or d.get("color") == req["color"])]


def requirement_results(detections: list[dict], include: list[dict], exclude: list[dict],
                        margin: float) -> list[bool]:
    """One pass/fail per include then per exclude requirement."""
    found = [_matches(detections, req) for req in include]
    results = []
    for req, objs in zip(include, found):
        ok = len(objs) >= int(req.get("count", 1))
        if ok and req.get("position"):
            relation, target = req["position"][0], int(req["position"][1])
            ok = any(relation in relations(a["box"], b["box"], margin)
                     for a in objs for b in found[target])
        results.append(ok)
    for req in exclude:
        results.append(len(_matches(detections, req)) < int(req.get("count", 1)))
    return results


class GenEvalScorer(RewardScorer):
    """Options: ``detector`` (factory dotpath, required), ``detector_options`` (dict for the
    factory), ``threshold`` (0.3), ``position_margin`` (0.1), ``mode`` (strict | partial)."""

    components: ClassVar[tuple[str, ...]] = ("geneval",)

    def __init__(self, *, detector: str | None = None, detector_options: dict | None = None,
                 threshold: float = 0.3, position_margin: float = 0.1, mode: str = "strict",
                 device: str | torch.device | None = None) -> None:
        problems = self.check_options(detector=detector, detector_options=detector_options,
                                      mode=mode)
        if problems:
            raise ValueError("; ".join(problems))
        self.detect: Callable = load_object(detector, "geneval detector")(
            **(detector_options or {}))
        self.threshold, self.margin, self.mode = float(threshold), float(position_margin), mode
        self.device = device

    @classmethod
    def check_options(cls, detector: str | None = None, detector_options: dict | None = None,
                      mode: str = "strict", **_: Any) -> list[str]:
        problems = []
        if not detector:
            problems.append(NO_DETECTOR)
        else:
            try:
                if not callable(load_object(detector, "geneval detector")):
                    problems.append(f"geneval detector {detector!r} is not callable")
            except ValueError as exc:
                problems.append(str(exc))
        if detector_options is not None and not isinstance(detector_options, dict):
            problems.append(f"detector_options={detector_options!r} must be a table")
        if mode not in MODES:
            problems.append(f"mode={mode!r}: choose one of {list(MODES)}")
        return problems

    def _one(self, detections: list[dict], meta: dict[str, Any], where: str) -> float:
        include = meta.get("include")
        if not include:
            return math.nan
        exclude = meta.get("exclude") or []
        for req in list(include) + list(exclude):
            if not isinstance(req, dict) or "class" not in req:
                raise RewardError(f"{where}: requirement {req!r} has no 'class'")
            pos = req.get("position")
            if pos and (pos[0] not in RELATIONS or not 0 <= int(pos[1]) < len(include)):
                raise RewardError(f"{where}: position {pos!r} must be [relation in "
                                  f"{list(RELATIONS)}, index of an include]")
        kept = [d for d in detections if float(d.get("score", 1.0)) >= self.threshold]
        results = requirement_results(kept, include, exclude, self.margin)
        if self.mode == "strict":
            return float(all(results))
        return sum(results) / len(results)

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        detections = list(self.detect(images))
        if len(detections) != len(prompts):
            raise RewardError(f"geneval detector returned {len(detections)} results for "
                              f"{len(prompts)} images")
        values = [self._one(list(d), m, f"sample {i} ({prompts[i]!r})")
                  for i, (d, m) in enumerate(zip(detections, metadata))]
        return {"geneval": torch.tensor(values, dtype=torch.float32)}
