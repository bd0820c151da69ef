"""A one-rank process group for tests that need torch.distributed in this process (FSDP2,
DTensor) without torchrun."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist


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
