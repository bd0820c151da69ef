"""Multi-tensor copy + checksum kernel (Triton), and the host side that feeds it.

One launch moves every piece of a bucket that shares a (source, destination) dtype pair: each
program copies one CHUNK of one piece and folds the checksum of the words it wrote (the
definition in ipc/checksum.py) into that tensor's two lanes with two atomics. With STORE=False
the same kernel only reads: that is the receiver's verification and `weights_checksum` on GPU.

The copy is limited by bytes in flight per SM (registers per thread bound the resident
warps) and by integer issue (~6 ops per checksummed word), not by DRAM (figures:
bench/reports/2026-11-29_h200_code-choices.md). Hence:
- 16-bit words travel as int32 pairs (PACK): the store is the loaded register, and the lanes
  need 3 accumulators per pair instead of 2 per word (1.5 vs 2 registers and adds per word),
  so more of the register file holds loads in flight;
- each iteration moves BLOCK32 32-bit lanes (16 KiB at the default: four 16-byte vectors per
  thread at 8 warps), the config the sweep measured best;
- only the tail of a piece (< one iteration) is masked, word by word.

Addressing: every source and destination is given as a signed offset, in 16-byte units, from
a base pointer argument. Triton specialises pointer arguments on 16-byte alignment and sees
`offset16 * VEC` as a multiple of VEC elements, so the unmasked main loop compiles to 16-byte
vector loads and stores without any hint; only the tail of a piece is masked. A source that is
not 16-byte aligned or not contiguous is first copied to a fresh allocation (rare: full
tensors from torch are 512-byte aligned).

Casts are done on the raw bits, so a copy is bit-exact and identical under the Triton
interpreter (whose float conversions truncate) and on the GPU:
- same dtype (any 2- or 4-byte type): bits moved unchanged;
- fp32 -> bf16: round to nearest even; NaN -> 0x7FFF, as torch's CUDA cast (torch's CPU
  casts give 0xFFFF or 0x7FC0 depending on the code path, so NaN bits are not portable);
- bf16 -> fp32: exact widening.
Other pairs (fp16 <-> others, 1- and 8-byte types) go through `torch` copies and the torch
reference checksum: correct, one launch per piece, meant for the odd buffer, not for weights.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import torch

# The defaults are the best config of `python bench/bench_ipc.py --sweep` (bench/reports/2026-11-29_h200_weight-sync.md).
# CHUNK (words per program) keeps the chunk table of a 16 GB sync near 0.5 MB and the epilogue
# (block reductions + two atomics) negligible.
CHUNK = 1 << 17
BLOCK32 = 8192      # 32-bit lanes per loop iteration (16-bit words: 2 * BLOCK32 words)
NUM_WARPS = 8
PACK16 = True       # same-dtype 16-bit copies move int32 pairs (see the module docstring)

_KINDS = {  # (src dtype, dst dtype) -> (SRC_BITS, DST_BITS, CAST)
    (torch.float32, torch.bfloat16): (32, 16, 1),
    (torch.bfloat16, torch.float32): (16, 32, 2),
}
_INT_VIEW = {16: torch.int16, 32: torch.int32}


def triton_available() -> bool:
    """Triton importable (it ships with CUDA builds of torch)."""
    return importlib.util.find_spec("triton") is not None


def _kernel():
    # Imported on first launch, not with `ipc`: triton decides interpreter vs compiled mode
    # (TRITON_INTERPRET) when the kernel is decorated, so a test may set it after `import ipc`.
    from ipc._triton_copy import copy_checksum_kernel
    return copy_checksum_kernel


def kernel_kind(src: torch.dtype, dst: torch.dtype) -> tuple[int, int, int] | None:
    """(SRC_BITS, DST_BITS, CAST) when the Triton kernel handles this pair, else None."""
    if src == dst:
        size = torch.empty(0, dtype=src).element_size()
        if size in (2, 4) and src not in (torch.bool,):
            return (8 * size, 8 * size, 0)
        return None
    return _KINDS.get((src, dst))


def chunk_table(counts: np.ndarray) -> np.ndarray:
    """int32 [n_chunks, 2] (piece, chunk) covering pieces of `counts` words each."""
    per = (counts + CHUNK - 1) // CHUNK
    total = int(per.sum())
    piece = np.repeat(np.arange(len(counts), dtype=np.int64), per)
    starts = np.concatenate(([0], np.cumsum(per)[:-1])) if len(per) else np.zeros(0, np.int64)
    chunk = np.arange(total, dtype=np.int64) - np.repeat(starts, per)
    return np.stack([piece, chunk], axis=1).astype(np.int32).reshape(total, 2)


class Launch:
    """One kernel launch: pieces [p0, p1) of a plan sharing one dtype pair; chunks [c0, c1)."""

    __slots__ = ("kind", "p0", "p1", "c0", "c1")

    def __init__(self, kind, p0, p1, c0, c1):
        self.kind, self.p0, self.p1, self.c0, self.c1 = kind, p0, p1, c0, c1


def launch(base: torch.Tensor, launch_: Launch, chunks: torch.Tensor, pieces: torch.Tensor,
           src16: torch.Tensor, sums: torch.Tensor, *, store: bool,
           src_base: torch.Tensor | None = None) -> None:
    """Launch one group. `base` is the destination memory (uint8, >= 16 bytes); sources are
    offsets from `src_base` (default: `base`). Both must be 16-byte aligned."""
    src_bits, dst_bits, cast = launch_.kind
    n = launch_.c1 - launch_.c0
    if n == 0:
        return
    sb = base if src_base is None else src_base
    pack = PACK16 and launch_.kind == (16, 16, 0)
    block = 2 * BLOCK32 if launch_.kind == (16, 16, 0) else BLOCK32
    # 16-byte views, not empty ones: the interpreter sees a null data pointer for an empty
    # tensor. Offsets may be negative (sources below the base): two's complement wraps.
    s16, d16 = sb[:16], base[:16]
    _kernel()[(n,)](
        s16.view(_INT_VIEW[src_bits]), d16.view(_INT_VIEW[dst_bits]),
        s16.view(torch.int32), d16.view(torch.int32),
        chunks[launch_.c0:launch_.c1], pieces, src16, sums,
        CHUNK=CHUNK, BLOCK=block, SRC_BITS=src_bits, DST_BITS=dst_bits, CAST=cast,
        STORE=store, PACK=pack, num_warps=NUM_WARPS)
