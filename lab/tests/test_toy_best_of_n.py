"""lab/toy/toy_best_of_n.py: the per-group pick, and a one-round run on the shipped toy model
(the kept images score at least the sampled mean on the selected component, every component
evaluated before and after, rows written, bad sizes refused)."""
from __future__ import annotations

import csv
import json
import os

import pytest
import torch

import toy_best_of_n as bon


def test_best_of_groups_picks_each_groups_best_or_a_member():
    scores = {"count": torch.tensor([0.25, 1.0, 0.5, 0.5, 0.0, 0.125])}
    gen = torch.Generator().manual_seed(0)
    assert bon.best_of_groups(scores, "count", groups=2, k=3, gen=gen) == [1, 3]
    ties = {tuple(bon.best_of_groups(scores, "count", groups=3, k=2, gen=gen)) for _ in range(20)}
    assert ties == {(1, 2, 5), (1, 3, 5)}  # the middle group's tie is broken either way
    for _ in range(5):
        rows = bon.best_of_groups(scores, "random", groups=2, k=3, gen=gen)
        assert 0 <= rows[0] < 3 <= rows[1] < 6


def test_one_round_on_the_shipped_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path / "rows.csv"))
    out = tmp_path / "bon.json"
    assert bon.main(["--select", "count", "--rounds", "1", "--groups", "4", "--k", "2",
                     "--steps", "1", "--batch", "2", "--eval-prompts", "4",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    start, first = result["rounds"]
    assert set(start["eval"]) == set(first["eval"]) == {"color", "count", "position"}
    assert first["kept"]["count"] >= first["sampled"]["count"]
    rows = list(csv.DictReader(open(os.environ["BENCH_RESULTS"])))
    ours = {r["metric"] for r in rows if r["case"] == "toy-best-of-2-count"}
    assert {"eval_count_round_0", "eval_count_round_1"} <= ours
    with pytest.raises(SystemExit):
        bon.main(["--select", "count", "--rounds", "0", "--k", "0"])
