"""The main job's figures: ``python -m trainer launch --config toy`` at one seed triple, timed
from the outside, its held-out eval read from the run's metrics.jsonl.

    python bench/bench_main_job.py                                  # the default seeds
    python bench/bench_main_job.py --seeds 1 43 7 --footing "two runs sharing the cores"

Rows (bench ``toy_main_job``, case ``toy-seeds-T-R-G``): the eval reward at rollout 0 and at
the last rollout, the gain, each component's change, and the whole run's wall time (process
start to exit: model load, every eval and the final checkpoint included). ``--footing`` names
what else shared the machine; it is part of the recorded command, and the wall time of a run
that was not alone is recorded as ``wall_s_shared``, never as the main job's ``wall_s``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import Recorder  # noqa: E402

COMPONENTS = ("color", "count", "position")


def eval_points(metrics_path: Path) -> dict[int, dict[str, float]]:
    """rollout -> the eval metrics logged at it."""
    points = {}
    for line in metrics_path.read_text().splitlines():
        row = json.loads(line)
        if "eval/reward_mean" in row:
            points[int(row["step"])] = row
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs=3, type=int, default=(0, 42, 1234),
                        metavar=("TRAIN", "ROLLOUT", "GENERATION"))
    parser.add_argument("--footing", default="alone", help="what else shared the machine")
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], dest="overrides",
                        help="a further config override (part of the recorded command)")
    args = parser.parse_args(argv)
    train, rollout, generation = args.seeds
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="toy_main_"))
    launch = ["python", "-m", "trainer", "launch", "--config", "toy", "--run-dir", str(run_dir)]
    if tuple(args.seeds) != (0, 42, 1234):
        launch += ["--set", f"train.seed={train}", "--set", f"rollout.rollout_seed={rollout}",
                   "--set", f"rollout.generation_seed={generation}"]
    for override in args.overrides:
        launch += ["--set", override]
    t0 = time.perf_counter()
    code = subprocess.call([sys.executable, *launch[1:]])
    wall = time.perf_counter() - t0
    if code != 0:
        print(f"the main job exited with {code}; no rows written", file=sys.stderr)
        return code
    points = eval_points(run_dir / "metrics.jsonl")
    start, end = points[0], points[max(points)]
    command = " ".join(launch[:6] + launch[8:]) + f" ({args.footing})"
    rec = Recorder("toy_main_job", device="cpu", command=command)
    case = f"toy-seeds-{train}-{rollout}-{generation}"
    last = max(points)
    rec.add(case, "eval_reward_start", start["eval/reward_mean"], "reward")
    rec.add(case, f"eval_reward_at_{last}", end["eval/reward_mean"], "reward")
    rec.add(case, f"eval_gain_at_{last}", end["eval/reward_mean"] - start["eval/reward_mean"], "reward")
    for component in COMPONENTS:
        key = f"eval/{component}_mean"
        rec.add(case, f"eval_{component}_change", end[key] - start[key], "reward")
    # only a run alone on its machine gives the main job's wall time; others keep theirs apart
    rec.add(case, "wall_s" if args.footing == "alone" else "wall_s_shared", wall, "s")
    rec.write()
    for row in rec.rows:
        print(f"{row['case']} {row['metric']} {row['value']} {row['unit']}")
    print(f"run directory: {run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
