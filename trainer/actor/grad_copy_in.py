"""FSDP2's gradient copy-in at one rank: one flat copy per gradient instead of ``_chunk_cat``.

Before each reduce-scatter, FSDP2 copies a unit's gradients into one flat buffer through the
``fsdp::chunk_cat`` op (``torch._chunk_cat``). That CUDA kernel builds a host-side table with
an entry for every CUDA block it launches. A transformer block of a large model holds hundreds
of millions of gradient elements, so the table costs milliseconds of host time per unit and
reduce, which the GPU spends waiting when the backward of a block is shorter than that.

With one chunk (a reduce group of one rank, as at world size 1) the copy-in is just the
gradients flattened end to end. ``install()`` registers a CUDA kernel for the op that does
exactly that for one chunk: each gradient copied into its slice of the buffer, in the
buffer's dtype, by ``torch._foreach_copy_``. Every other call keeps torch's kernel. Both give
the same bytes. The registration is per process and lasts for its lifetime. It is skipped if
the op is missing or its schema is not the one this was written for.
"""
from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger("trainer")

_SCHEMA = "fsdp::chunk_cat(Tensor[] tensors, int dim, int num_chunks, *, Tensor(a!) out) -> ()"
_library: torch.library.Library | None = None  # kept alive: dropping it unregisters the kernel


def flat_copy_in(tensors: list[torch.Tensor], dim: int, num_chunks: int,
                 out: torch.Tensor) -> None:
    """``torch._chunk_cat(tensors, dim, num_chunks, out=out)``: for one chunk along dim 0, one
    copy per tensor into consecutive slices of ``out``; otherwise torch's kernel."""
    total = sum(t.numel() for t in tensors)
    if num_chunks != 1 or dim != 0 or not out.is_contiguous() or out.numel() != total \
            or any(t.device != out.device for t in tensors):
        torch._chunk_cat(tensors, dim, num_chunks, out=out)
        return
    flat, views, start = out.view(-1), [], 0
    for t in tensors:
        views.append(flat[start:start + t.numel()].view(t.shape))
        start += t.numel()
    torch._foreach_copy_(views, list(tensors))


def installed() -> bool:
    return _library is not None


def install() -> bool:
    """Register ``flat_copy_in`` as the CUDA kernel of ``fsdp::chunk_cat`` (once per
    process); False where the op is absent or differs from the one it replaces."""
    global _library
    if _library is not None:
        return True
    import torch.distributed.fsdp  # noqa: F401  (defines the fsdp:: ops)
    op = getattr(getattr(torch.ops, "fsdp", None), "chunk_cat", None)
    if op is None or str(op.default._schema) != _SCHEMA:
        log.info("fsdp::chunk_cat is absent or has another schema: torch's copy-in kept")
        return False
    library = torch.library.Library("fsdp", "IMPL")
    with warnings.catch_warnings():
        # the dispatcher warns that a kernel is replaced: that is the point
        warnings.simplefilter("ignore")
        library.impl("chunk_cat", flat_copy_in, "CUDA")
    _library = library
    return True
