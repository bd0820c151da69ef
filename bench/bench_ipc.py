"""Weight-sync benchmark: two processes on one GPU, ipc/ against the torch-reductions path.

    python bench/bench_ipc.py --out ipc.md            # H200: about 1-2 minutes; --sweep adds
                                                      # kernel configs (CHUNK, BLOCK32, warps, PACK16)
    python bench/bench_ipc.py --device cpu --smoke --out /tmp/x.md  # logic check, shm backend

Measures, in one run: the device copy ceiling; the Triton copy+checksum kernel alone (and a
config sweep with --sweep); end-to-end syncs (full tensors ready on the sender -> version committed
on the receiver, verification included) of DiT-shaped bf16 weights (3072x3072 and 3072x12288
matrices plus norms) at 4 GB and 16 GB, with verify="full" and "fused"; an adapter sync of
1,440 LoRA tensors (377 MB); per-bucket overhead (the same 4 GB at several bucket sizes);
handle opens per sync; and SGLang's update_weights_from_tensor path (tensors pickled with
torch.multiprocessing's CUDA reductions, rebuilt in the receiver, copied into place). Before
timing it checks the CUDA backend: bit-exact round trip of mixed dtypes, checksums against
the torch reference, a pre-write rejection and a post-write failure with retry. Exit status
is 1 if any check failed. Prints a markdown table; --out also gets it (and FILE.json).
"""
from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.multiprocessing  # noqa: E402,F401  (registers the CUDA tensor reductions)

import ipc  # noqa: E402
from ipc import _kernels  # noqa: E402
from ipc._copyplan import CopyPlan, fold_lanes  # noqa: E402
from ipc.protocol import plan_buckets  # noqa: E402

CTX = mp.get_context("spawn")


# ------------------------------------------------------------------------ payloads
def dit_spec(target_bytes: int, hidden: int, ff: int) -> list[tuple[str, tuple, torch.dtype]]:
    block = [("attn.to_q.weight", (hidden, hidden)), ("attn.to_k.weight", (hidden, hidden)),
             ("attn.to_v.weight", (hidden, hidden)), ("attn.to_out.weight", (hidden, hidden)),
             ("ff.up.weight", (ff, hidden)), ("ff.down.weight", (hidden, ff)),
             ("norm1.weight", (hidden,)), ("norm2.weight", (hidden,))]
    per_block = 2 * sum(torch.Size(s).numel() for _, s in block)
    n_blocks = max(1, round(target_bytes / per_block))
    return [(f"blocks.{b}.{n}", s, torch.bfloat16) for b in range(n_blocks) for n, s in block]


def adapter_spec(n_modules: int, rank: int, dim: int) -> list[tuple[str, tuple, torch.dtype]]:
    out = []
    for m in range(n_modules):
        out.append((f"blocks.{m // 12}.m{m % 12}.lora_A.weight", (rank, dim), torch.bfloat16))
        out.append((f"blocks.{m // 12}.m{m % 12}.lora_B.weight", (dim, rank), torch.bfloat16))
    return out


def mixed_spec() -> list[tuple[str, tuple, torch.dtype]]:
    return [("a.fp32_to_bf16", (257, 1031), torch.bfloat16), ("b.bf16_to_fp32", (77, 13),
            torch.float32), ("c.fp16", (4097,), torch.float16), ("d.fp32", (3, 5, 7),
            torch.float32), ("e.split", (3_000_011,), torch.bfloat16), ("f.empty", (0,),
            torch.float32), ("g.int64", (19,), torch.int64), ("h.bf16", (64, 33), torch.bfloat16)]


def mixed_sources(device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    specials = torch.tensor([0x3F808000, 0x3F818000, 0x7F800000, 0xFF800000, 0x7FC00001,
                             0x80000000, 0x00000001, 0x7F7FFFFF, 0x00018000],
                            dtype=torch.int64).to(torch.int32).view(torch.float32)
    a = torch.randn(257 * 1031, generator=g)
    a[:len(specials)] = specials
    src = {"a.fp32_to_bf16": a.view(257, 1031),
           "b.bf16_to_fp32": torch.randn(77, 13, generator=g).to(torch.bfloat16),
           "c.fp16": torch.randn(4097, generator=g).half(),
           "d.fp32": torch.randn(3, 5, 7, generator=g),
           "e.split": torch.randn(3_000_011, generator=g).to(torch.bfloat16),
           "f.empty": torch.zeros(0), "g.int64": torch.arange(19) * 7,
           "h.bf16": torch.randn(64, 33, generator=g)}  # fp32 -> bf16 as well
    return {n: t.to(device) for n, t in src.items()}


def make_params(spec, device, seed) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape, dt in spec:
        if dt.is_floating_point:
            out[name] = torch.nn.Parameter(torch.randn(shape, generator=g, device=device,
                                                       dtype=torch.float32).to(dt))
        else:
            out[name] = torch.zeros(shape, dtype=dt, device=device)
    return out


# ------------------------------------------------------------------------ engine process
def _engine(ctl, jobs, device) -> None:
    """Engine side: one WeightReceiver per job; then answers commands on `ctl`."""
    params, receivers = {}, {}
    for rid, (conn, spec, kwargs, seed) in jobs.items():
        params[rid] = make_params(spec, device, seed)
        receivers[rid] = ipc.WeightReceiver(conn, params[rid], **kwargs).start()
    if device != "cpu":
        torch.cuda.empty_cache()  # the pre-re-homing copies: give them back for the sender
    ctl.send("ready")
    while True:
        cmd = ctl.recv()
        op = cmd[0]
        try:
            if op == "quit":
                return
            rid = cmd[1]
            r, p = receivers[rid], params[rid]
            if op == "state":
                ctl.send((r.version, r.dirty))
            elif op == "checksums":  # Triton (receiver) and the torch reference, same bytes
                ctl.send((r.checksum(), ipc.weights_checksum(
                    {n: t.detach() for n, t in p.items()}, impl="torch")))
            elif op == "weights":  # fresh CPU copies (a view of shm cannot be pickled)
                ctl.send({n: t.detach().to("cpu", copy=True) for n, t in p.items()})
            elif op == "baseline":  # SGLang's update_weights_from_tensor, receiving side
                t0 = time.perf_counter()
                pairs = ForkingPickler.loads(cmd[2])  # rebuild: opens each IPC handle
                t1 = time.perf_counter()
                with torch.no_grad():
                    for name, t in pairs:
                        p[name].copy_(t)
                if device != "cpu":
                    torch.cuda.synchronize()
                t2 = time.perf_counter()
                pairs = t = None  # releases every rebuilt handle (part of the path's cost)
                t3 = time.perf_counter()
                ctl.send(("done", {"rebuild": t1 - t0, "copy": t2 - t1, "release": t3 - t2}))
        except Exception:
            ctl.send(("error", traceback.format_exc()))


# ------------------------------------------------------------------------ helpers
def _sync_device(device):
    if device != "cpu":
        torch.cuda.synchronize()


def timed(fn, device, reps, warmup=2) -> list[float]:
    if device == "cpu":  # --smoke: the kernel runs interpreted, only the logic matters
        reps, warmup = 1, 0
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        _sync_device(device)
        t0 = time.perf_counter()
        fn()
        _sync_device(device)
        out.append(time.perf_counter() - t0)
    return out


def _segments_of(tensors) -> int:
    """Distinct caching-allocator segments holding `tensors`: one IPC handle each."""
    segs = sorted((sg["address"], sg["address"] + sg["total_size"])
                  for sg in torch.cuda.memory_snapshot())
    starts = [a for a, _ in segs]
    return len({bisect.bisect_right(starts, t.data_ptr()) for t in tensors})


def med(xs):
    return statistics.median(xs) if xs else float("nan")


class Report:
    def __init__(self):
        self.rows, self.checks, self.notes = [], [], []

    def check(self, name, ok, detail=""):
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}", flush=True)

    def row(self, **kw):
        self.rows.append(kw)
        print("  " + ", ".join(f"{k}={v}" for k, v in kw.items()), flush=True)

    def section(self, name, fn):
        print(f"== {name}", flush=True)
        try:
            fn()
        except Exception:
            self.check(f"{name} ran", False, traceback.format_exc().replace("\n", " | "))


def local_copy_bench(report, sources: dict, device, reps, label, store=True):
    """The kernel alone: copy (or read) `sources` into a local buffer through a CopyPlan."""
    names = list(sources)
    dst_dt = [torch.bfloat16 if sources[n].dtype == torch.float32 else sources[n].dtype
              for n in names]
    numels = [sources[n].numel() for n in names]
    offsets, total = [], 0
    for n, dt in zip(numels, dst_dt):
        offsets.append(total)
        total += -(-n * torch.empty(0, dtype=dt).element_size() // 256) * 256
    mem = torch.empty(total + 256, dtype=torch.uint8, device=device)
    buckets = plan_buckets(numels, [torch.empty(0, dtype=d).element_size() for d in dst_dt],
                           512 << 20)
    plan = CopyPlan(buckets, offsets, numels, [sources[n].dtype for n in names], dst_dt,
                    torch.device(device), use_kernel=True)
    import numpy as np
    ptrs = np.array([sources[n].data_ptr() for n in names], dtype=np.int64)
    srcs = dict(enumerate(sources[n] for n in names))

    def run():
        sums, extra = plan.new_sums(), []
        for b in range(len(plan.buckets)):
            plan.run_bucket(b, mem, ptrs, srcs, sums, extra, store=store)
        return sums, extra
    ts = timed(run, device, reps)
    payload = sum(n * torch.empty(0, dtype=d).element_size() for n, d in zip(numels, dst_dt))
    src_bytes = sum(t.numel() * t.element_size() for t in sources.values())
    traffic = src_bytes + (payload if store else 0)
    report.row(what=label, bytes=payload, ms=round(med(ts) * 1e3, 3),
               payload_TBps=round(payload / med(ts) / 1e12, 3),
               traffic_TBps=round(traffic / med(ts) / 1e12, 3), launches=plan.n_launches)
    sums, extra = run()
    return fold_lanes(sums.cpu().numpy(), [(k, t.tolist()) for k, t in extra], len(names))


# ------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time other (CHUNK, BLOCK32, warps, PACK16) kernel configs "
                         "(~20 s more)")
    args = ap.parse_args(argv)
    device = args.device
    if device == "cpu":  # the kernel module is imported at the first launch, after this
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu --smoke for a logic check", file=sys.stderr)
        return 2
    hidden, ff = (64, 256) if args.smoke else (3072, 12288)
    sizes = {"4GB": 1e6 if args.smoke else 4e9, "16GB": 2e6 if args.smoke else 16e9}
    ad_modules, ad_rank, ad_dim = (24, 4, 64) if args.smoke else (720, 64, 2048)
    reps = {"4GB": 20, "16GB": 10, "adapter": 50, "baseline": 3}
    if args.smoke:
        reps = {k: 2 for k in reps}
    report = Report()
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name()
           if device == "cuda" else "cpu", "smoke": args.smoke}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import cupy
        env["cupy"] = cupy.__version__
    except ImportError:
        env["cupy"] = None
    print(env, flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    dit16 = dit_spec(int(sizes["16GB"]), hidden, ff)
    dit4 = dit_spec(int(sizes["4GB"]), hidden, ff)
    ad = adapter_spec(ad_modules, ad_rank, ad_dim)
    src16 = {n: torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dt)
             for n, s, dt in dit16}
    src4 = {n: src16[n] for n, _, _ in dit4}
    src_ad = {n: torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dt)
              for n, s, dt in ad}
    ceiling = {}

    def sec_ceiling():
        a = torch.empty(int(sizes["4GB"]) // 2, dtype=torch.bfloat16, device=device)
        b = torch.empty_like(a)
        ts = timed(lambda: b.copy_(a), device, 10)
        ceiling["payload"] = a.numel() * 2 / med(ts)
        report.row(what="torch copy_ (ceiling)", bytes=a.numel() * 2,
                   ms=round(med(ts) * 1e3, 3), payload_TBps=round(ceiling["payload"] / 1e12, 3))
    report.section("device copy ceiling", sec_ceiling)

    def sec_kernel():
        if not _kernels.triton_available():
            report.check("triton available", False)
            return
        lanes = local_copy_bench(report, src4, device, 10, "kernel copy bf16->bf16 (4GB)")
        want = ipc.checksum.reference_lanes(list(src4.values())[:8])
        report.check("kernel lanes == torch reference (first 8 tensors)",
                     (lanes[:8] == want).all())
        local_copy_bench(report, src4, device, 10, "kernel read-only checksum (4GB)",
                         store=False)
        half = dict(list(src4.items())[:len(src4) // 2])
        f32 = {n: t.float() for n, t in half.items()}
        local_copy_bench(report, f32, device, 10, "kernel copy fp32->bf16 (4GB out)")
        del f32
        if device == "cuda" and args.sweep:
            # (CHUNK, BLOCK32, warps, PACK16); 16-bit copies move 2*BLOCK32 words per
            # iteration, so the PACK16=False rows repeat run 1's word-wise configs:
            # (CHUNK 128 Ki, BLOCK 8192, 8 warps) 1.49 TB/s, (64 Ki, 2048, 4) 1.47,
            # (64 Ki, 4096, 8) 1.11.
            base = (_kernels.CHUNK, _kernels.BLOCK32, _kernels.NUM_WARPS, _kernels.PACK16)
            for cfg in ((1 << 17, 4096, 8, False), (1 << 16, 1024, 4, False),
                        (1 << 16, 2048, 8, False), (1 << 16, 1024, 4, True),
                        (1 << 17, 8192, 8, True), (1 << 17, 2048, 4, True),
                        (1 << 18, 4096, 8, True)):
                (_kernels.CHUNK, _kernels.BLOCK32, _kernels.NUM_WARPS, _kernels.PACK16) = cfg
                local_copy_bench(report, src4, device, 10,
                                 "sweep CHUNK={} BLOCK32={} warps={} PACK16={}".format(*cfg))
            _kernels.CHUNK, _kernels.BLOCK32, _kernels.NUM_WARPS, _kernels.PACK16 = base
        # per-tensor torch copies of the adapter payload: the launch-bound alternative
        dst = {n: torch.empty_like(t) for n, t in src_ad.items()}
        ts = timed(lambda: [dst[n].copy_(t) for n, t in src_ad.items()], device, 10)
        report.row(what=f"torch per-tensor copy_ ({len(src_ad)} adapter tensors)",
                   ms=round(med(ts) * 1e3, 3), launches=len(src_ad))
        local_copy_bench(report, src_ad, device, 10,
                         f"kernel copy+checksum ({len(src_ad)} adapter tensors)")
    report.section("kernel alone", sec_kernel)
    if device != "cpu":
        torch.cuda.empty_cache()

    # ---- the engine process: one receiver per scenario
    jobs, senders = {}, {}
    spec_of = {"r4f": (dit4, {"verify": "full"}), "r4u": (dit4, {"verify": "fused"}),
               "r16f": (dit16, {"verify": "full"}), "r16u": (dit16, {"verify": "fused"}),
               "rad": (ad, {"verify": "full", "modes": {"adapter": [n for n, _, _ in ad]}}),
               "rmix": (mixed_spec(), {"verify": "full"})}
    for rid, (spec, kw) in spec_of.items():
        s_end, r_end = ipc.channel_pair()
        jobs[rid] = (r_end, spec, kw, 1)
        senders[rid] = ipc.WeightSender(
            s_end, bucket_bytes=(1 << 20) if rid == "rmix" else 512 << 20, timeout_s=120.0)
    ctl, child = CTX.Pipe()
    proc = CTX.Process(target=_engine, args=(child, jobs, device), daemon=True)
    t_spawn = time.perf_counter()
    proc.start()
    for r_end, *_ in jobs.values():
        r_end.close()
    child.close()

    def call(*cmd):
        ctl.send(cmd)
        out = ctl.recv()
        if isinstance(out, tuple) and out and out[0] == "error":
            raise RuntimeError(out[1])
        return out
    ok = ctl.recv() == "ready"
    report.check("engine process up", ok, f"({time.perf_counter() - t_spawn:.1f} s)")

    def sec_correct():
        snd = senders["rmix"]
        src = mixed_sources(device)
        stats = snd.sync(1, src)
        got = call("weights", "rmix")
        dtypes = {n: dt for n, _, dt in mixed_spec()}
        exact = True
        for n, t in src.items():
            want, out = t.to(dtypes[n]).cpu(), got[n]
            nan = torch.isnan(t.cpu().float()) if t.is_floating_point() else \
                torch.zeros(t.shape, dtype=torch.bool)
            exact &= bool(torch.isnan(out[nan]).all()) and torch.equal(
                out[~nan].view(torch.uint8) if out.numel() else out, want[~nan].view(
                    torch.uint8) if want.numel() else want)
        report.check("mixed dtypes round trip bit-exact (NaN -> NaN)", exact)
        tri, ref = call("checksums", "rmix")
        report.check("checksums: receiver (Triton) == torch reference == sender",
                     tri == ref == stats.checksum, f"{tri} {ref} {stats.checksum}")
        report.check("buckets split the 3M tensor", stats.buckets >= 6, f"{stats.buckets}")
        before = call("checksums", "rmix")[1]
        try:
            snd.sync(2, {**src, "d.fp32": torch.zeros(5, 3, 7, device=device)})
            report.check("pre-write rejection", False, "no error")
        except ipc.WeightSyncError as exc:
            report.check("pre-write rejection leaves weights", exc.stage == "pre-write"
                         and call("checksums", "rmix")[1] == before
                         and call("state", "rmix") == (1, False))
        real = CopyPlan.run_bucket

        def corrupt(self, b, memory, *a, **k):
            real(self, b, memory, *a, **k)
            if b == 0:
                memory[self.dst_offsets[0]] ^= 0x40
        CopyPlan.run_bucket = corrupt
        try:
            snd.sync(2, src)
            report.check("post-write failure detected", False, "no error")
        except ipc.WeightSyncError as exc:
            report.check("post-write failure: dirty, version kept",
                         exc.stage == "post-write" and call("state", "rmix") == (1, True),
                         exc.problems[0][:80])
        finally:
            CopyPlan.run_bucket = real
        stats = snd.sync(2, src)
        report.check("retry of the same version commits",
                     call("state", "rmix") == (2, False) and
                     call("checksums", "rmix")[0] == stats.checksum)
    report.section("CUDA backend correctness", sec_correct)

    def scenario(rid, label, src, n, mode="full", version0=1):
        snd = senders[rid]
        first = snd.sync(version0, src, mode=mode)
        stats = [snd.sync(version0 + 1 + i, src, mode=mode) for i in range(n)]
        secs = [s.seconds for s in stats]
        m = med(secs)
        tb = first.bytes / m
        row = dict(what=label, bytes=first.bytes, tensors=first.tensors,
                   buckets=first.buckets, launches=first.launches, ms=round(m * 1e3, 3),
                   min_ms=round(min(secs) * 1e3, 3), TBps=round(tb / 1e12, 3),
                   opens_first=first.handle_opens,
                   opens_later=max(s.handle_opens for s in stats))
        for k in ("prepare", "begin", "write", "commit"):
            row[f"{k}_ms"] = round(med([s.timings[k] for s in stats]) * 1e3, 3)
        if ceiling.get("payload"):
            row["of_ceiling"] = f"{100 * tb / ceiling['payload']:.0f}%"
        report.row(**row)
        return m, stats[-1]

    results = {}

    def sec_ours():
        results["4GB_full"] = scenario("r4f", "ipc full sync 4GB, verify=full", src4,
                                       reps["4GB"])
        results["4GB_fused"] = scenario("r4u", "ipc full sync 4GB, verify=fused", src4,
                                        reps["4GB"])
        results["16GB_full"] = scenario("r16f", "ipc full sync 16GB, verify=full", src16,
                                        reps["16GB"])
        results["16GB_fused"] = scenario("r16u", "ipc full sync 16GB, verify=fused", src16,
                                         reps["16GB"])
        tri, ref = call("checksums", "r16f")
        report.check("16GB: receiver checksum (Triton) == torch reference == sender",
                     tri == ref == results["16GB_full"][1].checksum)
        results["adapter"] = scenario("rad", f"ipc adapter sync ({len(src_ad)} tensors)",
                                      src_ad, reps["adapter"], mode="adapter")
    report.section("ipc syncs", sec_ours)

    def sec_buckets():
        snd, pts = senders["r4f"], []
        version = 1000
        for mb in (512, 128, 32, 8):
            snd.bucket_bytes = mb << 20 if not args.smoke else max(1 << 16, mb << 10)
            stats = []
            for _ in range(reps["4GB"] // 2 + 2):
                version += 1
                stats.append(snd.sync(version, src4))
            m = med([s.seconds for s in stats[2:]])
            pts.append((stats[-1].buckets, m))
            report.row(what=f"4GB bucket {mb} MB", buckets=stats[-1].buckets,
                       launches=stats[-1].launches, ms=round(m * 1e3, 3))
        (b0, t0), (b1, t1) = pts[0], pts[-1]
        if b1 > b0:
            report.row(what="per-bucket overhead (slope 512 MB -> 8 MB)",
                       us=round((t1 - t0) / (b1 - b0) * 1e6, 1))
        snd.bucket_bytes = 512 << 20
    report.section("per-bucket overhead", sec_buckets)

    def sec_baseline():
        """SGLang's update_weights_from_tensor per sync: reduce_tensor per tensor (pickling
        with torch's CUDA reductions), rebuild in the engine (IPC opens), copy_ into the
        weights, device sync, release of the rebuilt tensors (IPC closes), reply. The
        sources are fresh allocations each sync, as full_tensor() results are. `ms` is that
        round trip; `ms_incl_producer_release` adds the trainer dropping its tensors
        (torch.cuda.ipc_collect: blocks a consumer held wait in limbo until then)."""
        for label, src in (("4GB", src4), ("16GB", src16)):
            ts, full, phases, handles = [], [], [], 0
            for _ in range(reps["baseline"]):
                fresh = {n: t.clone() for n, t in src.items()}  # new storages, as each step
                if device != "cpu" and not handles:  # IPC handles sent (untimed)
                    handles = _segments_of(fresh.values())
                _sync_device(device)
                t0 = time.perf_counter()
                payload = bytes(ForkingPickler.dumps(list(fresh.items())))
                t_dumps = time.perf_counter() - t0
                out = call("baseline", "r16f", payload)
                ts.append(time.perf_counter() - t0)
                del fresh, payload
                if device != "cpu":
                    torch.cuda.ipc_collect()
                full.append(time.perf_counter() - t0)
                phases.append({"reduce": t_dumps, **out[1]})
            m = med(ts)
            nbytes = sum(t.numel() * t.element_size() for t in src.values())
            row = dict(what=f"torch reductions (SGLang path) {label}", bytes=nbytes,
                       tensors=len(src), handles=handles, ms=round(m * 1e3, 1),
                       ms_incl_producer_release=round(med(full) * 1e3, 1),
                       first_ms=round(ts[0] * 1e3, 1), TBps=round(nbytes / m / 1e12, 4))
            for k in ("reduce", "rebuild", "copy", "release"):
                row[f"{k}_ms"] = round(med([ph[k] for ph in phases]) * 1e3, 2)
            speedups = []
            for verify in ("full", "fused"):
                ours = results.get(f"{label}_{verify}", (float("nan"),))[0]
                speedups.append(f"{m / ours:.1f}x (verify={verify})")
            if ceiling.get("payload"):  # what even a copy at the device ceiling could reach
                speedups.append(f"bound {m / (nbytes / ceiling['payload']):.1f}x (copy_ alone)")
            row["ipc_speedup"] = ", ".join(speedups)
            report.row(**row)
    report.section("torch-reductions baseline", sec_baseline)

    try:
        ctl.send(("quit",))
    except OSError:
        pass
    proc.join(30)
    for snd in senders.values():
        snd.close()
    text = render(env, report)
    print(text)
    if args.out:
        args.out.write_text(text)
        Path(str(args.out) + ".json").write_text(json.dumps(
            {"env": env, "rows": report.rows, "checks": report.checks}, indent=1, default=str))
    return 0 if all(c["ok"] for c in report.checks) else 1


def render(env, report) -> str:
    lines = [f"Environment: {env}", "", "| check | ok | detail |", "|---|---|---|"]
    lines += [f"| {c['check']} | {'PASS' if c['ok'] else 'FAIL'} | {c['detail'][:200]} |"
              for c in report.checks]
    keys = []
    for r in report.rows:
        keys += [k for k in r if k not in keys]
    lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in report.rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
