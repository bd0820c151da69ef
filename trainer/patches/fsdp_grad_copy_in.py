"""FSDP2's gradient copy-in at one rank: one flat copy per gradient instead of ``_chunk_cat``.

Before each reduce-scatter, FSDP2 copies a unit's gradients into one flat buffer
(``foreach_reduce_scatter_copy_in``, which calls ``torch._chunk_cat``). On CUDA that kernel
builds a host-side table with an entry for every CUDA block it launches, and copies well below
the device's copy rate. A transformer block of a large model holds hundreds of millions of
gradient elements, so each unit's reduce costs milliseconds of host and device time; at world
size 1 the GPU waits through the host part whenever a block's backward is shorter.

With one rank in the reduce group the copy-in is just the gradients flattened end to end.
``install()`` wraps FSDP2's copy-in so that at one rank each gradient is copied into its slice
of the buffer, in the buffer's dtype, by ``torch._foreach_copy_``; with more ranks torch's
copy-in runs unchanged. Both give the same bytes. The wrapper is per process and lasts for
its lifetime; it is not installed where FSDP2's copy-in is missing or has another signature
(a torch this was not written for).
"""
from __future__ import annotations

import inspect
import logging

import torch

log = logging.getLogger("trainer")

_SIGNATURE = ["unsharded_grads", "reduce_scatter_input", "world_size"]
_torch_copy_in = None  # FSDP2's own copy-in, kept for more than one rank


def flat_copy_in(tensors: list[torch.Tensor], out: torch.Tensor) -> bool:
    """Copy ``tensors`` end to end into the contiguous ``out`` (each flattened, cast to its
    dtype); False, with nothing written, where ``out`` does not hold exactly their elements."""
    if not out.is_contiguous() or out.numel() != sum(t.numel() for t in tensors) \
            or any(t.device != out.device for t in tensors):
        return False
    flat, views, start = out.view(-1), [], 0
    for t in tensors:
        views.append(flat[start:start + t.numel()].view(t.shape))
        start += t.numel()
    torch._foreach_copy_(views, tensors)
    return True


def _copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor,
             world_size: int) -> None:
    if world_size == 1 and flat_copy_in(unsharded_grads, reduce_scatter_input):
        return
    _torch_copy_in(unsharded_grads, reduce_scatter_input, world_size)


def _fsdp_collectives():
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    except ImportError:
        return None
    return _fsdp_collectives


def installed() -> bool:
    module = _fsdp_collectives()
    return module is not None and module.foreach_reduce_scatter_copy_in is _copy_in


def install() -> bool:
    """Route FSDP2's gradient copy-in through ``_copy_in`` (once per process); False where
    FSDP2's copy-in is absent or differs from the one this wraps."""
    global _torch_copy_in
    if installed():
        return True
    module = _fsdp_collectives()
    original = getattr(module, "foreach_reduce_scatter_copy_in", None)
    if original is None or list(inspect.signature(original).parameters) != _SIGNATURE:
        log.info("FSDP2's gradient copy-in is absent or has another signature: kept as is")
        return False
    _torch_copy_in = original
    module.foreach_reduce_scatter_copy_in = _copy_in
    return True
