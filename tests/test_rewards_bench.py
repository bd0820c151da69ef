"""The GPU benchmark script stays runnable: a tiny CPU smoke run of bench/bench_rewards.py."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

# NOTE: tiny models run faster on one thread on a shared machine (conftest).
pytestmark = pytest.mark.usefixtures("torch_single_thread")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.results import file_problems, read_rows  # noqa: E402


@pytest.mark.slow
def test_bench_rewards_smoke(tmp_path, monkeypatch):
    rows_file = tmp_path / "results.csv"
    monkeypatch.setenv("BENCH_RESULTS", str(rows_file))
    spec = importlib.util.spec_from_file_location(
        "bench_rewards", os.path.join(REPO, "bench", "bench_rewards.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--tiny", "--device", "cpu", "--images", "4", "--resolution", "64",
                       "--prompts", "2", "--repeats", "1", "--batch-sizes", "2",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["sweep"]) == {"64", "2"} and result["dtype"] == "float32"
    assert result["images_per_s"] > 0 and result["markdown_row"].startswith("| tiny CLIP")
    # its figures as rows of the results file (bench/results.py), each well-formed
    rows = {(r["case"], r["metric"]): r for r in read_rows(rows_file)}
    assert file_problems(rows_file) == []
    main = rows[("tiny-clip-float32-4x64-2prompts", "images_per_s")]
    assert main["device"] == "cpu" and main["unit"] == "images/s"
    assert float(main["value"]) == pytest.approx(result["images_per_s"], rel=1e-5)
    assert ("tiny-clip-float32-4x64-2prompts-batch2", "images_per_s") in rows
    vocab = bench.byte_level_vocab()
    assert len(vocab) == bench.VOCAB_SIZE and vocab["<|endoftext|>"] == 49407 \
        and len(set(vocab.values())) == bench.VOCAB_SIZE
