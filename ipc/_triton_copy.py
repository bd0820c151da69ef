"""The Triton multi-tensor copy + checksum kernel (host side and design notes: ipc/_kernels.py).

Kept in its own module and imported on first launch, so TRITON_INTERPRET may be set after
`import ipc` (CI runs this kernel on CPU under the interpreter).
"""
import triton
import triton.language as tl


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
        u = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FFF, rounded)
    elif CAST == 2:  # bf16 bits -> fp32 bits
        u = u << 16
    return u

@triton.jit
def _mix(u):
    w = (u + 1) * 0x2545F491
    return w ^ (w >> 15)

@triton.jit
def copy_checksum_kernel(
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
