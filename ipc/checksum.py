"""Weight checksum: its definition (the torch reference), the digest, and `weights_checksum`.

Definition. A tensor's bytes are read as little-endian unsigned words of
`min(itemsize, 4)` bytes (a bf16 tensor is one 16-bit word per element, an int64 tensor two
32-bit words per element). For word `u` at index `i` within its tensor, all arithmetic mod 2^32:

    w = (u + 1) * MIX;   v = w ^ (w >> 15)
    lane_a = sum(v);     lane_b = sum(i * v)

Design choices:
- Integer sums mod 2^32 are associative, so a kernel may split a tensor into any chunks, in any
  order, across buckets, and still produce the reference's lanes bit for bit.
- `v` is a bijection of `u` (odd multiplier, then an xorshift), so any single changed word
  changes lane_a; lane_b weights words by position, so moved or swapped data changes it.
- The per-word cost is ~6 integer ops: cheap enough to fuse into a bandwidth-bound copy (the
  Triton kernel in ipc/_kernels.py computes exactly this while it copies).
- Every multiplier is < 2^31, so the torch reference below is exact in int64 arithmetic
  (no reliance on wrap-around of signed overflow).

The digest of a set of named tensors (`combine`) hashes, in name order, each tensor's name,
dtype, shape and lanes with BLAKE2b. The same function serves the sender (`SyncStats.checksum`),
the receiver (`WeightReceiver.checksum()`) and callers (`weights_checksum`).
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

# One direction only: the kernels module knows nothing of this one; the lanes of both
# implementations (reference and kernel) are computed here.
from ipc import _kernels

MIX = 0x2545F491
M32 = 0xFFFFFFFF
# Words processed per step of the reference, to bound its int64 temporaries.
_REF_STEP = 1 << 22


def words_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat tensor of unsigned words (int64 holding 8/16/32-bit values)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=t.device)
    size = flat.element_size()
    if size == 1:
        return flat.view(torch.uint8).to(torch.int64)
    if size == 2:
        return flat.view(torch.int16).to(torch.int64) & 0xFFFF
    return flat.view(torch.int32).to(torch.int64) & M32


def lanes_tensor(words: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Lanes of a run of words whose first word has index `first` in its tensor, as an int64
    tensor [2] on the words' device (no host sync, so it can sit in a stream)."""
    if words.device.type == "cpu":
        return _lanes_numpy(words, first)
    return _lanes_torch(words, first)


def _lanes_torch(words: torch.Tensor, first: int) -> torch.Tensor:
    """The definition in int64 torch ops (exact on any device, no reliance on wrap-around)."""
    acc = torch.zeros(2, dtype=torch.int64, device=words.device)
    n = words.numel()
    for lo in range(0, n, _REF_STEP):
        u = words[lo:lo + _REF_STEP]
        w = (((u + 1) & M32) * MIX) & M32
        v = w ^ (w >> 15)
        i = (torch.arange(u.numel(), dtype=torch.int64, device=u.device) + (first + lo)) & M32
        # i * v mod 2^32 without overflowing int64: split i into 16-bit halves.
        iv = ((i & 0xFFFF) * v + ((((i >> 16) * v) & 0xFFFF) << 16)) & M32
        acc += torch.stack([v.sum(), iv.sum()])
        acc &= M32
    return acc


def _lanes_numpy(words, first: int) -> torch.Tensor:
    """The same lanes on the CPU in numpy's uint32 arithmetic, which wraps mod 2^32 by
    definition: a few uint32 passes instead of the reference's int64 temporaries (the CPU
    path is the shared-memory transport's copy and verification). `words`: a CPU tensor of
    words (int64 values) or a numpy array of unsigned words."""
    if isinstance(words, torch.Tensor):
        words = words.numpy()
    a = b = np.uint32(0)
    mix, shift = np.uint32(MIX), np.uint32(15)
    with np.errstate(over="ignore"):
        for lo in range(0, words.size, _REF_STEP):
            u = words[lo:lo + _REF_STEP].astype(np.uint32)
            w = (u + np.uint32(1)) * mix
            v = w ^ (w >> shift)
            start = first + lo
            if start + u.size <= M32:
                i = np.arange(start, start + u.size, dtype=np.uint32)
            else:  # indices wrap past 2^32 within this run
                i = np.arange(start, start + u.size, dtype=np.uint64).astype(np.uint32)
            a = a + v.sum(dtype=np.uint32)
            b = b + (i * v).sum(dtype=np.uint32)
    return torch.tensor([int(a), int(b)], dtype=torch.int64)


def run_lanes(flat: torch.Tensor, first: int = 0) -> torch.Tensor:
    """Lanes of a flat run of a tensor whose first word has index `first` (int64 [2] on its
    device). On the CPU the words are read in place as unsigned numpy views (no int64 copy)."""
    if flat.device.type != "cpu" or flat.numel() == 0:
        return lanes_tensor(words_of(flat), first)
    size = flat.element_size()
    if size == 1:
        raw = flat.view(torch.uint8).numpy()
    elif size == 2:
        raw = flat.view(torch.int16).numpy().view(np.uint16)
    else:
        raw = flat.view(torch.int32).numpy().view(np.uint32)
    return _lanes_numpy(raw, first)


def lanes_of_words(words: torch.Tensor, first: int = 0) -> tuple[int, int]:
    """Reference lanes (a, b) of a run of words (see `lanes_tensor`)."""
    a, b = lanes_tensor(words, first).tolist()  # NOTE: host sync
    return int(a), int(b)


def tensor_lanes(t: torch.Tensor) -> tuple[int, int]:
    """Reference lanes of one tensor."""
    return lanes_of_words(words_of(t))


def digest_header(names: Sequence[str], dtypes: Sequence[torch.dtype],
                  shapes: Sequence[Sequence[int]]) -> tuple[np.ndarray, bytes]:
    """(name order, BLAKE2b of the name-sorted metadata): the per-name-set half of `combine`."""
    order = np.array(sorted(range(len(names)), key=names.__getitem__), dtype=np.int64)
    h = hashlib.blake2b(digest_size=16)
    for k in order.tolist():
        shape = ",".join(str(int(d)) for d in shapes[k])
        h.update(f"{names[k]}\x1f{dtypes[k]}\x1f{shape}\x1e".encode())
    return order, h.digest()


def combine(header: tuple[np.ndarray, bytes], lanes: np.ndarray) -> str:
    """Digest string from a `digest_header` and the [n, 2] lanes in the header's entry order."""
    order, meta = header
    body = np.ascontiguousarray(np.asarray(lanes, dtype=np.uint32)[order]).astype("<u4").tobytes()
    return hashlib.blake2b(meta + body, digest_size=16).hexdigest()


def _items(tensors) -> list[tuple[str, torch.Tensor]]:
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    bad = [str(name) for name, t in items if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"weights_checksum: not tensors: {', '.join(bad)}")
    return items


def reference_lanes(tensors: Iterable[torch.Tensor]) -> np.ndarray:
    """[n, 2] uint32 lanes computed by the torch reference (any device, any dtype)."""
    rows = [tensor_lanes(t) for t in tensors]
    return np.array(rows, dtype=np.uint32).reshape(-1, 2)


def weights_checksum(tensors, *, impl: str = "auto") -> str:
    """Checksum of named tensors: dict or iterable of (name, tensor); order does not matter.

    impl: "auto" (Triton multi-tensor kernel for CUDA tensors when available, else the torch
    reference), "torch" or "triton". It equals `WeightReceiver.checksum()` and
    `SyncStats.checksum` for the same names and bytes; note that the bytes are those of the
    given dtype, so compare tensors in the engine's dtype (the sync casts on the wire).
    """
    items = _items(tensors)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("weights_checksum: duplicate tensor names")
    ts = [t for _, t in items]
    header = digest_header(names, [t.dtype for t in ts], [tuple(t.shape) for t in ts])
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"weights_checksum: impl must be auto, torch or triton, not {impl!r}")
    use_triton = impl == "triton" or (
        impl == "auto" and ts and all(t.is_cuda for t in ts) and _kernels_available())
    if use_triton:
        lanes = tensors_lanes(ts)
    else:
        lanes = reference_lanes(ts)
    return combine(header, lanes)


def _kernels_available() -> bool:
    return _kernels.triton_available()


def tensors_lanes(tensors: list[torch.Tensor]) -> np.ndarray:
    """[n, 2] uint32 lanes of CUDA (or, under TRITON_INTERPRET=1, CPU) tensors: one read-only
    launch per word size; dtypes the kernel does not read go through the torch reference."""
    out = np.zeros((len(tensors), 2), dtype=np.uint32)
    if not tensors:
        return out
    device = tensors[0].device
    groups: dict[int, list[int]] = {}
    srcs: list[torch.Tensor] = []
    for k, t in enumerate(tensors):
        kind = _kernels.kernel_kind(t.dtype, t.dtype)
        if kind is None or t.device != device:
            out[k] = tensor_lanes(t)
            srcs.append(t)
            continue
        if not t.is_contiguous() or t.data_ptr() % 16:
            t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
        srcs.append(t)
        groups.setdefault(kind[0], []).append(k)
    if not groups:
        return out
    base = torch.empty(16, dtype=torch.uint8, device=device)  # any 16-byte aligned anchor
    base_ptr = base.data_ptr()
    sums = torch.zeros((len(tensors), 2), dtype=torch.int32, device=device)
    for bits, ks in groups.items():
        counts = np.array([srcs[k].numel() for k in ks], dtype=np.int64)
        offs = np.array([srcs[k].data_ptr() - base_ptr for k in ks], dtype=np.int64) // 16
        pieces = np.stack([offs, np.zeros_like(counts), counts,
                           np.array(ks, dtype=np.int64)], axis=1)
        table = _kernels.chunk_table(counts)
        dev = dict(device=device)
        _kernels.launch(base, _kernels.Launch((bits, bits, 0), 0, len(ks), 0, len(table)),
               torch.from_numpy(table).to(**dev), torch.from_numpy(pieces).to(**dev),
               torch.from_numpy(np.ascontiguousarray(offs)).to(**dev), sums, store=False)
    got = sums.cpu().numpy().view(np.uint32)  # NOTE: host sync
    for ks in groups.values():
        out[ks] = got[ks]
    return out

