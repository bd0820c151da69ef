"""lab/toy/toy_count_errors.py: the count error table and the area ratios it reports."""
from __future__ import annotations

from toy_count_errors import count_errors


def _spec(*groups):
    return {"objects": [{"count": n, "color": c, "shape": "circle"} for n, c in groups],
            "relation": None if len(groups) == 1 else "left of"}


def test_count_errors_tabulates_found_minus_asked_and_area_per_object():
    specs = [_spec((1, "red")), _spec((1, "blue")), _spec((3, "red"), (1, "green")),
             _spec((2, "yellow")), _spec((1, "red"))]
    blobs = [[("red", 20.0, 1, 1)],                       # exact lone object: 20 px
             [("blue", 30.0, 1, 1)],                      # exact lone object: 30 px
             [("red", 25.0, 1, 1), ("green", 40.0, 5, 5)],  # 3 asked, 1 found: short
             [("yellow", 50.0, 1, 1), ("yellow", 50.0, 9, 9)],  # exact pair
             []]                                          # nothing drawn
    out = count_errors(specs, blobs)
    assert out["found_minus_asked"] == {1: {-1: 1, 0: 3}, 2: {0: 1}, 3: {-2: 1}}
    assert out["lone_object_area_px"] == 30.0       # median of 20, 30, 40
    assert out["short_groups"] == 1
    assert out["area_per_object_short"] == round(25.0 / (3 * 30.0), 3)
    # exact groups: 20/30, 30/30, 40/30, 100/60 -> median of (0.667, 1.0, 1.333, 1.667)
    assert out["area_per_object_exact"] == round((1.0 + 40.0 / 30.0) / 2, 3)
