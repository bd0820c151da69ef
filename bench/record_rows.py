"""Results rows of the training-step and toy-learning benches (bench_step.py with its floors
and peer, peer_step.py, bench_toy_learning.py): each script ends its main() with one call
here, so the scripts keep their own tables and this module owns what goes into
bench/results.csv (bench/results.py).
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # the scripts run as `python bench/x.py`, with only bench/ on the path
    sys.path.insert(0, ROOT)

from bench.results import Recorder, device_name  # noqa: E402


def record_step(results: list[dict], extra: dict, args) -> None:
    """bench_step.py: one case per row (``qwen8l-lora``, with the run's ``--label`` prefix),
    its step / stage seconds, train ms per transition, floor and ratio, engine images/s, peak
    memory and share outside model compute; the diffusers pipeline and the peer when timed,
    with each row's speed-up over the peer."""
    rec = Recorder("bench_step", device=device_name(args.device))
    setup = f"{'tiny-' if args.tiny else ''}qwen{args.layers}l"
    samples = 8 * args.groups

    def case_of(r: dict) -> str:
        return f"{setup}-{r['label']}" + (f"-{samples}samples" if args.groups != 1 else "")

    for r in results:
        case = case_of(r)
        times = [t for t in r["step_times"] if t is not None]
        rec.add(case, "step_s", r["step_time"], "s", samples=times[1:] or times)
        stages = r["stage_times"]
        for metric, key in (("rollout_s", "perf/rollout_time"), ("train_s", "perf/train_time")):
            if key in stages:
                rec.add(case, metric, stages[key], "s")
        if stages.get("perf/rollout_time"):
            rec.add(case, "engine_images_per_s", samples / stages["perf/rollout_time"],
                    "images/s")
        rec.add(case, "train_ms_per_transition", r["train_ms_per_transition"], "ms")
        if "floor_ms_per_transition" in r:
            rec.add(case, "floor_ms_per_transition", r["floor_ms_per_transition"], "ms")
            rec.add(case, "floor_ratio", r["floor_ratio"], "x")
        if "work_floor_ms_per_transition" in r:
            rec.add(case, "work_floor_ms_per_transition", r["work_floor_ms_per_transition"], "ms")
            rec.add(case, "work_floor_ratio", r["work_floor_ratio"], "x")
        if "pcie_floor_s" in r:
            rec.add(case, "offload_gb", stages["perf/offload_gb"], "GB")
            rec.add(case, "pcie_floor_s", r["pcie_floor_s"], "s")
            rec.add(case, "offload_floor_ratio", r["offload_floor_ratio"], "x")
        rec.add(case, "peak_memory", r["peak_gb"], "GB")
        rec.add(case, "outside_compute_share", 100 * r["share_outside"], "%")
        for stage in ("rollout", "train", "step"):  # from the adapter's FLOP count
            if f"perf/mfu/{stage}" in stages:
                rec.add(case, f"mfu_{stage}", 100 * stages[f"perf/mfu/{stage}"], "%")
    if "diffusers_images_per_s" in extra:
        rec.add(f"{setup}-diffusers-eager-pipeline", "images_per_s",
                extra["diffusers_images_per_s"], "images/s")
    if extra.get("peer"):
        peer = extra["peer"]
        _peer_rows(rec, f"{setup}-peer-mb{peer['micro_batch']}", peer)
        for r in results:  # the peer's step over each row's, both timed in this run
            rec.add(case_of(r), "speedup_over_peer", peer["step"] / r["step_time"], "x")
    if extra.get("strong_peer"):  # bench_step.py --strong-peer: peer_step.py --strong
        peer = extra["strong_peer"]
        _peer_rows(rec, f"{setup}-peer-strong-mb{peer['micro_batch']}", peer)
        for r in results:
            rec.add(case_of(r), "speedup_over_strong_peer", peer["step"] / r["step_time"], "x")
    rec.write()


def _peer_rows(rec: Recorder, case: str, peer: dict) -> None:
    for metric, key in (("step_s", "step"), ("rollout_s", "rollout"), ("train_s", "train")):
        rec.add(case, metric, peer[key], "s")
    rec.add(case, "train_ms_per_transition", peer["train_ms_per_transition"], "ms")
    rec.add(case, "peak_memory", peer["peak_gb"], "GB")


def record_peer(peer: dict) -> None:
    """peer_step.py run on its own: the plain eager loop's figures."""
    rec = Recorder("peer_step", device=device_name("cuda"))
    kind = "peer-strong" if peer.get("strong") else "peer"  # peer_step.py --strong
    _peer_rows(rec, f"{kind}-mb{peer['micro_batch']}-u{peer['updates']}", peer)
    rec.write()


def record_toy(results: list[dict], args) -> None:
    """bench_toy_learning.py: per variant that finished, the eval reward at its first and last
    point, their difference and the seconds per rollout; each component's eval mean at the
    first and last point (``eval_count_start``, ``eval_count_at_N``); the eval's spread over
    the noise seeds at the start when measured (the yardstick a gain is read against)."""
    rec = Recorder("bench_toy_learning", device=device_name(args.device))
    for r in results:
        evals = r.get("evals") or []
        if r.get("returncode") != 0 or len(evals) < 2:
            continue
        case = f"{args.recipe}-{r['name']}"
        first, last = evals[0], evals[-1]
        rec.add(case, "eval_reward_start", first["reward_mean"], "reward")
        rec.add(case, f"eval_reward_at_{last['rollout']}", last["reward_mean"], "reward")
        rec.add(case, f"eval_gain_at_{last['rollout']}",
                last["reward_mean"] - first["reward_mean"], "reward")
        components = [k[:-len("_mean")] for k in first
                      if k.endswith("_mean") and k != "reward_mean" and k in last]
        for name in components:
            rec.add(case, f"eval_{name}_start", first[f"{name}_mean"], "reward")
            rec.add(case, f"eval_{name}_at_{last['rollout']}", last[f"{name}_mean"], "reward")
        if r.get("seconds_per_rollout"):
            rec.add(case, "s_per_rollout", r["seconds_per_rollout"], "s")
        noise = [first["reward_mean"], *(r.get("noise") or [])]
        if len(noise) > 1:
            rec.add(case, "eval_seed_spread", max(noise) - min(noise), "reward")
    if rec.rows:
        rec.write()



def time_to_gain(evals: list[dict], gain: float) -> dict | None:
    """The first eval whose mean of the components is ``gain`` or more above the first eval's:
    its rollout, the training and total seconds spent to it, and each component's change
    there (None when no eval reached it)."""
    if not evals:
        return None
    first = evals[0]
    for point in evals[1:]:
        # the curves hold 5 decimals: 0.6 - 0.5 must count as a gain of 0.1
        if round(point["reward_mean"] - first["reward_mean"], 6) >= gain:
            changes = {k[:-len("_mean")]: point[k] - first[k] for k in first
                       if k.endswith("_mean") and k != "reward_mean" and k in point}
            return {"rollout": point["rollout"], "train_s": point.get("train_s"),
                    "wall_s": point.get("wall_s"), "changes": changes}
    return None


def algorithm_of(name: str) -> str:
    """``flowgrpo_s0`` -> ``flowgrpo``: the seeds of one algorithm's settings share a name."""
    stem, _, seed = name.rpartition("_s")
    return stem if stem and seed.isdigit() else name


def _group_by_algorithm(results: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in results:
        if r.get("returncode") == 0 and r.get("evals"):
            groups.setdefault(algorithm_of(r["name"]), []).append(r)
    return groups


def record_time_to_reward(results: list[dict], args, gain: float) -> None:
    """bench_toy_learning.py --stop-after-gain: per variant, the rollouts, training seconds and
    total seconds to the first eval ``gain`` above its first, each component's change there,
    and the eval curve's inner points (record_toy holds the first and last); per algorithm
    (``<recipe>-<algo>-<n>seeds``), how many seeds reached it and, over those, the median with
    min / max of each of those figures. A component's min change below 0 is a seed where it
    fell."""
    rec = Recorder("bench_toy_learning", device=device_name(args.device))
    tag = f"{gain:g}"
    for algo, runs in _group_by_algorithm(results).items():
        hits = []
        for r in runs:
            case = f"{args.recipe}-{r['name']}"
            for point in r["evals"][1:-1]:
                rec.add(case, f"eval_reward_at_{point['rollout']}", point["reward_mean"], "reward")
            hit = time_to_gain(r["evals"], gain)
            if hit is None:
                continue
            hits.append(hit)
            rec.add(case, f"rollouts_to_gain_{tag}", hit["rollout"], "rollouts")
            rec.add(case, f"train_s_to_gain_{tag}", hit["train_s"], "s")
            rec.add(case, f"wall_s_to_gain_{tag}", hit["wall_s"], "s")
            for comp, change in hit["changes"].items():
                rec.add(case, f"eval_{comp}_change_at_gain_{tag}", change, "reward")
        case = f"{args.recipe}-{algo}-{len(runs)}seeds"
        rec.add(case, f"seeds_reaching_gain_{tag}", len(hits), "seeds")
        for metric, unit, key in (("rollouts", "rollouts", "rollout"), ("train_s", "s", "train_s"),
                                  ("wall_s", "s", "wall_s")):
            values = [h[key] for h in hits if h[key] is not None]
            if values:
                rec.add(case, f"{metric}_to_gain_{tag}", statistics.median(values), unit,
                        samples=values)
        for comp in (hits[0]["changes"] if hits else {}):
            values = [h["changes"][comp] for h in hits]
            rec.add(case, f"eval_{comp}_change_at_gain_{tag}", statistics.median(values),
                    "reward", samples=values)
    if rec.rows:
        rec.write()


def time_to_reward_table(results: list[dict], gain: float) -> list[str]:
    """The per-algorithm figures as a markdown table (median [min, max] over the seeds that
    reached the gain), for the README."""
    lines = [f"| algorithm | seeds reaching +{gain:g} | rollouts to it | s to it (all) | "
             "s to it (training only) | component changes there |", "|---|---|---|---|---|---|"]

    def cell(values: list[float], fmt: str) -> str:
        if not values:
            return "-"
        return (f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]")

    for algo, runs in _group_by_algorithm(results).items():
        hits = [h for h in (time_to_gain(r["evals"], gain) for r in runs) if h is not None]
        changes = ", ".join(
            f"{comp} {cell([h['changes'][comp] for h in hits], '+.3f')}"
            for comp in (hits[0]["changes"] if hits else {}))
        lines.append(f"| {algo} | {len(hits)} of {len(runs)} | "
                     f"{cell([h['rollout'] for h in hits], '.0f')} | "
                     f"{cell([h['wall_s'] for h in hits if h['wall_s'] is not None], '.0f')} | "
                     f"{cell([h['train_s'] for h in hits if h['train_s'] is not None], '.0f')} | "
                     f"{changes or '-'} |")
    return lines
