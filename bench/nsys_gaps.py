"""Where the GPU waits inside one NVTX range of an Nsight Systems capture (GPU machine).

    python bench/nsys_gaps.py CAPTURE.nsys-rep|CAPTURE.sqlite [--range train] [--gap-us 100]

Nsight Systems traces kernels, copies and CUDA API calls at a few microseconds each, so unlike
torch.profiler it leaves the host's speed nearly as it is: the idle time it shows is the
unprofiled run's. For every instance of the NVTX range (``:train`` is the trainer's train
stage), prints its wall time, the GPU busy time (union of kernels, copies and memsets of every
process), and the idle gaps longer than ``--gap-us``, each attributed to the innermost NVTX
range open on the range's thread when the gap began and to the CUDA API calls the host made
during it. A ``.nsys-rep`` is exported to SQLite first (``nsys export``, beside it).
"""
from __future__ import annotations

import argparse
import shutil
import sqlite3
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

GPU_TABLES = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
              "CUPTI_ACTIVITY_KIND_MEMSET")


def to_sqlite(path: Path, nsys: str) -> Path:
    if path.suffix == ".sqlite":
        return path
    out = path.with_suffix(".sqlite")
    subprocess.run([nsys, "export", "--type", "sqlite", "--force-overwrite", "true",
                    "-o", str(out), str(path)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return out


def tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def nvtx_ranges(db: sqlite3.Connection) -> list[tuple[int, int, str, int]]:
    """(start, end, text, thread) of every push/pop or start/end range."""
    rows = db.execute(
        "SELECT e.start, e.end, COALESCE(e.text, s.value), e.globalTid FROM NVTX_EVENTS e "
        "LEFT JOIN StringIds s ON s.id = e.textId WHERE e.end IS NOT NULL")
    return [(a, b, t or "?", tid) for a, b, t, tid in rows]


def gpu_intervals(db: sqlite3.Connection, names: set[str]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for table in GPU_TABLES:
        if table in names:
            spans += db.execute(f"SELECT start, end FROM {table}").fetchall()
    return sorted(spans)


def busy_and_gaps(spans: list[tuple[int, int]], lo: int, hi: int,
                  min_gap: int) -> tuple[int, list[tuple[int, int]]]:
    """GPU busy ns inside [lo, hi) and the idle gaps of at least ``min_gap`` ns."""
    busy, gaps, cursor = 0, [], lo
    for start, end in spans:
        if end <= cursor or start >= hi:
            continue
        start, end = max(start, cursor), min(end, hi)
        if start - cursor >= min_gap:
            gaps.append((cursor, start))
        busy += end - start
        cursor = end
    if hi - cursor >= min_gap:
        gaps.append((cursor, hi))
    return busy, gaps


def innermost(ranges: list[tuple[int, int, str, int]], at: int, tid: int) -> str:
    open_here = [r for r in ranges if r[3] == tid and r[0] <= at < r[1]]
    return min(open_here, key=lambda r: r[1] - r[0])[2] if open_here else "(none)"


def api_calls(db: sqlite3.Connection, names: set[str], lo: int, hi: int) -> dict[str, int]:
    """ns of each CUDA API call overlapping [lo, hi), clipped to it."""
    if "CUPTI_ACTIVITY_KIND_RUNTIME" not in names:
        return {}
    out: dict[str, int] = defaultdict(int)
    rows = db.execute(
        "SELECT r.start, r.end, s.value FROM CUPTI_ACTIVITY_KIND_RUNTIME r "
        "JOIN StringIds s ON s.id = r.nameId WHERE r.end > ? AND r.start < ?", (lo, hi))
    for start, end, name in rows:
        out[name.split("_v")[0]] += min(end, hi) - max(start, lo)
    return out


def report(db_path: Path, range_name: str, gap_us: float, top: int) -> str:
    db = sqlite3.connect(str(db_path))
    names = tables(db)
    ranges = nvtx_ranges(db)
    spans = gpu_intervals(db, names)
    lines = []
    for lo, hi, text, tid in sorted(r for r in ranges if r[2].lstrip(":") == range_name):
        busy, gaps = busy_and_gaps(spans, lo, hi, int(gap_us * 1000))
        idle = sum(b - a for a, b in gaps)
        lines.append(f"{text}: wall {(hi - lo) / 1e6:.1f} ms, GPU busy {busy / 1e6:.1f} ms, "
                     f"{len(gaps)} gaps >= {gap_us:.0f} us = {idle / 1e6:.1f} ms")
        by_range: dict[str, list[int]] = defaultdict(list)
        by_api: dict[str, int] = defaultdict(int)
        for a, b in gaps:
            by_range[innermost(ranges, a, tid)].append(b - a)
            for name, ns in api_calls(db, names, a, b).items():
                by_api[name] += ns
        lines.append("  idle by the innermost range open when the gap began (ms, gaps):")
        for name, lens in sorted(by_range.items(), key=lambda kv: -sum(kv[1]))[:top]:
            lines.append(f"    {sum(lens) / 1e6:7.2f}  {len(lens):4d}  {name}")
        lines.append("  CUDA API time inside the gaps (ms):")
        for name, ns in sorted(by_api.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {ns / 1e6:7.2f}  {name}")
    return "\n".join(lines) if lines else f"no NVTX range named {range_name!r}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("capture", type=Path)
    p.add_argument("--range", default="train", help="NVTX range name (leading ':' ignored)")
    p.add_argument("--gap-us", type=float, default=100.0)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--nsys", default=shutil.which("nsys") or "nsys")
    args = p.parse_args(argv)
    print(report(to_sqlite(args.capture, args.nsys), args.range, args.gap_us, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
