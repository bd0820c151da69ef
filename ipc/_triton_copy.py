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
def _store_word(ptr, u, mask, MASKED: tl.constexpr, DST_BITS: tl.constexpr):
    if DST_BITS == 16:
        val = u.to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        val = u.to(tl.int32, bitcast=True)
    if MASKED:
        tl.store(ptr, val, mask=mask)
    else:
        tl.store(ptr, val)


@triton.jit
def _mix(u):
    w = (u + 1) * 0x2545F491
    return w ^ (w >> 15)


@triton.jit
def copy_checksum_kernel(
    src_base, dst_base,  # word-typed base pointers (int16/int32 views); offsets from them
    src_pair, dst_pair,  # int32 views of the same two addresses (read only when PACK)
    chunks,              # int32 [n_chunks, 2]: (piece, chunk number within the piece)
    pieces,              # int64 [n_pieces, 4]: (dst offset16, first word, words, slot)
    src16,               # int64 [n_pieces]: source offset16 of each piece
    sums,                # int32 [n_slots, 2]: lanes, accumulated with atomics (mod 2^32)
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, SRC_BITS: tl.constexpr,
    DST_BITS: tl.constexpr, CAST: tl.constexpr, STORE: tl.constexpr, PACK: tl.constexpr,
):
    pid = tl.program_id(0)
    piece = tl.load(chunks + 2 * pid).to(tl.int64)
    chunk = tl.load(chunks + 2 * pid + 1).to(tl.int64)
    begin = chunk * CHUNK
    n = tl.minimum(tl.load(pieces + 4 * piece + 2) - begin, CHUNK)
    first = tl.load(pieces + 4 * piece + 1) + begin
    slot = tl.load(pieces + 4 * piece + 3)
    s_off16 = tl.load(src16 + piece)
    d_off16 = tl.load(pieces + 4 * piece)
    src = src_base + (s_off16 * (128 // SRC_BITS) + begin)
    dst = dst_base + (d_off16 * (128 // DST_BITS) + begin)
    lanes = tl.arange(0, BLOCK)
    n_full = (n // BLOCK) * BLOCK
    n_iter = (n_full // BLOCK).to(tl.uint32)
    if PACK:
        # 16-bit words moved as int32 pairs: one 16-byte vector is 4 lanes, the store is the
        # loaded register (no unpack/repack), and the lanes need 3 accumulators per 2 words
        # instead of 4. Pair p of the chunk holds words first+2p (low half) and first+2p+1,
        # so sum_i i*v = first*A + 2*sum_p p*(lo_p + hi_p) + sum_p hi_p.
        PAIRS: tl.constexpr = BLOCK // 2
        plane = tl.arange(0, PAIRS)
        psrc = src_pair + (s_off16 * 4 + chunk * (CHUNK // 2))
        pdst = dst_pair + (d_off16 * 4 + chunk * (CHUNK // 2))
        s1 = tl.zeros([PAIRS], dtype=tl.uint32)
        s2 = tl.zeros([PAIRS], dtype=tl.uint32)
        hs = tl.zeros([PAIRS], dtype=tl.uint32)
        for off in range(0, n_full // 2, PAIRS):
            x = tl.load(psrc + off + plane)
            if STORE:
                tl.store(pdst + off + plane, x)
            u = x.to(tl.uint32, bitcast=True)
            hi = _mix(u >> 16)
            s1 += _mix(u & 0xFFFF) + hi
            s2 += s1
            hs += hi
        a = tl.sum(s1, axis=0)
        b = (first.to(tl.uint32) * a + 2 * (PAIRS * (n_iter * a - tl.sum(s2, axis=0))
                                            + tl.sum(plane.to(tl.uint32) * s1, axis=0))
             + tl.sum(hs, axis=0))
    else:
        s1 = tl.zeros([BLOCK], dtype=tl.uint32)
        s2 = tl.zeros([BLOCK], dtype=tl.uint32)
        for off in range(0, n_full, BLOCK):
            u = _load_word(src + off + lanes, None, False, SRC_BITS, CAST)
            if STORE:
                _store_word(dst + off + lanes, u, None, False, DST_BITS)
            s1 += _mix(u)
            s2 += s1
        # Word (t, j) of the main loop has index first + t*BLOCK + j. With T iterations,
        # s1[j] = sum_t v and s2[j] = sum_t (T - t) v, so sum_t t v = T s1 - s2 and
        # lane_b = first * A + BLOCK * (T A - sum s2) + sum_j j s1[j]   (all mod 2^32).
        a = tl.sum(s1, axis=0)
        b = (first.to(tl.uint32) * a + BLOCK * (n_iter * a - tl.sum(s2, axis=0))
             + tl.sum(lanes.to(tl.uint32) * s1, axis=0))
    for off in range(n_full, n, BLOCK):  # the masked tail, word by word: zero or one time
        mask = off + lanes < n
        u = _load_word(src + off + lanes, mask, True, SRC_BITS, CAST)
        if STORE:
            _store_word(dst + off + lanes, u, mask, True, DST_BITS)
        v = tl.where(mask, _mix(u), 0)
        t_a = tl.sum(v, axis=0)
        a += t_a
        b += (first + off).to(tl.uint32) * t_a + tl.sum(lanes.to(tl.uint32) * v, axis=0)
    tl.atomic_add(sums + 2 * slot, a.to(tl.int32, bitcast=True))
    tl.atomic_add(sums + 2 * slot + 1, b.to(tl.int32, bitcast=True))
