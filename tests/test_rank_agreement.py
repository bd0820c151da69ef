"""The train stage's two rank agreements (``Trainer._all_ranks_degenerate`` and
``_assert_microbatch_count_aligned``): across two gloo ranks they combine what each rank holds;
in a one-rank process group they answer from the rank's own values without a collective."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_fixtures import one_rank_group, run_on_gloo_ranks
from trainer.loop import Trainer


def _agreeing_trainer() -> Trainer:
    """A Trainer carrying only what the two agreements read (building a whole one needs a model)."""
    trainer = Trainer.__new__(Trainer)
    trainer.distributed = dist.is_initialized()
    trainer.rank = dist.get_rank() if trainer.distributed else 0
    trainer.world = dist.get_world_size() if trainer.distributed else 1
    trainer.device = torch.device("cpu")
    return trainer


def test_one_rank_group_agrees_without_a_collective(tmp_path, monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a one-rank group ran an all-reduce")

    with one_rank_group(tmp_path):
        monkeypatch.setattr(dist, "all_reduce", no_collective)
        trainer = _agreeing_trainer()
        assert trainer.distributed and trainer.world == 1
        assert trainer._all_ranks_degenerate(torch.zeros(4))
        assert not trainer._all_ranks_degenerate(torch.tensor([0.0, -0.5, 0.0]))
        trainer._assert_microbatch_count_aligned(3)  # nothing to disagree with


def _two_rank_checks() -> None:
    trainer = _agreeing_trainer()
    rank = dist.get_rank()
    # only rank 1 has a signal: no rank may skip its updates (FSDP's collectives would hang)
    assert not trainer._all_ranks_degenerate(torch.full((3,), float(rank)))
    assert trainer._all_ranks_degenerate(torch.zeros(3))
    trainer._assert_microbatch_count_aligned(2)
    with pytest.raises(RuntimeError, match="refusing to deadlock"):
        trainer._assert_microbatch_count_aligned(2 + rank)


def test_two_ranks_agree_on_signal_and_refuse_unequal_micro_batch_counts():
    run_on_gloo_ranks(_two_rank_checks)
