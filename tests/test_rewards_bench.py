"""The GPU benchmark script stays runnable: a tiny CPU smoke run of bench/bench_rewards.py."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

# NOTE: tiny models run ~10x faster on one thread on the shared 2-core box (conftest).
pytestmark = pytest.mark.usefixtures("torch_single_thread")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_rewards_smoke(tmp_path):
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
    vocab = bench.byte_level_vocab()
    assert len(vocab) == bench.VOCAB_SIZE and vocab["<|endoftext|>"] == 49407 \
        and len(set(vocab.values())) == bench.VOCAB_SIZE
