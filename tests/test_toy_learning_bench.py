"""bench/bench_toy_learning.py stays runnable: two variants side by side, one rollout each on
the CPU, their curves paired (same first eval) and a failing variant reported, not hidden."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                      "bench_toy_learning.py")


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
