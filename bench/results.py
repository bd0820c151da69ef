"""Benchmark results as data: every bench script appends its figures as rows of one CSV.

    from bench.results import Recorder
    rec = Recorder("bench_rewards", device=device_name)
    rec.add("pickscore-bf16-256x384", "images_per_s", 1264.0, "images/s", samples=[...])
    rec.write()                                    # appends to $BENCH_RESULTS or bench/results.csv

One row is one figure: (bench, case, metric) names it, ``value`` is the figure (the median when
it was measured several times, then ``min`` / ``median`` / ``max`` hold the spread), and the
row carries where and how it was measured (device, torch, commit, date, command). The file is
only ever appended to, so the history of a figure is its rows in file order and the current
figure is the last one (``current``); ``bench/make_table.py`` renders the current figures into
bench/README.md and README.md.

Tests set ``BENCH_RESULTS`` (tests/conftest.py) so a smoke run never writes the repository's
file; the GPU entry point (bench/gpu.sh) points it at $OUT, whose rows ``python
bench/results.py merge FILE [--commit SHA]`` checks and appends here (a copy of the tree
without .git records its commit as "unrecorded" unless $BENCH_COMMIT names it).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Sequence

FIELDS = ("bench", "case", "metric", "value", "unit", "min", "median", "max",
          "device", "torch", "commit", "date", "command")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_PATH = REPO / "bench" / "results.csv"
# rows seeded from reports written before the harness existed carry no commit
UNRECORDED = "unrecorded"
_REQUIRED = ("bench", "case", "metric", "value", "unit", "device", "torch", "commit", "date",
             "command")
_NUMERIC = ("value", "min", "median", "max")


def results_path() -> Path:
    """Where rows go: $BENCH_RESULTS when set, else bench/results.csv."""
    return Path(os.environ.get("BENCH_RESULTS") or DEFAULT_PATH)


def git_commit(repo: Path = REPO) -> str:
    """$BENCH_COMMIT when set, else the checkout's short commit, with ``+dirty`` when the tree
    has uncommitted changes."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=10", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return UNRECORDED  # a copy of the tree without its .git (e.g. the device machine)
    return head + ("+dirty" if dirty else "") if head else UNRECORDED


def torch_version() -> str:
    try:
        import torch  # only the version string; the harness itself does not need torch
    except ImportError:
        return UNRECORDED
    return torch.__version__


def device_name(device: object = None) -> str:
    """A device's marketing name for a CUDA device ("NVIDIA H200"), else its type ("cpu")."""
    kind = getattr(device, "type", None) or str(device or "cpu").split(":")[0]
    if kind != "cuda":
        return kind
    import torch  # a CUDA device was named, so torch is there
    return torch.cuda.get_device_name(device)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed: ``python bench/x.py --flag ...`` relative to the repository."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(REPO))
        except ValueError:
            pass
    return shlex.join(["python", *argv])


def spread(samples: Iterable[float]) -> tuple[float, float, float]:
    values = sorted(float(v) for v in samples)
    if not values:
        raise ValueError("spread of no samples")
    return values[0], statistics.median(values), values[-1]


def _cell(value: float | None) -> str:
    return "" if value is None else f"{float(value):.6g}"


class Recorder:
    """Collects one bench run's rows and appends them in one write (a run that fails half-way
    leaves no partial table behind)."""

    def __init__(self, bench: str, *, device: str, command: str | None = None,
                 torch: str | None = None, commit: str | None = None,
                 date: str | None = None) -> None:
        self.context = {
            "bench": bench, "device": device,
            "torch": torch if torch is not None else torch_version(),
            "commit": commit if commit is not None else git_commit(),
            "date": date or datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            "command": command if command is not None else command_line(),
        }
        self.rows: list[dict[str, str]] = []

    def add(self, case: str, metric: str, value: float | None, unit: str, *,
            samples: Iterable[float] | None = None) -> dict[str, str] | None:
        """One figure; with ``samples`` the row also holds their min / median / max. A figure
        the run could not measure (None or NaN, e.g. peak GPU memory on the CPU) adds no row."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return None
        low = mid = high = None
        if samples is not None:
            low, mid, high = spread(samples)
        row = {**self.context, "case": case, "metric": metric, "value": _cell(value),
               "unit": unit, "min": _cell(low), "median": _cell(mid), "max": _cell(high)}
        problems = row_problems(row)
        if problems:
            raise ValueError(f"{self.context['bench']} row {case}/{metric}: " + "; ".join(problems))
        self.rows.append(row)
        return row

    def write(self, path: Path | str | None = None) -> Path:
        target = Path(path) if path is not None else results_path()
        append_rows(self.rows, target)
        return target


def row_problems(row: dict[str, str]) -> list[str]:
    """What is wrong with one row (empty when it is well-formed)."""
    problems = []
    if set(row) != set(FIELDS):
        missing, extra = set(FIELDS) - set(row), set(row) - set(FIELDS)
        problems.append(f"fields missing {sorted(missing)} / unknown {sorted(extra)}")
    for name in _REQUIRED:
        if not str(row.get(name) or "").strip():
            problems.append(f"{name} is empty")
    for name in _NUMERIC:
        text = str(row.get(name) or "")
        if not text and name != "value":
            continue
        try:
            number = float(text)
        except ValueError:
            problems.append(f"{name}={text!r} is not a number")
            continue
        if not math.isfinite(number):
            problems.append(f"{name}={text!r} is not finite")
    spread_cells = [row.get(name) or "" for name in ("min", "median", "max")]
    if any(spread_cells) and not all(spread_cells):
        problems.append("min / median / max must be given together")
    elif all(spread_cells) and not problems:
        low, mid, high = (float(c) for c in spread_cells)
        if not low <= mid <= high:
            problems.append(f"min {low} <= median {mid} <= max {high} does not hold")
    try:
        datetime.date.fromisoformat(str(row.get("date") or ""))
    except ValueError:
        problems.append(f"date={row.get('date')!r} is not YYYY-MM-DD")
    return problems


def read_rows(path: Path | str | None = None) -> list[dict[str, str]]:
    target = Path(path) if path is not None else DEFAULT_PATH
    if not target.exists():
        return []
    with open(target, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != FIELDS:
            raise ValueError(f"{target}: header {reader.fieldnames} is not {list(FIELDS)}")
        return list(reader)


def file_problems(path: Path | str | None = None) -> list[str]:
    """Every malformed row of a results file, by line number."""
    return [f"line {line}: {problem}"
            for line, row in enumerate(read_rows(path), start=2)
            for problem in row_problems(row)]


def append_rows(rows: Sequence[dict[str, str]], path: Path | str) -> None:
    target = Path(path)
    bad = [f"{r.get('case')}/{r.get('metric')}: {p}" for r in rows for p in row_problems(r)]
    if bad:
        raise ValueError("refusing to append malformed rows: " + "; ".join(bad))
    fresh = not target.exists() or target.stat().st_size == 0
    if fresh:
        target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, lineterminator="\n")
        if fresh:
            writer.writeheader()
        writer.writerows(rows)


def current(rows: Iterable[dict[str, str]]) -> dict[tuple[str, str, str, str], dict[str, str]]:
    """The latest row of each (bench, case, metric, device), in first-seen order."""
    latest: dict[tuple[str, str, str, str], dict[str, str]] = {}
    for row in rows:
        latest[(row["bench"], row["case"], row["metric"], row["device"])] = row
    return latest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="check or merge benchmark result files")
    sub = parser.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check", help="report malformed rows")
    check.add_argument("files", nargs="*", type=Path, default=[DEFAULT_PATH])
    merge = sub.add_parser("merge", help="check rows from other files and append them")
    merge.add_argument("files", nargs="+", type=Path)
    merge.add_argument("--into", type=Path, default=DEFAULT_PATH)
    merge.add_argument("--commit", help="the commit the rows were measured at, for rows that "
                                        "could not read it (a copy of the tree without .git)")
    args = parser.parse_args(argv)
    problems = [f"{path}: {p}" for path in args.files for p in file_problems(path)]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    if args.action == "merge":
        rows = [row for path in args.files for row in read_rows(path)]
        if args.commit:
            rows = [{**row, "commit": args.commit} if row["commit"] == UNRECORDED else row
                    for row in rows]
        append_rows(rows, args.into)
        print(f"appended {len(rows)} rows to {args.into}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
