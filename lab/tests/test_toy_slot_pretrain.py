"""lab/toy/toy_slot_pretrain.py: object k of a group is drawn in cell k of its region."""
from __future__ import annotations

import numpy as np

from toy_slot_pretrain import CELLS, slot_place
from trainer.toy import world


def test_slot_place_puts_object_k_in_cell_k_of_its_region():
    size, rng = 32, np.random.default_rng(0)
    for relation, counts in ((None, [3]), ("left of", [2, 3]), ("above", [3, 1])):
        for _ in range(20):
            regions = world._regions(relation, size, rng)
            placed = slot_place(counts, regions, size, rng)
            assert [g for g, *_ in placed] == [g for g, n in enumerate(counts) for _ in range(n)]
            k_of_group = {}
            for gi, cx, cy, half in placed:
                k = k_of_group.get(gi, 0)
                k_of_group[gi] = k + 1
                x0, y0, x1, y1 = regions[gi]
                along_x = (x1 - x0) >= (y1 - y0)
                start, length = (x0, x1 - x0) if along_x else (y0, y1 - y0)
                pos = cx if along_x else cy
                cell = length / CELLS
                assert start + k * cell <= pos - half and pos + half <= start + (k + 1) * cell
                assert x0 <= cx - half and cx + half <= x1 and y0 <= cy - half and cy + half <= y1
