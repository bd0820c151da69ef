"""Multi-tensor copy + checksum kernel (Triton), and the host side that feeds it.

One launch moves every piece of a bucket that shares a (source, destination) dtype pair: each
program copies one CHUNK of one piece and folds the checksum of the words it wrote (the
definition in ipc/checksum.py) into that tensor's two lanes with two atomics. With STORE=False
the same kernel only reads: that is the receiver's verification and `weights_checksum` on GPU.

Addressing: every source and destination is given as a signed offset, in 16-byte units, from
a base pointer argument. Triton specialises pointer arguments on 16-byte alignment and sees
`offset16 * VEC` as a multiple of VEC elements, so the unmasked main loop compiles to 16-byte
vector loads and stores without any hint; only the tail of a piece is masked. A source that is
not 16-byte aligned or not contiguous is first copied to a fresh allocation (rare: full
tensors from torch are 512-byte aligned).

Casts are done on the raw bits, so a copy is bit-exact and identical under the Triton
interpreter (whose float conversions truncate) and on the GPU:
- same dtype (any 2- or 4-byte type): bits moved unchanged;
- fp32 -> bf16: round to nearest even, NaN -> 0x7FC0 (what torch's CPU cast produces);
- bf16 -> fp32: exact widening.
Other pairs (fp16 <-> others, 1- and 8-byte types) go through `torch` copies and the torch
reference checksum: correct, one launch per piece, meant for the odd buffer, not for weights.
"""
from __future__ import annotations

import numpy as np
import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

# NOTE: 64 Ki elements per program keeps the chunk table of a 16 GB sync near 1 MB and the
# per-program epilogue (three block reductions + two atomics) under 1% of the program's time;
# BLOCK is 16 bf16 words per thread at 8 warps (two 16-byte vectors).
CHUNK = 1 << 16
BLOCK = 4096
NUM_WARPS = 8

_MIX = 0x2545F491
_KINDS = {  # (src dtype, dst dtype) -> (SRC_BITS, DST_BITS, CAST)
    (torch.float32, torch.bfloat16): (32, 16, 1),
    (torch.bfloat16, torch.float32): (16, 32, 2),
}
_INT_VIEW = {16: torch.int16, 32: torch.int32}


def triton_available() -> bool:
    return triton is not None


def kernel_kind(src: torch.dtype, dst: torch.dtype) -> tuple[int, int, int] | None:
    """(SRC_BITS, DST_BITS, CAST) when the Triton kernel handles this pair, else None."""
    if src == dst:
        size = torch.empty(0, dtype=src).element_size()
        if size in (2, 4) and src not in (torch.bool,):
            return (8 * size, 8 * size, 0)
        return None
    return _KINDS.get((src, dst))


if triton is not None:

    @triton.jit
    def _load_word(ptr, mask, MASKED: tl.constexpr, SRC_BITS: tl.constexpr,
                   CAST: tl.constexpr):
        if MASKED:
            raw = tl.load(ptr, mask=mask, other=0)
        else:
            raw = tl.load(ptr)
        if SRC_BITS == 16:
            u = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            u = raw.to(tl.uint32, bitcast=True)
        if CAST == 1:  # fp32 bits -> bf16 bits, round to nearest even
            rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
            u = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
        elif CAST == 2:  # bf16 bits -> fp32 bits
            u = u << 16
        return u

    @triton.jit
    def _mix(u):
        w = (u + 1) * 0x2545F491
        return w ^ (w >> 15)

    @triton.jit
    def _copy_checksum_kernel(
        src_base, dst_base,  # typed base pointers (int16/int32 views); offsets are from them
        chunks,              # int32 [n_chunks, 2]: (piece, chunk number within the piece)
        pieces,              # int64 [n_pieces, 4]: (dst offset16, first word, words, slot)
        src16,               # int64 [n_pieces]: source offset16 of each piece
        sums,                # int32 [n_slots, 2]: lanes, accumulated with atomics (mod 2^32)
        CHUNK: tl.constexpr, BLOCK: tl.constexpr, SRC_BITS: tl.constexpr,
        DST_BITS: tl.constexpr, CAST: tl.constexpr, STORE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        piece = tl.load(chunks + 2 * pid).to(tl.int64)
        chunk = tl.load(chunks + 2 * pid + 1).to(tl.int64)
        begin = chunk * CHUNK
        n = tl.minimum(tl.load(pieces + 4 * piece + 2) - begin, CHUNK)
        first = tl.load(pieces + 4 * piece + 1) + begin
        slot = tl.load(pieces + 4 * piece + 3)
        src = src_base + (tl.load(src16 + piece) * (128 // SRC_BITS) + begin)
        dst = dst_base + (tl.load(pieces + 4 * piece) * (128 // DST_BITS) + begin)
        lanes = tl.arange(0, BLOCK)
        s1 = tl.zeros([BLOCK], dtype=tl.uint32)
        s2 = tl.zeros([BLOCK], dtype=tl.uint32)
        n_full = (n // BLOCK) * BLOCK
        for off in range(0, n_full, BLOCK):
            u = _load_word(src + off + lanes, None, False, SRC_BITS, CAST)
            if STORE:
                if DST_BITS == 16:
                    tl.store(dst + off + lanes, u.to(tl.uint16).to(tl.int16, bitcast=True))
                else:
                    tl.store(dst + off + lanes, u.to(tl.int32, bitcast=True))
            s1 += _mix(u)
            s2 += s1
        for off in range(n_full, n, BLOCK):  # the masked tail: zero or one iteration
            mask = off + lanes < n
            u = _load_word(src + off + lanes, mask, True, SRC_BITS, CAST)
            if STORE:
                if DST_BITS == 16:
                    tl.store(dst + off + lanes, u.to(tl.uint16).to(tl.int16, bitcast=True),
                             mask=mask)
                else:
                    tl.store(dst + off + lanes, u.to(tl.int32, bitcast=True), mask=mask)
            s1 += tl.where(mask, _mix(u), 0)
            s2 += s1
        # Word (t, j) of this chunk has index first + t*BLOCK + j. With T iterations,
        # s1[j] = sum_t v and s2[j] = sum_t (T - t) v, so sum_t t v = T s1 - s2 and
        # lane_b = first * A + BLOCK * (T A - sum s2) + sum_j j s1[j]   (all mod 2^32).
        n_iter = ((n + BLOCK - 1) // BLOCK).to(tl.uint32)
        a = tl.sum(s1, axis=0)
        b = (first.to(tl.uint32) * a + BLOCK * (n_iter * a - tl.sum(s2, axis=0))
             + tl.sum(lanes.to(tl.uint32) * s1, axis=0))
        tl.atomic_add(sums + 2 * slot, a.to(tl.int32, bitcast=True))
        tl.atomic_add(sums + 2 * slot + 1, b.to(tl.int32, bitcast=True))


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
    """Launch one group. `base` is the destination memory (uint8); sources are offsets from
    `src_base` (default: `base`). Both must be 16-byte aligned."""
    src_bits, dst_bits, cast = launch_.kind
    n = launch_.c1 - launch_.c0
    if n == 0:
        return
    sb = base if src_base is None else src_base
    _copy_checksum_kernel[(n,)](
        sb[:0].view(_INT_VIEW[src_bits]), base[:0].view(_INT_VIEW[dst_bits]),
        chunks[launch_.c0:launch_.c1], pieces, src16, sums,
        CHUNK=CHUNK, BLOCK=BLOCK, SRC_BITS=src_bits, DST_BITS=dst_bits, CAST=cast,
        STORE=store, num_warps=NUM_WARPS)


def _byte_base(t: torch.Tensor) -> torch.Tensor:
    """A zero-length uint8 view at t's data pointer (usable as a kernel base pointer)."""
    return t.detach().reshape(-1)[:0].view(torch.uint8) if t.numel() else \
        torch.empty(0, dtype=torch.uint8, device=t.device)


def tensors_lanes(tensors: list[torch.Tensor]) -> np.ndarray:
    """[n, 2] uint32 lanes of CUDA (or, under TRITON_INTERPRET=1, CPU) tensors: one read-only
    launch per word size; dtypes the kernel does not read go through the torch reference."""
    from ipc.checksum import tensor_lanes

    out = np.zeros((len(tensors), 2), dtype=np.uint32)
    if not tensors:
        return out
    device = tensors[0].device
    groups: dict[int, list[int]] = {}
    keep = []  # aligned contiguous copies must outlive the launch
    srcs: list[torch.Tensor] = []
    for k, t in enumerate(tensors):
        kind = kernel_kind(t.dtype, t.dtype)
        if kind is None or t.device != device:
            out[k] = tensor_lanes(t)
            srcs.append(t)
            continue
        if not t.is_contiguous() or t.data_ptr() % 16:
            t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
            keep.append(t)
        srcs.append(t)
        groups.setdefault(kind[0], []).append(k)
    if not groups:
        return out
    first_idx = next(iter(groups.values()))[0]
    base = _byte_base(srcs[first_idx])
    base_ptr = base.data_ptr()
    sums = torch.zeros((len(tensors), 2), dtype=torch.int32, device=device)
    for bits, ks in groups.items():
        counts = np.array([srcs[k].numel() for k in ks], dtype=np.int64)
        offs = np.array([srcs[k].data_ptr() - base_ptr for k in ks], dtype=np.int64) // 16
        pieces = np.stack([offs, np.zeros_like(counts), counts,
                           np.array(ks, dtype=np.int64)], axis=1)
        table = chunk_table(counts)
        dev = dict(device=device)
        launch(base, Launch((bits, bits, 0), 0, len(ks), 0, len(table)),
               torch.from_numpy(table).to(**dev), torch.from_numpy(pieces).to(**dev),
               torch.from_numpy(np.ascontiguousarray(offs)).to(**dev), sums, store=False)
    got = sums.cpu().numpy().view(np.uint32)  # NOTE: host sync
    for ks in groups.values():
        out[ks] = got[ks]
    return out
