"""What the toy model gets wrong about count: per asked count, blobs found minus asked, and
the colour's total area in the groups that come out short.

    python lab/toy/toy_count_errors.py [--model DIR] [--prompts 256] [--out FILE.json]

Samples one image per held-out prompt with the eval's sampler (ODE, 10 steps, seed 0) and
reads the blobs as the reward does. ``area_per_object`` is the group colour's total blob area
over (count asked x the median area of a lone object drawn as one blob): well under 1 in the
short groups means objects are missing; about 1 or more would mean they merged.
"""
from __future__ import annotations

import argparse
import statistics
from collections import Counter

from toy_diagnostics import print_and_save, sample_on_cpu
from trainer.toy import world
from trainer.toy.reward import ToyCompositionScorer


def count_errors(specs: list[dict], blobs: list[list[tuple[str, float, float, float]]]) -> dict:
    """Per asked count n: {found - n: groups}; the median lone-object area; the median
    area_per_object (module docstring) of the short groups and of the exact ones."""
    table: dict[int, Counter] = {}
    groups = []  # (asked, areas of the group colour's blobs)
    for spec, found in zip(specs, blobs):
        for g in spec["objects"]:
            areas = [a for color, a, _, _ in found if color == g["color"]]
            table.setdefault(g["count"], Counter())[len(areas) - g["count"]] += 1
            groups.append((g["count"], areas))
    lone = [areas[0] for n, areas in groups if n == 1 and len(areas) == 1]
    single = statistics.median(lone) if lone else float("nan")

    def per_object(keep) -> float | None:
        ratios = [sum(areas) / (n * single) for n, areas in groups if keep(n, len(areas))]
        return round(statistics.median(ratios), 3) if ratios else None

    return {"found_minus_asked": {n: dict(sorted(c.items())) for n, c in sorted(table.items())},
            "lone_object_area_px": single,
            "short_groups": sum(0 < len(a) < n for n, a in groups),
            "area_per_object_short": per_object(lambda n, k: 0 < k < n),
            "area_per_object_exact": per_object(lambda n, k: k == n)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="toy model directory (default: shipped)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    records = world.make_prompt_records(args.prompts, seed=11, split="eval")
    prompts = [r["prompt"] for r in records]
    metadata = [r["metadata"] for r in records]
    images = sample_on_cpu(args.model, prompts, [m["sample_id"] for m in metadata])
    scorer = ToyCompositionScorer()
    result = {"args": vars(args), **count_errors(scorer._specs(images, prompts, metadata),
                                                 scorer.blobs(images))}
    print_and_save(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
