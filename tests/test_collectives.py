"""``trainer.utils.collectives``: across two gloo ranks each agreement combines what every rank
holds; in a one-rank process group each answers from the rank's own value without a
collective (the train stage asks two of them every step)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from dist_fixtures import one_rank_group, run_on_gloo_ranks
from trainer.utils.collectives import (all_ranks_ok, any_rank, broadcast_from_rank0,
                                 failures_by_rank, require_same_on_all_ranks)


def test_one_rank_group_agrees_without_a_collective(tmp_path, monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a one-rank group ran a collective")

    with one_rank_group(tmp_path):
        for name in ("all_reduce", "all_gather_object", "broadcast_object_list"):
            monkeypatch.setattr(dist, name, no_collective)
        assert any_rank(True) and not any_rank(False)
        assert all_ranks_ok(True) and not all_ranks_ok(False)
        assert failures_by_rank("disk full") == {0: "disk full"} and failures_by_rank(None) == {}
        assert broadcast_from_rank0({"step": 3}) == {"step": 3}
        require_same_on_all_ranks(3, "micro-batches")  # nothing to disagree with


def _two_rank_checks() -> None:
    rank = dist.get_rank()
    # only rank 1 has a signal: no rank may skip its updates (FSDP's collectives would hang)
    assert any_rank(rank == 1) and not any_rank(False)
    assert not all_ranks_ok(rank == 1)
    require_same_on_all_ranks(2, "micro-batches")
    with pytest.raises(RuntimeError, match=rf"rank {rank} has {2 + rank} micro-batches but "
                                           r"ranks range 2\.\.3: refusing to deadlock"):
        require_same_on_all_ranks(2 + rank, "micro-batches")


def test_two_ranks_agree_on_signal_and_refuse_unequal_counts():
    run_on_gloo_ranks(_two_rank_checks)
