"""bench/bench_toy_learning.py stays runnable: two variants side by side, one rollout each on
the CPU, their curves paired (same first eval) and a failing variant reported, not hidden."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                      "bench_toy_learning.py")


@pytest.mark.slow
@pytest.mark.multiproc
def test_curves_of_two_variants_and_a_broken_one(tmp_path):
    variants = tmp_path / "v.txt"
    variants.write_text("# comment line\nbase\n"
                        'shared: rollout.sampling={"init_same_noise": true}; train.lr=1e-4\n'
                        "broken: train.no_such_key=1\n")
    out = tmp_path / "curves.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--variants-file", str(variants), "--rollouts", "1",
         "--eval-every", "1", "--eval-prompts", "4", "--eval-samples", "1", "--noise-seeds", "7",
         "--parallel", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0, proc.stdout[-2000:]   # the broken variant fails the run
    results = {r.get("name"): r for r in json.loads(out.read_text())}
    assert results["broken"]["returncode"] != 0 and "evals" not in results["broken"]
    base, shared = results["base"], results["shared"]
    assert base["returncode"] == shared["returncode"] == 0
    assert shared["overrides"] == ['rollout.sampling={"init_same_noise": true}', "train.lr=1e-4"]
    for r in (base, shared):
        assert [e["rollout"] for e in r["evals"]] == [0, 1]
        assert len(r["train_reward"]) == 1 and len(r["noise"]) == 1
        assert {"reward_mean", "color_mean", "count_mean", "position_mean"} <= set(r["evals"][0])
    # paired curves: the first eval is the same policy, prompts and seeds in every variant
    assert base["evals"][0]["reward_mean"] == shared["evals"][0]["reward_mean"]
    assert (tmp_path / "curves.part0.json").exists()


def test_results_rows_carry_every_component_at_the_first_and_last_eval(tmp_path, monkeypatch):
    import argparse
    import csv

    sys.path.insert(0, os.path.dirname(SCRIPT))
    from record_rows import record_toy

    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path / "rows.csv"))
    evals = [{"rollout": 0, "reward_mean": 0.5, "color_mean": 0.4, "count_mean": 0.6},
             {"rollout": 30, "reward_mean": 0.55, "color_mean": 0.5, "count_mean": 0.58}]
    record_toy([{"name": "v", "returncode": 0, "evals": evals, "seconds_per_rollout": 2.0},
                {"name": "failed", "returncode": 1, "evals": evals}],
               argparse.Namespace(recipe="toy", device="cpu"))
    with open(tmp_path / "rows.csv", newline="") as f:
        rows = {(r["case"], r["metric"]): float(r["value"]) for r in csv.DictReader(f)}
    assert rows == pytest.approx({
        ("toy-v", "eval_reward_start"): 0.5, ("toy-v", "eval_reward_at_30"): 0.55,
        ("toy-v", "eval_gain_at_30"): 0.05, ("toy-v", "s_per_rollout"): 2.0,
        ("toy-v", "eval_color_start"): 0.4, ("toy-v", "eval_color_at_30"): 0.5,
        ("toy-v", "eval_count_start"): 0.6, ("toy-v", "eval_count_at_30"): 0.58})
