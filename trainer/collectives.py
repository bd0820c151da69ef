"""The few small collectives that decide together across ranks (a save's outcome, an engine
failure, rank 0's answer). Every rank calls each of them together; without an initialised
process group they are identities on the one process's value.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_ranks_ok(ok: bool) -> bool:
    """MIN all-reduce of a per-rank success flag."""
    if not distributed():
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(int(t.item()))  # NOTE: host sync


def failures_by_rank(cause: str | None) -> dict[int, str]:
    """{rank: cause} of every rank whose ``cause`` is not None, on every rank (an all-gather
    of small strings: call it on a failure path, after ``all_ranks_ok`` said one failed)."""
    if not distributed():
        return {} if cause is None else {0: cause}
    causes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(causes, cause)
    return {rank: text for rank, text in enumerate(causes) if text is not None}


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; small objects only)."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
