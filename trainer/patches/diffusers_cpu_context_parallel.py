"""diffusers' context-parallel setup on a machine without an accelerator.

``ModelMixin._resolve_parallel_config`` (diffusers 0.42) names each rank's device as
``torch.device(accelerator_type, rank % torch.accelerator.device_count())``; on a CPU-only host
the count is 0 and the setup dies with ZeroDivisionError before it reads the mesh we pass. The
device it builds is only recorded on the config; the collectives run on the mesh's process
group (gloo on CPU). ``cpu_device_count()`` makes the count read 1 for the duration of one
``enable_parallelism`` call and only when there is no accelerator, so the device resolves to
``cpu:0``; with an accelerator it changes nothing.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def cpu_device_count() -> Iterator[None]:
    """Within the ``with``: ``torch.accelerator.device_count()`` reads 1 on a host without one."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = real
