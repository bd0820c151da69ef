"""bench/profile_train.py's trace arithmetic (the capture itself needs a GPU)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench")]

import profile_train  # noqa: E402


def test_busy_time_is_the_union_of_overlapping_intervals():
    assert profile_train.busy_us([]) == 0.0
    assert profile_train.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17.0


def test_idle_gaps_lists_each_gap_with_the_cpu_ranges_open_then():
    def kernel(ts, dur, name="k"):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name}

    trace = {"traceEvents": [
        kernel(0, 100), kernel(150, 100),             # 50 us: below the threshold
        kernel(1000, 100, "after_gap"),               # 750 us idle from t=250
        kernel(1050, 500), kernel(1200, 10),          # overlapping: no gap
        kernel(2000, 10, "late"),                     # 450 us idle from t=1550
        {"ph": "X", "cat": "cpu_op", "ts": 200, "dur": 900, "name": "Optimizer.step"},
        {"ph": "X", "cat": "cpu_op", "ts": 240, "dur": 20, "name": "too_short"},
    ]}
    lines = profile_train.idle_gaps(trace)
    assert lines[0] == "2 gaps over 0.3 ms, 1.2 ms in all"
    assert "idle  0.75 ms" in lines[1] and "'after_gap'" in lines[1]
    assert "Optimizer.step" in lines[1] and "too_short" not in lines[1]
    assert "idle  0.45 ms" in lines[2] and "'late'" in lines[2] and "cpu: []" in lines[2]
