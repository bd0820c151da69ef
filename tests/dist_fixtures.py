"""A one-rank process group for tests that need torch.distributed in this process (FSDP2,
DTensor) without torchrun; gloo ranks spawned to run a check; the end of a spawned rank whose
checks passed."""
from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


@contextmanager
def one_rank_group(tmp_path: Path, backend: str = "gloo"):
    """Rank 0 of a world of 1 (file rendezvous under ``tmp_path``) for the ``with`` body,
    destroyed after; skips the test when this process already has a group."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def leave_spawned_rank() -> None:
    """End a spawned gloo rank whose checks all passed: every rank reaches the barrier before
    any tears the group down, then the process leaves without the interpreter's teardown,
    where a gloo thread still joinable at exit made the C++ runtime abort the rank (SIGABRT,
    "terminate called without an active exception") under a loaded CPU, after the test had
    already succeeded. A rank that fails raises before this, and its spawner reports it."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    """A TCP port on the loopback nobody listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, check: Callable[[], None]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    check()
    leave_spawned_rank()


def run_on_gloo_ranks(check: Callable[[], None], world: int = 2) -> None:
    """``check`` (a module-level function: spawn pickles it by name) on each of ``world`` gloo
    ranks; raises when any rank fails."""
    mp.spawn(_gloo_rank, args=(world, free_port(), check), nprocs=world, join=True)


def count_calls(monkeypatch, module, name: str) -> list[int]:
    """Route ``module.name`` through a wrapper that records the length of each call's first
    argument (the parameters or tensors that call handled); returns that record."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(first, *args, **kwargs):
        calls.append(len(first))
        return real(first, *args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
