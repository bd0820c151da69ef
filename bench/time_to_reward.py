"""The README's time-to-reward table: the algorithms side by side on the toy task, from
bench/results.csv (rendered by bench/make_table.py between its own markers).

Each algorithm's seeds are the variants ``ALGO_s0`` .. ``ALGO_s2`` of bench ``bench_toy_learning``
(lab/sweeps/toy_time-to-reward.txt), each taken from its latest run on one footing: a variant
alone on the 2-core CPU machine (``--parallel 1 --device cpu``), eval every 10 rollouts,
stopped 0.10 above its rollout-0 eval (``--stop-after-gain 0.10``). Seeds measured in different
runs sit side by side only at that footing; the table names every commit it read. A seed that
ran but never gained 0.10 counts as not reaching it; a seed with no run at that footing is an
error naming it, so the table cannot silently lose an algorithm.
"""
from __future__ import annotations

import statistics
from typing import Callable

BEGIN = "<!-- time-to-reward:begin (bench/make_table.py) -->"
END = "<!-- time-to-reward:end -->"
BENCH = "bench_toy_learning"
#: (variant prefix, what the table calls it), in the table's order
ALGORITHMS = (("flowgrpo", "Flow-GRPO"), ("flowgrpo_fast", "Flow-GRPO-Fast (the toy default)"),
              ("mixgrpo", "MixGRPO"), ("diffusionnft", "DiffusionNFT"))
SEEDS = 3
GAIN = "0.1"
#: what a run's command must say to share the footing
FOOTING = ("--device cpu", "--parallel 1", "--eval-every 10", "--stop-after-gain 0.10")
COMPONENTS = ("color", "count", "position")


def _seed_run(rows: list[dict[str, str]], case: str) -> dict[str, dict[str, str]] | None:
    """The metrics of ``case`` from its latest finished run at the footing."""
    runs: dict[tuple[str, ...], dict[str, dict[str, str]]] = {}
    for row in rows:
        if (row["bench"] == BENCH and row["case"] == case and row["device"] == "cpu"
                and all(flag in row["command"] for flag in FOOTING)):
            key = (row["commit"], row["date"], row["command"])
            runs.setdefault(key, {})[row["metric"]] = row
    finished = [metrics for metrics in runs.values() if "s_per_rollout" in metrics]
    return finished[-1] if finished else None


def _spread(values: list[float], fmt: Callable[[str], str]) -> str:
    """``median [min, max]``; whole numbers (rollouts) as integers."""
    if not values:
        return "-"

    def show(value: float) -> str:
        return str(int(value)) if float(value).is_integer() else fmt(str(value))
    return f"{show(statistics.median(values))} [{show(min(values))}, {show(max(values))}]"


def _line(name: str, seeds: list[dict[str, dict[str, str]]], fmt: Callable[[str], str]) -> str:
    reached = [s for s in seeds if f"rollouts_to_gain_{GAIN}" in s]

    def values(metric: str) -> list[float]:
        return [float(s[metric]["value"]) for s in reached]
    changes = " / ".join(
        fmt(str(statistics.median(values(f"eval_{c}_change_at_gain_{GAIN}")))) if reached else "-"
        for c in COMPONENTS)
    commits = ", ".join(dict.fromkeys(s["s_per_rollout"]["commit"] for s in seeds))
    per_rollout = [float(s["s_per_rollout"]["value"]) for s in seeds]
    return (f"| {name} | {len(reached)} of {len(seeds)} | "
            f"{_spread(values(f'rollouts_to_gain_{GAIN}'), fmt)} | "
            f"{_spread(values(f'wall_s_to_gain_{GAIN}'), fmt)} | "
            f"{_spread(values(f'train_s_to_gain_{GAIN}'), fmt)} | "
            f"{_spread(per_rollout, fmt)} | {changes} | {commits} |")


def time_to_reward_table(rows: list[dict[str, str]], fmt: Callable[[str], str]) -> str:
    """The markdown table; KeyError naming every seed that has no run at the footing."""
    found = {(algo, k): _seed_run(rows, f"toy-{algo}_s{k}")
             for algo, _ in ALGORITHMS for k in range(SEEDS)}
    missing = [f"toy-{algo}_s{k}" for (algo, k), run in found.items() if run is None]
    if missing:
        raise KeyError(f"time-to-reward seeds missing from bench/results.csv at the footing "
                       f"{' '.join(FOOTING)}: {', '.join(missing)}")
    lines = ["| algorithm | seeds reaching +0.10 | rollouts to +0.10 | wall s to it (all) | "
             "training s to it | s per rollout | colour / count / position change there "
             "(median) | commits |", "|---|---|---|---|---|---|---|---|"]
    for algo, name in ALGORITHMS:
        lines.append(_line(name, [found[(algo, k)] for k in range(SEEDS)], fmt))
    return "\n".join(lines)
