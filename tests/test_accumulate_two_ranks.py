"""``reduce_each_backward`` (what ``fsdp.accumulate_unsharded`` switches) across two gloo
ranks, where the parameters really are sharded: an update's micro-batches accumulate their
gradients unsharded and reduce once, after the last backward, and the reduced gradients equal
the per-micro-batch schedule's (up to the order of the fp32 sums), with one reduce-scatter per
unit instead of one per micro-batch."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_fixtures import run_on_gloo_ranks
from trainer.actor.model import reduce_each_backward

MICRO_BATCHES = 3


def _sharded_model():
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2], model[4]):  # 7 and 5 rows: uneven shards
        fully_shard(layer, mp_policy=mp_policy)
    return fully_shard(model, mp_policy=mp_policy)


def _update_gradients(accumulate: bool) -> list[torch.Tensor]:
    """One update of MICRO_BATCHES backwards; the full gradients it leaves."""
    model = _sharded_model()
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    for m in range(MICRO_BATCHES):
        if accumulate:
            reduce_each_backward(model, m == MICRO_BATCHES - 1)
        model(torch.randn(4, 6, generator=gen)).square().mean().backward()
    reduce_each_backward(model, True)
    return [p.grad.full_tensor() for p in model.parameters()]


def _check_two_ranks() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    real, reduces = group.foreach_reduce, [0]

    def counting(*args, **kwargs):
        reduces[0] += 1
        return real(*args, **kwargs)

    group.foreach_reduce = counting
    try:
        per_micro_batch = _update_gradients(False)
        assert reduces[0] == 3 * MICRO_BATCHES  # three units, each reduced per micro-batch
        reduces[0] = 0
        accumulated = _update_gradients(True)
        assert reduces[0] == 3  # each unit once, after the last micro-batch
    finally:
        group.foreach_reduce = real
    assert len(accumulated) == len(per_micro_batch) == 6
    for want, got in zip(per_micro_batch, accumulated):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.multiproc
def test_accumulating_unsharded_reduces_once_per_update_on_two_ranks():
    run_on_gloo_ranks(_check_two_ranks)
