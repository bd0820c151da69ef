"""One train stage of an Nsight Systems capture, in time order (read on any machine once the
capture is exported to SQLite; `bench/nsys_gaps.py` exports it on the GPU machine).

    python nsys_timeline.py CAPTURE.sqlite [--stage 1]                  # ranges and idle gaps
    python nsys_timeline.py CAPTURE.sqlite --stage 1 --window 5.5 12    # API calls, kernels

Times are milliseconds from the stage's start. The first form lists the stage's NVTX
sub-ranges and the GPU idle gaps of at least 0.1 ms; the second lists every CUDA API call the
host made in the window with the kernel it launched (when, how long), and the NVTX ranges
opened there.
"""
from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import nsys_gaps as gaps  # noqa: E402  (bench/nsys_gaps.py)


def stage(db, index: int):
    ranges = gaps.nvtx_ranges(db)
    lo, hi, _, tid = sorted(r for r in ranges if r[2].lstrip(":") == "train")[index]
    return ranges, lo, hi, tid


def outline(db, index: int) -> None:
    ranges, lo, hi, tid = stage(db, index)
    spans = gaps.gpu_intervals(db, gaps.tables(db))
    print(f"stage {(hi - lo) / 1e6:.2f} ms")
    for a, b, text, _ in sorted(r for r in ranges if r[3] == tid and lo <= r[0] and r[1] <= hi
                                and r[2].lstrip(":") != "train"):
        print(f"{(a - lo) / 1e6:8.2f} {(b - lo) / 1e6:8.2f} {(b - a) / 1e6:7.2f}  {text}")
    _, idle = gaps.busy_and_gaps(spans, lo, hi, 100_000)
    print("GPU idle >= 0.1 ms (start, length, innermost range):")
    for a, b in idle:
        print(f"  {(a - lo) / 1e6:8.2f} +{(b - a) / 1e6:6.2f}  {gaps.innermost(ranges, a, tid)}")


def window(db, index: int, start_ms: float, end_ms: float) -> None:
    ranges, lo, _, _ = stage(db, index)
    a, b = lo + int(start_ms * 1e6), lo + int(end_ms * 1e6)
    kernels = {c: (s, e, n) for s, e, n, c in db.execute(
        "SELECT k.start, k.end, s.value, k.correlationId FROM CUPTI_ACTIVITY_KIND_KERNEL k "
        "JOIN StringIds s ON s.id = k.shortName WHERE k.start >= ? AND k.start < ?",
        (a, b + 50_000_000))}
    events = [(s, f"NVTX {t} {(e - s) / 1e6:.2f} ms") for s, e, t, _ in ranges if a <= s < b]
    for s, e, name, corr in db.execute(
            "SELECT r.start, r.end, s.value, r.correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME r "
            "JOIN StringIds s ON s.id = r.nameId WHERE r.start >= ? AND r.start < ?", (a, b)):
        line = f"API  {name.split('_v')[0]:26s} {(e - s) / 1e3:7.1f} us"
        if corr in kernels:
            ks, ke, kn = kernels[corr]
            line += f"  -> {kn[:60]} @{(ks - lo) / 1e6:.2f} {(ke - ks) / 1e3:.1f} us"
        events.append((s, line))
    for s, text in sorted(events):
        print(f"{(s - lo) / 1e6:8.3f}  {text}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("capture", type=Path)
    p.add_argument("--stage", type=int, default=1, help="which train stage (0 = first)")
    p.add_argument("--window", type=float, nargs=2, metavar=("START_MS", "END_MS"))
    args = p.parse_args()
    db = sqlite3.connect(str(args.capture))
    if args.window:
        window(db, args.stage, *args.window)
    else:
        outline(db, args.stage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
