"""The time-to-reward study's arithmetic (bench/bench_toy_learning.py --stop-after-gain and
bench/record_rows.py): when a curve counts as having reached the gain, when a variant may
stop, and the rows and table written per variant and per algorithm over its seeds. The
training itself is bench_toy_learning's (tests/test_toy_learning_bench.py runs it)."""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

from bench_toy_learning import confirmed_gain, load_curves, main  # noqa: E402
from record_rows import (algorithm_of, record_time_to_reward, time_to_gain,  # noqa: E402
                         time_to_reward_table)


def curve(*means, count_drop=0.0):
    """Eval points every 10 rollouts; count falls by ``count_drop`` per point."""
    return [{"rollout": 10 * i, "reward_mean": m, "color_mean": m,
             "count_mean": 0.6 - count_drop * i, "train_s": 5.0 * i, "wall_s": 20.0 + 7.0 * i}
            for i, m in enumerate(means)]


def test_time_to_gain_is_the_first_eval_at_or_above_the_start_plus_the_gain():
    hit = time_to_gain(curve(0.5, 0.55, 0.61, 0.58, 0.7, count_drop=0.01), 0.1)
    assert hit["rollout"] == 20 and hit["train_s"] == 10.0 and hit["wall_s"] == 34.0
    assert hit["changes"] == pytest.approx({"color": 0.11, "count": -0.02})
    assert time_to_gain(curve(0.5, 0.55, 0.599), 0.1) is None
    assert time_to_gain(curve(0.5), 0.0) is None  # the first eval is the start, not a gain


def test_a_variant_stops_only_after_two_evals_follow_the_first_that_reached_the_gain():
    assert not confirmed_gain(curve(0.5, 0.6), 0.1)
    assert not confirmed_gain(curve(0.5, 0.6, 0.55), 0.1)
    assert confirmed_gain(curve(0.5, 0.6, 0.55, 0.52), 0.1)  # later evals may fall back
    assert not confirmed_gain(curve(0.5, 0.55, 0.56, 0.57), 0.1)
    assert not confirmed_gain(curve(0.5, 0.5, 0.5), 0.0)  # rollout 0 never counts as reached


def test_seeds_share_an_algorithm_by_their_name():
    assert algorithm_of("flowgrpo_fast_s2") == "flowgrpo_fast"
    assert algorithm_of("mixgrpo_s10") == "mixgrpo"
    assert algorithm_of("base") == "base" and algorithm_of("lr_sweep") == "lr_sweep"


def results_of_three_seeds():
    return [
        {"name": "nft_s0", "returncode": 0, "evals": curve(0.5, 0.65, 0.7, 0.7)},
        {"name": "nft_s1", "returncode": 0, "evals": curve(0.5, 0.55, 0.6, 0.7, count_drop=0.05)},
        {"name": "nft_s2", "returncode": 0, "evals": curve(0.5, 0.52, 0.55)},   # never reached
        {"name": "broken_s0", "returncode": 1, "evals": curve(0.5, 0.9)},       # a failed run
    ]


def test_rows_per_variant_and_per_algorithm_carry_the_spread_over_the_seeds(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path / "rows.csv"))
    args = argparse.Namespace(recipe="toy", device="cpu")
    record_time_to_reward(results_of_three_seeds(), args, 0.1)
    with open(tmp_path / "rows.csv", newline="") as f:
        rows = {(r["case"], r["metric"]): r for r in csv.DictReader(f)}
    assert not any(case.startswith("toy-broken") for case, _ in rows)
    assert float(rows["toy-nft_s0", "rollouts_to_gain_0.1"]["value"]) == 10
    assert float(rows["toy-nft_s1", "wall_s_to_gain_0.1"]["value"]) == 34.0
    count_change = float(rows["toy-nft_s1", "eval_count_change_at_gain_0.1"]["value"])
    assert count_change == pytest.approx(-0.1)
    assert ("toy-nft_s2", "rollouts_to_gain_0.1") not in rows
    assert float(rows["toy-nft_s2", "eval_reward_at_10"]["value"]) == 0.52  # the inner curve
    agg = "toy-nft-3seeds"
    assert float(rows[agg, "seeds_reaching_gain_0.1"]["value"]) == 2
    r = rows[agg, "rollouts_to_gain_0.1"]
    assert (float(r["min"]), float(r["value"]), float(r["max"])) == (10, 15, 20)
    count = rows[agg, "eval_count_change_at_gain_0.1"]
    assert float(count["min"]) == pytest.approx(-0.1) and float(count["max"]) == 0.0


def test_the_table_names_the_seeds_that_did_not_reach_the_gain():
    table = time_to_reward_table(results_of_three_seeds(), 0.1)
    row = next(line for line in table if line.startswith("| nft "))
    assert "| 2 of 3 |" in row and "| 15 [10, 20] |" in row
    assert "count -0.050 [-0.100, +0.000]" in row
    assert not any(line.startswith("| broken") for line in table)


def test_rows_are_written_again_from_a_killed_runs_parts(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path / "rows.csv"))
    for i, r in enumerate(results_of_three_seeds()[:2]):
        (tmp_path / f"c.part{i}.json").write_text(json.dumps({k: r[k] for k in ("name", "evals")}))
    assert [r["name"] for r in load_curves(tmp_path / "c.json")] == ["nft_s0", "nft_s1"]
    assert main(["--record-from", str(tmp_path / "c.json"), "--stop-after-gain", "0.1"]) == 0
    with open(tmp_path / "rows.csv", newline="") as f:
        rows = {(r["case"], r["metric"]): r["value"] for r in csv.DictReader(f)}
    assert float(rows["toy-nft-2seeds", "seeds_reaching_gain_0.1"]) == 2
    with pytest.raises(SystemExit, match="neither"):
        load_curves(tmp_path / "missing.json")
