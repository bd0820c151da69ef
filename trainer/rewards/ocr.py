"""OCR reward (Flow-GRPO's text-rendering reward): how well the image spells the prompt's
quoted text.

    reward = 1 - min(d, n) / n

where the target is the text between the prompt's first pair of double quotes and the
recognised text is every OCR segment above ``min_confidence`` joined, both lowercased with all
whitespace removed; n is the target's length and d the edit (Levenshtein) distance between
them, taken as 0 when the target occurs inside the recognised text (extra text around a
correct rendering costs nothing) and capped at n (a page of unrelated text scores 0, not
below). A prompt without quoted text scores NaN: there is nothing to read.

Engine: ``engine = "rapidocr"`` (default) runs RapidOCR on onnxruntime, whose PyPI wheel
ships its detection and recognition models (``pip install 'flowgrpo-trainer[ocr]'``; nothing
is downloaded at run time). Any other value is the dotpath of a factory ``make() -> ocr`` with
``ocr(image: uint8 HxWx3 numpy) -> [(text, confidence), ...]`` (e.g. a PaddleOCR wrapper).

The edit distance is written out here (a textbook dynamic programme over short strings) so
the reward's formula needs no extra package and is tested wherever the trainer runs.
"""
from __future__ import annotations

import importlib.util
import math
import re
from typing import Any, Callable, ClassVar

import torch

from trainer.rewards.base import RewardScorer, load_object

_QUOTED = re.compile(r'"([^"]*)"')
_SPACE = re.compile(r"\s+")


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def quoted_text(prompt: str) -> str | None:
    m = _QUOTED.search(prompt)
    return m.group(1) if m else None


def ocr_reward(target: str | None, recognised: str) -> float:
    """The formula of the module docstring; NaN without a target."""
    if target is None:
        return math.nan
    target = _SPACE.sub("", target).lower()
    recognised = _SPACE.sub("", recognised).lower()
    if not target:
        return math.nan
    dist = 0 if target in recognised else min(edit_distance(recognised, target), len(target))
    return 1.0 - dist / len(target)


def _rapidocr() -> Callable[[Any], list[tuple[str, float]]]:
    from rapidocr_onnxruntime import RapidOCR  # optional dependency (the [ocr] extra)
    engine = RapidOCR()

    def read(image) -> list[tuple[str, float]]:
        result, _ = engine(image)
        return [(str(text), float(conf)) for _, text, conf in (result or [])]
    return read


class OCRScorer(RewardScorer):
    """Options: ``engine`` ("rapidocr" or a factory dotpath), ``min_confidence`` (segments at
    or below it are ignored; Flow-GRPO keeps every segment with confidence > 0)."""

    components: ClassVar[tuple[str, ...]] = ("ocr",)

    def __init__(self, *, engine: str = "rapidocr", min_confidence: float = 0.0,
                 device: str | torch.device | None = None) -> None:
        problems = self.check_options(engine=engine, min_confidence=min_confidence)
        if problems:
            raise ValueError("; ".join(problems))
        self.engine_name = engine
        self.min_confidence = float(min_confidence)
        self.read = _rapidocr() if engine == "rapidocr" else load_object(engine, "ocr engine")()
        self.device = device

    @classmethod
    def check_options(cls, engine: str = "rapidocr", min_confidence: float = 0.0) -> list[str]:
        problems = []
        if engine == "rapidocr":
            if importlib.util.find_spec("rapidocr_onnxruntime") is None:
                problems.append("engine 'rapidocr' needs the rapidocr-onnxruntime package: "
                                "pip install 'flowgrpo-trainer[ocr]'")
        else:
            try:
                if not callable(load_object(engine, "ocr engine")):
                    problems.append(f"ocr engine {engine!r} is not callable")
            except ValueError as exc:
                problems.append(str(exc))
        if not isinstance(min_confidence, (int, float)) or isinstance(min_confidence, bool):
            problems.append(f"min_confidence={min_confidence!r} must be a number")
        return problems

    def recognise(self, image) -> str:
        return "".join(text for text, conf in self.read(image) if conf > self.min_confidence)

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        arrays = images.cpu().numpy()
        values = [ocr_reward(quoted_text(p), self.recognise(a) if quoted_text(p) else "")
                  for a, p in zip(arrays, prompts)]
        return {"ocr": torch.tensor(values, dtype=torch.float32)}
