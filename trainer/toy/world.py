"""The toy world: a prompt grammar over shapes, colours, counts and relations, and a renderer.

A prompt names one or two *groups* of identical objects::

    "a red circle"                                   (single group)
    "three yellow triangles"                         (single group, counted)
    "two red circles left of a blue square"          (two groups and a relation)

Every prompt has a structured ``spec`` (JSON-serialisable, what the reward reads)::

    {"objects": [{"count": 2, "color": "red", "shape": "circle"},
                 {"count": 1, "color": "blue", "shape": "square"}],
     "relation": "left of"}          # objects[0] <relation> objects[1]; None for one group

Design choices where the brief is silent:

* The two groups of a relational prompt always have *different colours*: the reward finds
  groups by colour (shape at 32 px is a handful of pixels), so "a red circle left of a red
  square" would be unscorable. Shapes may repeat across groups.
* Train/eval split is a stable hash of the prompt text (as ``data curate`` splits, never an
  RNG), so the eval prompts are never seen in training and every run gets the same split.
* Relational and single-group prompts are drawn with fixed odds (``SINGLE_FRACTION``) rather
  than uniformly over the 3,924 prompts, where single-group prompts would be 1 %.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 45, 45),
    "green": (50, 175, 70),
    "blue": (50, 90, 230),
    "yellow": (235, 205, 40),
}
BACKGROUND: tuple[int, int, int] = (0, 0, 0)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three"}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
OPPOSITE_RELATION: dict[str, str] = {
    "left of": "right of", "right of": "left of", "above": "below", "below": "above"}

SINGLE_FRACTION = 0.3      # share of single-group prompts in make_prompt_records
EVAL_FRACTION = 0.15       # share of prompts (by stable hash) held out for eval
SPLITS = ("train", "eval")

# Object half-extent as a fraction of the image side: 32 px images get objects 6-9 px across,
# which leaves room for six objects with a 2 px gap and keeps each over the reward's min area.
_HALF_EXTENT = (0.09, 0.14)
_GAP_FRACTION = 0.06       # minimum background gap between two objects' boxes
_SUPERSAMPLE = 4           # draw at 4x and box-filter down: smooth, anti-aliased edges
_COLOR_JITTER = 12         # +- per channel and object, so the model sees a colour *range*


# ---- grammar ------------------------------------------------------------------------------

def _plural(shape: str, count: int) -> str:
    return shape if count == 1 else shape + "s"


def group_phrase(group: dict[str, Any]) -> str:
    return f"{COUNT_WORDS[group['count']]} {group['color']} {_plural(group['shape'], group['count'])}"


def spec_to_prompt(spec: dict[str, Any]) -> str:
    """The canonical prompt text of a spec (inverse of ``parse_prompt``)."""
    objs = spec["objects"]
    if len(objs) == 1:
        return group_phrase(objs[0])
    return f"{group_phrase(objs[0])} {spec['relation']} {group_phrase(objs[1])}"


def vocabulary() -> list[str]:
    """Every word any prompt can contain, in a fixed order (the tokenizer's vocabulary)."""
    words = list(COUNT_WORDS.values()) + list(COLORS)
    words += [w for s in SHAPES for w in (s, s + "s")]
    for rel in RELATIONS:
        words += [w for w in rel.split() if w not in words]
    return words


def all_specs() -> list[dict[str, Any]]:
    """Every prompt of the world as a spec, in a fixed order (36 single + 3,888 relational)."""
    groups = [{"count": n, "color": c, "shape": s}
              for n in COUNT_WORDS for c in COLORS for s in SHAPES]
    specs: list[dict[str, Any]] = [{"objects": [g], "relation": None} for g in groups]
    for a in groups:
        for rel in RELATIONS:
            for b in groups:
                if b["color"] != a["color"]:
                    specs.append({"objects": [a, b], "relation": rel})
    return specs


def _parse_group(words: list[str]) -> dict[str, Any] | None:
    if len(words) != 3:
        return None
    count = {w: n for n, w in COUNT_WORDS.items()}.get(words[0])
    if count is None or words[1] not in COLORS:
        return None
    shape = words[2] if count == 1 else words[2][:-1] if words[2].endswith("s") else None
    if shape not in SHAPES or _plural(shape, count) != words[2]:
        return None
    return {"count": count, "color": words[1], "shape": shape}


def parse_prompt(prompt: str) -> dict[str, Any]:
    """Spec of a prompt of this world; ValueError if the text is not in the grammar."""
    words = prompt.strip().lower().split()
    if len(words) == 3 and (g := _parse_group(words)) is not None:
        return {"objects": [g], "relation": None}
    for rel in RELATIONS:
        n = len(rel.split())
        if len(words) == 6 + n and " ".join(words[3:3 + n]) == rel:
            a, b = _parse_group(words[:3]), _parse_group(words[3 + n:])
            if a is not None and b is not None and a["color"] != b["color"]:
                return {"objects": [a, b], "relation": rel}
    raise ValueError(f"not a toy-world prompt: {prompt!r}")


def validate_spec(spec: Any) -> list[str]:
    """Every problem with a spec (empty list when it is valid)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("objects"), list):
        return ["spec must be a dict with an 'objects' list"]
    problems = []
    objs, rel = spec["objects"], spec.get("relation")
    if len(objs) not in (1, 2):
        problems.append(f"spec has {len(objs)} object groups, expected 1 or 2")
    for i, g in enumerate(objs):
        if not isinstance(g, dict):
            problems.append(f"objects[{i}] is not a dict")
            continue
        if g.get("count") not in COUNT_WORDS:
            problems.append(f"objects[{i}].count={g.get('count')!r} not in {sorted(COUNT_WORDS)}")
        if g.get("color") not in COLORS:
            problems.append(f"objects[{i}].color={g.get('color')!r} not in {list(COLORS)}")
        if g.get("shape") not in SHAPES:
            problems.append(f"objects[{i}].shape={g.get('shape')!r} not in {list(SHAPES)}")
    if len(objs) == 2:
        if rel not in RELATIONS:
            problems.append(f"relation={rel!r} not in {list(RELATIONS)}")
        if all(isinstance(g, dict) for g in objs) and objs[0].get("color") == objs[1].get("color"):
            problems.append("the two object groups must have different colours")
    elif len(objs) == 1 and rel is not None:
        problems.append(f"a single-group spec has relation={rel!r}, expected None")
    return problems


# ---- split and records --------------------------------------------------------------------

def _stable_unit(text: str) -> float:
    """A number in [0, 1) from sha256 (never Python's salted hash())."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0 ** 64


def prompt_split(prompt: str) -> str:
    return "eval" if _stable_unit("toy-split:" + prompt) < EVAL_FRACTION else "train"


def split_specs(split: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(single-group specs, relational specs) of one split, in the fixed world order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    specs = [s for s in all_specs() if prompt_split(spec_to_prompt(s)) == split]
    return [s for s in specs if s["relation"] is None], [s for s in specs if s["relation"]]


def make_prompt_records(n: int, *, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """``n`` prompt records of one split in the project's unified JSONL schema.

    Each record is ``{"prompt", "metadata": {"task": "t2i", "sample_id", "spec"}}``. Single
    and relational prompts are drawn with odds ``SINGLE_FRACTION``; within a kind, prompts come
    from a seeded shuffle of the split's pool without repeats until the pool is used up, then
    a fresh shuffle (so small eval sets have distinct prompts). Pure function of (n, seed, split).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    singles, pairs = split_specs(split)
    rng = random.Random(f"toy-records:{split}:{seed}")
    pools: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    records = []
    for i in range(n):
        single = rng.random() < SINGLE_FRACTION
        if not pools[single]:
            pools[single] = list(singles if single else pairs)
            rng.shuffle(pools[single])
        spec = pools[single].pop()
        records.append({
            "prompt": spec_to_prompt(spec),
            "metadata": {"task": "t2i", "sample_id": f"toy-{split}-s{seed}-{i:06d}",
                         "spec": spec},
        })
    return records


# ---- caption noise ------------------------------------------------------------------------

CAPTION_FACTS = ("count", "color", "relation")


def corrupt_spec(spec: dict[str, Any], rate: float, rng: np.random.Generator,
                 facts: tuple[str, ...] = CAPTION_FACTS) -> dict[str, Any]:
    """A spec that departs from ``spec`` the way a web caption departs from its image: each
    group's count and colour, and the relation, is independently replaced by another valid
    value with probability ``rate`` (the result is always a valid spec of this world); only
    the ``facts`` named are ever replaced.

    Pretraining on (prompt, render of a corrupted spec) pairs gives a model that draws what the
    prompt asks only part of the time, like a real text-to-image base model: the samples of
    one prompt then differ in what the reward checks, which is what RL learns from.
    """
    objs = [dict(g) for g in spec["objects"]]
    for g in objs:
        if "count" in facts and rng.random() < rate:
            g["count"] = int(rng.choice([n for n in COUNT_WORDS if n != g["count"]]))
    for g in objs:
        if "color" in facts and rng.random() < rate:
            taken = {o["color"] for o in objs}  # groups keep different colours
            g["color"] = str(rng.choice([c for c in COLORS if c not in taken]))
    relation = spec["relation"]
    if "relation" in facts and relation is not None and rng.random() < rate:
        relation = OPPOSITE_RELATION[relation]
    return {"objects": objs, "relation": relation}


# ---- renderer -----------------------------------------------------------------------------

def _regions(relation: str | None, size: int, rng: np.random.Generator
             ) -> list[tuple[float, float, float, float]]:
    """Per group, the (x0, y0, x1, y1) box its objects' centres-and-extents must lie in.

    For a relation the image is cut at a jittered line along the relation's axis, with a gap,
    so that every object of group 0 is strictly on the named side of every object of group 1.
    """
    full = (0.0, 0.0, float(size), float(size))
    if relation is None:
        return [full]
    cut = size * (0.5 + rng.uniform(-0.1, 0.1))
    half_gap = size * _GAP_FRACTION / 2
    low, high = (0.0, cut - half_gap), (cut + half_gap, float(size))
    first, second = (low, high) if relation in ("left of", "above") else (high, low)
    if relation in ("left of", "right of"):
        return [(first[0], 0.0, first[1], size), (second[0], 0.0, second[1], size)]
    return [(0.0, first[0], size, first[1]), (0.0, second[0], size, second[1])]


def _place(counts: list[int], regions, size: int, rng: np.random.Generator):
    """Rejection-sample non-overlapping boxes (cx, cy, half) per object; shrink if crowded."""
    gap = size * _GAP_FRACTION
    lo, hi = (f * size for f in _HALF_EXTENT)
    for attempt in range(200):
        scale = 1.0 - 0.3 * min(attempt / 100, 1.0)
        placed: list[tuple[int, float, float, float]] = []
        ok = True
        for gi, (count, (x0, y0, x1, y1)) in enumerate(zip(counts, regions)):
            for _ in range(count):
                for _try in range(50):
                    half = rng.uniform(lo, hi) * scale
                    if x1 - x0 < 2 * half + 1 or y1 - y0 < 2 * half + 1:
                        continue
                    cx = rng.uniform(x0 + half + 0.5, x1 - half - 0.5)
                    cy = rng.uniform(y0 + half + 0.5, y1 - half - 0.5)
                    if all(max(abs(cx - px), abs(cy - py)) >= half + ph + gap
                           for _, px, py, ph in placed):
                        placed.append((gi, cx, cy, half))
                        break
                else:
                    ok = False
                    break
            if not ok:
                break
        if ok:
            return placed
    raise RuntimeError(f"could not place {counts} objects in a {size}px image")


def render(spec: dict[str, Any], size: int, rng: np.random.Generator) -> np.ndarray:
    """Draw an image matching ``spec``: uint8 [size, size, 3] on a black background.

    Random object size, position and colour jitter (``rng``, a numpy Generator); groups of a
    relational spec sit on the named sides of a jittered cut line (see ``_regions``).
    """
    problems = validate_spec(spec)
    if problems:
        raise ValueError("invalid toy spec: " + "; ".join(problems))
    if size < 16:
        raise ValueError(f"size must be >= 16 px, got {size}")
    objs = spec["objects"]
    boxes = _place([g["count"] for g in objs], _regions(spec["relation"], size, rng), size, rng)
    s = _SUPERSAMPLE
    canvas = Image.new("RGB", (size * s, size * s), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for gi, cx, cy, half in boxes:
        group = objs[gi]
        jitter = rng.integers(-_COLOR_JITTER, _COLOR_JITTER + 1, size=3)
        color = tuple(int(v) for v in np.clip(np.array(COLORS[group["color"]]) + jitter, 0, 255))
        x0, y0, x1, y1 = ((cx - half) * s, (cy - half) * s, (cx + half) * s, (cy + half) * s)
        if group["shape"] == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=color)
        elif group["shape"] == "square":
            draw.rectangle((x0, y0, x1, y1), fill=color)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=color)
    canvas = canvas.resize((size, size), Image.Resampling.BOX)
    return np.asarray(canvas, dtype=np.uint8).copy()
