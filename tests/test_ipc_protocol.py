"""ipc/ units: bucket planner, manifest checks, the checksum definition, and the Triton
copy + checksum kernel against the torch reference (under TRITON_INTERPRET=1 on CPU)."""
import os
import threading

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ipc  # noqa: E402
from ipc import _kernels  # noqa: E402
from ipc._copyplan import CopyPlan, fold_lanes  # noqa: E402
from ipc import checksum  # noqa: E402
from ipc.checksum import (lanes_of_words, reference_lanes, tensor_lanes,  # noqa: E402
                          weights_checksum, words_of)
from ipc.protocol import (SPLIT_ALIGN, check_manifest, manifest_hash,  # noqa: E402
                          manifest_nbytes, plan_buckets)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not _kernels.triton_available() or (DEVICE == "cpu" and os.environ.get(
        "TRITON_INTERPRET") != "1"), reason="needs triton (compiled on CUDA or interpreted)")


# ------------------------------------------------------------------------ bucket planner
def _covered(buckets, numels):
    seen = [np.zeros(n, dtype=np.int64) for n in numels]
    for bucket in buckets:
        for k, first, count in bucket:
            seen[k][first:first + count] += 1
    return all((s == 1).all() for s in seen)


def test_plan_buckets_order_capacity_and_split():
    numels = [10, 5000, 0, 300_000, 7, 20_000]
    sizes = [4, 2, 4, 4, 2, 2]
    cap = 64 << 10
    buckets = plan_buckets(numels, sizes, cap)
    assert _covered(buckets, numels)
    order = [k for b in buckets for k, _, _ in b]
    assert order == sorted(order)  # tensors stay in order
    for b in buckets:
        assert sum(c * sizes[k] for k, _, c in b) <= cap
    big = [(f, c) for b in buckets for k, f, c in b if k == 3]
    assert len(big) == -(-300_000 * 4 // (cap // 4 // SPLIT_ALIGN * SPLIT_ALIGN * 4))
    assert all(f % SPLIT_ALIGN == 0 for f, _ in big)
    assert any(k == 2 and c == 0 for b in buckets for k, _, c in b)  # empty tensor travels


def test_plan_buckets_new_bucket_when_tensor_does_not_fit():
    buckets = plan_buckets([100, 100, 100], [4, 4, 4], 1000)
    assert [[k for k, _, _ in b] for b in buckets] == [[0, 1], [2]]


# ------------------------------------------------------------------------ manifest
LAYOUT = {"w": ((4, 6), torch.bfloat16), "n": ((6,), torch.float32), "i": ((3,), torch.int64),
          "lora": ((2, 6), torch.bfloat16)}
MODES = {"full": list(LAYOUT), "adapter": ["lora"], "merge": ["w", "n", "i"]}


def _manifest(entries):
    return {"count": len(entries), "nbytes": manifest_nbytes(entries),
            "hash": manifest_hash(entries)}, entries


def test_check_manifest_accepts_a_valid_sync():
    header, entries = _manifest([("w", (4, 6), "float32", "bfloat16"),
                                 ("n", (6,), "bfloat16", "float32"),
                                 ("i", (3,), "int64", "int64"),
                                 ("lora", (2, 6), "bfloat16", "bfloat16")])
    assert check_manifest(header, entries, "full", LAYOUT, MODES) == []


def test_check_manifest_names_every_problem_at_once():
    header, entries = _manifest([("w", (6, 4), "float32", "bfloat16"),    # shape
                                 ("i", (3,), "float32", "int64"),         # cast
                                 ("ghost", (1,), "float32", "float32"),   # unknown
                                 ("lora", (2, 6), "bfloat16", "bfloat16"),  # outside mode
                                 ("i", (3,), "int64", "int64")])          # duplicate
    header["nbytes"] += 1
    problems = check_manifest(header, entries, "merge", LAYOUT, MODES)
    text = "\n".join(problems)
    for needle in ("total", "unknown tensors", "ghost", "outside mode 'merge'", "lora",
                   "duplicate", "missing", "n", "shape mismatch", "w: sent (6, 4)",
                   "cannot cast float32"):
        assert needle in text, (needle, text)


def test_check_manifest_hash_and_count_and_mode():
    header, entries = _manifest([("lora", (2, 6), "bfloat16", "bfloat16")])
    assert check_manifest(header, entries, "adapter", LAYOUT, MODES) == []
    bad = dict(header, hash="0" * 64, count=2)
    problems = check_manifest(bad, entries, "adapter", LAYOUT, MODES)
    assert any("hash" in p for p in problems) and any("count" in p for p in problems)
    assert any("unknown sync mode" in p for p in check_manifest(header, entries, "lora",
                                                                 LAYOUT, MODES))


# ------------------------------------------------------------------------ checksum
def test_checksum_detects_flips_swaps_and_is_chunkable():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(1000, generator=g).to(torch.bfloat16)
    base = tensor_lanes(t)
    flipped = t.clone()
    flipped.view(torch.int16)[123] ^= 1
    assert tensor_lanes(flipped) != base
    swapped = t.clone()
    swapped[[10, 500]] = t[[500, 10]]
    assert tensor_lanes(swapped)[0] == base[0] and tensor_lanes(swapped) != base
    words = words_of(t)
    parts = [lanes_of_words(words[a:b], a) for a, b in ((0, 333), (333, 334), (334, 1000))]
    assert tuple(sum(p[i] for p in parts) % 2**32 for i in range(2)) == base


def test_cpu_lanes_equal_the_int64_definition_across_the_index_wrap():
    from ipc.checksum import _lanes_numpy, _lanes_torch, run_lanes

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.int64):
        t = (torch.randn(5003, generator=g) * 1000).to(dtype)
        words = words_of(t)
        for first in (0, 7, 2**32 - 100):  # word indices past 2^32 wrap in lane b
            want = _lanes_torch(words, first)
            assert torch.equal(_lanes_numpy(words, first), want), (dtype, first)
            assert torch.equal(run_lanes(t.reshape(-1), first), want), (dtype, first)


def test_checksum_words_by_dtype():
    assert words_of(torch.zeros(3, dtype=torch.int64)).numel() == 6
    assert words_of(torch.zeros(3, dtype=torch.bool)).numel() == 3
    assert words_of(torch.zeros(0)).numel() == 0
    assert tensor_lanes(torch.zeros(0)) == (0, 0)
    x = torch.tensor([1.0, 2.0])
    assert tensor_lanes(x) != tensor_lanes(x.to(torch.float64))


def test_weights_checksum_order_free_and_name_sensitive():
    a, b = torch.randn(3, 4), torch.arange(5)
    c1 = weights_checksum({"a": a, "b": b}, impl="torch")
    assert c1 == weights_checksum([("b", b), ("a", a)], impl="torch")
    assert c1 != weights_checksum({"a": a, "c": b}, impl="torch")
    assert c1 != weights_checksum({"a": a.reshape(4, 3), "b": b}, impl="torch")
    with pytest.raises(ValueError):
        weights_checksum([("a", a), ("a", a)])


# ------------------------------------------------------------------------ Triton kernel
def _special_fp32():
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F800000, 0xFF800000,
                         0x7FC00001, 0xFFFFFFFF, 0x80000000, 0x00000001, 0x7F7FFFFF,
                         0xFF7FFFFF, 0x00018000], dtype=torch.int64)
    return bits.to(torch.int32).view(torch.float32)  # wraps to the same 32 bits


def _run_plan(pairs, bucket_bytes, store=True):
    """Copy `pairs` [(src tensor, dst dtype)] into one byte buffer through a CopyPlan."""
    offsets, total = [], 0
    for src, dt in pairs:
        offsets.append(total)
        total += -(-src.numel() * torch.empty(0, dtype=dt).element_size() // 256) * 256
    mem = torch.zeros(total + 256, dtype=torch.uint8, device=DEVICE)
    numels = [s.numel() for s, _ in pairs]
    dsts = [dt for _, dt in pairs]
    buckets = plan_buckets(numels, [torch.empty(0, dtype=d).element_size() for d in dsts],
                           bucket_bytes)
    plan = CopyPlan(buckets, offsets, numels, [s.dtype for s, _ in pairs], dsts,
                    torch.device(DEVICE), use_kernel=True)
    sources = {k: s.to(DEVICE).contiguous() for k, (s, _) in enumerate(pairs)}
    ptrs = np.array([sources[k].data_ptr() for k in range(len(pairs))], dtype=np.int64)
    sums, extra = plan.new_sums(), []
    for b in range(len(plan.buckets)):
        plan.run_bucket(b, mem, ptrs, sources, sums, extra, store=store)
    lanes = fold_lanes(sums.cpu().numpy(), [(k, t.tolist()) for k, t in extra], len(pairs))
    outs = [plan.slot(mem, k).reshape(s.shape).cpu() for k, (s, _) in enumerate(pairs)]
    return outs, lanes, plan


@needs_triton
def test_kernel_copy_is_bit_exact_with_torch_casts():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(2 * _kernels.CHUNK + 4099, generator=g)  # several chunks, a tail
    pairs = [
        (torch.cat([_special_fp32(), torch.randn(5000, generator=g)]), torch.bfloat16),
        (big, torch.bfloat16),                                            # split in buckets
        (torch.randn(7, 13, generator=g).to(torch.bfloat16), torch.float32),
        (torch.randn(33, 3, generator=g).to(torch.bfloat16), torch.bfloat16),
        (torch.randn(4097, generator=g), torch.float32),
        (torch.randn(129, generator=g).to(torch.float16), torch.float16),
        (torch.randint(-2**31, 2**31 - 1, (300,), dtype=torch.int32, generator=g), torch.int32),
        (torch.zeros(0), torch.bfloat16),                                 # empty
        (torch.randn(11, generator=g), torch.float16),                    # torch path
        (torch.arange(9, dtype=torch.int64), torch.int64),                # torch path
    ]
    outs, lanes, plan = _run_plan(pairs, bucket_bytes=96 << 10)
    assert len(plan.buckets) > 3 and plan.n_launches < sum(len(b) for b in plan.buckets)
    for (src, dt), out in zip(pairs, outs):
        want = src.to(dt)
        assert out.dtype == dt
        nan = torch.isnan(src) if src.is_floating_point() else torch.zeros_like(src, dtype=bool)
        # NaN payloads differ between torch's own CPU/CUDA casts; the kernel writes 0x7FFF.
        assert torch.isnan(out[nan]).all()
        assert torch.equal(out[~nan].view(torch.uint8), want[~nan].view(torch.uint8))
    assert (lanes == reference_lanes(outs)).all()  # the lanes of the bytes actually written


@needs_triton
def test_kernel_read_only_lanes_match_reference():
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(5, 1001, generator=g).to(torch.bfloat16), torch.randn(70_001, generator=g),
          torch.zeros(0, dtype=torch.bfloat16), torch.randint(0, 9, (17,), generator=g),
          torch.randn(64, generator=g)[1:]]  # misaligned view: copied before reading
    got = checksum.tensors_lanes([t.to(DEVICE) for t in ts])
    assert (got == reference_lanes(ts)).all()
    named = {f"t{k}": t.to(DEVICE) for k, t in enumerate(ts)}
    assert weights_checksum(named, impl="triton") == weights_checksum(named, impl="torch")


@needs_triton
def test_sender_triton_path_round_trip_in_process():
    """Same-process pair on the shm backend with the Triton copy (interpreted on CPU): the
    receiver's torch-reference verification cross-checks the kernel's fused checksum."""
    g = torch.Generator().manual_seed(3)
    params = {"w": torch.zeros(3, 70_000, dtype=torch.bfloat16), "n": torch.zeros(31),
              "b": torch.zeros(5, 7, dtype=torch.float32), "e": torch.zeros(0)}
    s_end, r_end = ipc.channel_pair()
    recv = ipc.WeightReceiver(r_end, params, timeout_s=30).start()
    sender = ipc.WeightSender(s_end, bucket_bytes=128 << 10, copy_impl="triton", timeout_s=30)
    try:
        src = {"w": torch.randn(3, 70_000, generator=g), "n": torch.randn(31, generator=g),
               "b": torch.randn(5, 7, generator=g).to(torch.bfloat16), "e": torch.zeros(0)}
        stats = sender.sync(1, src)
        assert stats.buckets > 1 and stats.handle_opens == 1
        for k, v in src.items():
            assert torch.equal(params[k], v.to(params[k].dtype))
        assert recv.checksum() == stats.checksum == weights_checksum(
            {k: v.to(params[k].dtype) for k, v in src.items()}, impl="torch")
        assert recv.version == 1 and not recv.dirty
    finally:
        sender.close()
        recv.close()
        s_end.close()
        r_end.close()


@needs_triton
def test_kernel_packed_16bit_path_matches_reference_and_word_path(monkeypatch):
    """bf16 -> bf16 moves int32 pairs (PACK16): several chunks, full iterations, an odd
    tail, pieces split across buckets; copy and read-only, against the torch reference and
    against the word-by-word kernel."""
    g = torch.Generator().manual_seed(5)
    words = 2 * _kernels.BLOCK32  # 16-bit words per loop iteration
    pairs = [(torch.randn(2 * _kernels.CHUNK + 3 * words + 5, generator=g), torch.bfloat16),
             (torch.randn(2 * words, generator=g), torch.bfloat16),            # no tail
             (torch.randn(3, words + 1, generator=g), torch.bfloat16)]
    pairs = [(s.to(torch.bfloat16), dt) for s, dt in pairs]
    want = reference_lanes([s for s, _ in pairs])
    outs, lanes, plan = _run_plan(pairs, bucket_bytes=200 << 10)
    assert len(plan.buckets) > 3
    for (src, _), out in zip(pairs, outs):
        assert torch.equal(out.view(torch.int16), src.view(torch.int16))
    assert (lanes == want).all()
    _, lanes_read, _ = _run_plan(pairs, bucket_bytes=200 << 10, store=False)
    assert (lanes_read == want).all()
    monkeypatch.setattr(_kernels, "PACK16", False)
    _, lanes_words, _ = _run_plan(pairs, bucket_bytes=200 << 10)
    assert (lanes_words == want).all()


@needs_triton
def test_sender_reuses_its_scan_only_while_tensors_stay_put():
    """Same objects at the same addresses: the cached scan and device offsets are reused and
    in-place updates still travel; a rebound .data (new address) or a new shape is seen; the
    sender keeps no strong reference to a payload after its sync."""
    import gc
    import weakref
    g = torch.Generator().manual_seed(4)
    params = {"w": torch.zeros(2, 40_000, dtype=torch.bfloat16), "n": torch.zeros(6)}
    s_end, r_end = ipc.channel_pair()
    recv = ipc.WeightReceiver(r_end, params, timeout_s=30).start()
    sender = ipc.WeightSender(s_end, bucket_bytes=96 << 10, copy_impl="triton", timeout_s=30)
    try:
        src = {"w": torch.nn.Parameter(torch.randn(2, 40_000, generator=g).bfloat16()),
               "n": torch.nn.Parameter(torch.randn(6, generator=g))}
        sender.sync(1, src)
        assert not sender._last_scan.reused
        with torch.no_grad():
            src["w"].add_(1.0)
            src["n"].mul_(-2.0)
        stats = sender.sync(2, src)
        assert sender._last_scan.reused
        assert all(torch.equal(params[k], src[k].detach()) for k in src)
        assert recv.checksum() == stats.checksum
        src["w"].data = torch.randn(2, 40_000, generator=g).bfloat16()  # new address
        sender.sync(3, src)
        assert not sender._last_scan.reused and torch.equal(params["w"], src["w"].detach())
        src["n"].data = src["n"].data.view(2, 3)  # same address, new shape
        with pytest.raises(ipc.WeightSyncError) as err:
            sender.sync(4, src)
        assert err.value.stage == "pre-write" and "shape mismatch" in str(err.value)
        tmp = {k: v.detach().clone() for k, v in params.items()}
        ref = weakref.ref(tmp["w"])
        sender.sync(4, tmp)
        del tmp
        gc.collect()
        assert ref() is None
    finally:
        sender.close()
        recv.close()
        s_end.close()
        r_end.close()


def test_receiver_constructor_names_every_problem():
    s_end, r_end = ipc.channel_pair()
    base = torch.zeros(10)
    with pytest.raises(ValueError) as info:
        ipc.WeightReceiver(r_end, {"a": base[:6], "b": base[4:], "c": torch.zeros(2)},
                           modes={"lora": ["a"], "full": ["zz"]}, backend="tcp",
                           verify="maybe", timeout_s=0)
    text = str(info.value)
    for needle in ("share storage", "unknown modes", "params: zz", "backend", "verify", "timeout"):
        assert needle in text, (needle, text)
    s_end.close()
    r_end.close()


def test_sender_rejects_bad_arguments_and_values():
    s_end, r_end = ipc.channel_pair()
    with pytest.raises(ValueError) as info:
        ipc.WeightSender(s_end, backend="x", bucket_bytes=10, timeout_s=-1)
    assert all(w in str(info.value) for w in ("backend", "bucket_bytes", "timeout_s"))
    sender = ipc.WeightSender(s_end)
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(-1, {"a": [1, 2]})
    assert err.value.stage == "pre-write" and len(err.value.problems) == 2
    s_end.close()
    r_end.close()


def test_checksum_thread_safety_smoke():
    """checksum() while idle from another thread returns the same digest."""
    s_end, r_end = ipc.channel_pair()
    params = {"a": torch.randn(100)}
    recv = ipc.WeightReceiver(r_end, params).start()
    out = []
    th = threading.Thread(target=lambda: out.append(recv.checksum()))
    th.start()
    th.join()
    assert out == [recv.checksum()] == [weights_checksum(params, impl="torch")]
    recv.close()
    s_end.close()
    r_end.close()
