"""Ring attention in a training run: two gloo ranks with ``fsdp.sequence_parallel = 2`` train a
tiny Wan of three heads (degree 2 does not divide them, so the split is diffusers' ring with
the CPU flash backend) as one rank trains on the same batches.

The run and its reference are those of ``tests/test_sequence_parallel_run.py`` (the whole
loop with engines, reward, weight sync and checkpoint; the reference replays the recorded
batches through the same update without the split), on the tiny Wan 2.1 recipe (LoRA,
activation checkpointing) whose transformer is rebuilt with three heads.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_sequence_parallel_run import _run_and_compare_one_group, _wan
from trainer.parallel.rules import uses_ring

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]


def _with_three_heads(transformer_dir: Path) -> None:
    """The saved transformer rebuilt by diffusers with three heads, all else as it was."""
    from diffusers import WanTransformer3DModel

    config = json.loads((transformer_dir / "config.json").read_text())
    keep = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**{**keep, "num_attention_heads": 3})
    for old in transformer_dir.iterdir():
        old.unlink()
    model.save_pretrained(transformer_dir)


def test_two_ranks_of_one_sequence_group_train_a_three_head_wan_by_ring_like_one_rank(tmp_path):
    recipe, model_dir, sets = _wan(tmp_path, world=2)
    _with_three_heads(model_dir / "transformer")
    heads = json.loads((model_dir / "transformer" / "config.json").read_text())
    assert uses_ring(2, heads["num_attention_heads"])
    _run_and_compare_one_group(tmp_path, recipe, model_dir,
                               sets + ["fsdp.activation_checkpointing=true"])
