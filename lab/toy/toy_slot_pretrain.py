"""Experiment: continue the toy model's pretraining in a world where count is a place.

    python lab/toy/toy_slot_pretrain.py --out DIR --init trainer/toy/weights --steps 600 \
        --batch 256 --threads 2 --warmup 50 --lr 5e-4 --ema 0.99 --caption-noise 0.4

Runs ``python -m trainer.toy.pretrain`` (same options) with the renderer's placement replaced
by ``slot_place``: each group's region is cut into three cells along its longer side and
object k of the group is drawn centred in cell k (a sub-pixel jitter along, one pixel across),
so "three objects" is mass in all three cells and "two" leaves the third empty. Asks whether
count becomes learnable by the policy gradient when it is an average direction in image
space, as position is (``bench/reports/2026-12-02_cpu_toy-count-gradient.md``); the shipped
world and model do not use it.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: trainer

from trainer.toy import world  # noqa: E402

CELLS = 3  # the largest count the grammar asks for


def slot_place(counts, regions, size, rng):
    """(group, cx, cy, half) per object: object k of a group centred in cell k of its region;
    the half-extent drawn as the renderer draws it, capped to fit the cell with the gap."""
    gap = size * world._GAP_FRACTION
    lo, hi = (f * size for f in world._HALF_EXTENT)
    placed = []
    for gi, (count, (x0, y0, x1, y1)) in enumerate(zip(counts, regions)):
        along_x = (x1 - x0) >= (y1 - y0)
        length, across = ((x1 - x0), (y1 - y0)) if along_x else ((y1 - y0), (x1 - x0))
        cell = length / CELLS
        for k in range(count):
            half = min(rng.uniform(lo, hi), cell / 2 - gap / 2 - 0.5, across / 2 - 0.5)
            along = (x0 if along_x else y0) + cell * (k + 0.5) + rng.uniform(-0.75, 0.75)
            mid = ((y0 + y1) / 2 if along_x else (x0 + x1) / 2) + rng.uniform(-1.0, 1.0)
            placed.append((gi, along, mid, half) if along_x else (gi, mid, along, half))
    return placed


def main(argv=None) -> int:
    world._place = slot_place  # the experiment's one change: this process renders in slots
    from trainer.toy.pretrain import main as pretrain_main
    return pretrain_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
