"""The few small collectives that decide together across ranks (a save's outcome, an engine
failure, rank 0's answer, whether a train stage has anything to learn, its micro-batch count).
Every rank calls each of them together; without a process group of more than one rank they
are identities on the one process's value (a one-rank collective returns its input: a launch
and a host read for nothing).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _several_ranks() -> bool:
    return distributed() and dist.get_world_size() > 1


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduced_flag(flag: bool, op) -> bool:
    if not _several_ranks():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device())
    dist.all_reduce(t, op=op)
    return bool(int(t.item()))  # NOTE: host sync


def all_ranks_ok(ok: bool) -> bool:
    """MIN all-reduce of a per-rank success flag."""
    return _reduced_flag(ok, dist.ReduceOp.MIN)


def failures_by_rank(cause: str | None) -> dict[int, str]:
    """{rank: cause} of every rank whose ``cause`` is not None, on every rank (an all-gather
    of small strings: call it on a failure path, after ``all_ranks_ok`` said one failed)."""
    if not _several_ranks():
        return {} if cause is None else {0: cause}
    causes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(causes, cause)
    return {rank: text for rank, text in enumerate(causes) if text is not None}


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled; small objects only)."""
    if not _several_ranks():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """MAX all-reduce of a per-rank flag: True on every rank where any rank's is."""
    return _reduced_flag(flag, dist.ReduceOp.MAX)


def require_same_on_all_ranks(value: int, what: str) -> None:
    """Raise on every rank, naming the range, where ranks hold different ``value``s (a count
    of collectives each rank is about to run: unequal counts would deadlock)."""
    if not _several_ranks():
        return
    t = torch.tensor([value, -value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    high, low = int(t[0]), -int(t[1])
    if low != high:
        raise RuntimeError(f"rank {dist.get_rank()} has {value} {what} but ranks range "
                           f"{low}..{high}: refusing to deadlock")
