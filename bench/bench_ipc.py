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
import json
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.multiprocessing  # noqa: E402,F401  (registers the CUDA tensor reductions)

import ipc  # noqa: E402
from ipc import _kernels  # noqa: E402
from ipc._copyplan import CopyPlan  # noqa: E402
from bench.results import Recorder  # noqa: E402
from bench.ipc_helpers import (Report, _segments_of, _sync_device, adapter_spec,  # noqa: E402
                               dit_spec, local_copy_bench, make_params, med, mixed_sources,
                               mixed_spec, render, timed)

CTX = mp.get_context("spawn")


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


# ------------------------------------------------------------------------ sections
def sec_ceiling(ctx: "IpcBench") -> None:
    a = torch.empty(int(ctx.sizes["4GB"]) // 2, dtype=torch.bfloat16, device=ctx.device)
    b = torch.empty_like(a)
    ts = timed(lambda: b.copy_(a), ctx.device, 10)
    ctx.ceiling["payload"] = a.numel() * 2 / med(ts)
    ctx.report.row(what="torch copy_ (ceiling)", bytes=a.numel() * 2,
               ms=round(med(ts) * 1e3, 3), payload_TBps=round(ctx.ceiling["payload"] / 1e12, 3))


def sec_kernel(ctx: "IpcBench") -> None:
    if not _kernels.triton_available():
        ctx.report.check("triton available", False)
        return
    lanes = local_copy_bench(ctx.report, ctx.src4, ctx.device, 10, "kernel copy bf16->bf16 (4GB)")
    want = ipc.checksum.reference_lanes(list(ctx.src4.values())[:8])
    ctx.report.check("kernel lanes == torch reference (first 8 tensors)",
                 (lanes[:8] == want).all())
    local_copy_bench(ctx.report, ctx.src4, ctx.device, 10, "kernel read-only checksum (4GB)",
                     store=False)
    half = dict(list(ctx.src4.items())[:len(ctx.src4) // 2])
    f32 = {n: t.float() for n, t in half.items()}
    local_copy_bench(ctx.report, f32, ctx.device, 10, "kernel copy fp32->bf16 (4GB out)")
    del f32
    if ctx.device == "cuda" and ctx.args.sweep:
        # (CHUNK, BLOCK32, warps, PACK16); 16-bit copies move 2*BLOCK32 words per
        # iteration, so the PACK16=False rows repeat the word-wise kernel's configs
        base = (_kernels.CHUNK, _kernels.BLOCK32, _kernels.NUM_WARPS, _kernels.PACK16)
        for cfg in ((1 << 17, 4096, 8, False), (1 << 16, 1024, 4, False),
                    (1 << 16, 2048, 8, False), (1 << 16, 1024, 4, True),
                    (1 << 17, 8192, 8, True), (1 << 17, 2048, 4, True),
                    (1 << 18, 4096, 8, True)):
            (_kernels.CHUNK, _kernels.BLOCK32, _kernels.NUM_WARPS, _kernels.PACK16) = cfg
            local_copy_bench(ctx.report, ctx.src4, ctx.device, 10,
                             "sweep CHUNK={} BLOCK32={} warps={} PACK16={}".format(*cfg))
        _kernels.CHUNK, _kernels.BLOCK32, _kernels.NUM_WARPS, _kernels.PACK16 = base
    # per-tensor torch copies of the adapter payload: the launch-bound alternative
    dst = {n: torch.empty_like(t) for n, t in ctx.src_ad.items()}
    ts = timed(lambda: [dst[n].copy_(t) for n, t in ctx.src_ad.items()], ctx.device, 10)
    ctx.report.row(what=f"torch per-tensor copy_ ({len(ctx.src_ad)} adapter tensors)",
               ms=round(med(ts) * 1e3, 3), launches=len(ctx.src_ad))
    local_copy_bench(ctx.report, ctx.src_ad, ctx.device, 10,
                     f"kernel copy+checksum ({len(ctx.src_ad)} adapter tensors)")


def sec_correct(ctx: "IpcBench") -> None:
    snd = ctx.senders["rmix"]
    src = mixed_sources(ctx.device)
    stats = snd.sync(1, src)
    got = ctx.call("weights", "rmix")
    dtypes = {n: dt for n, _, dt in mixed_spec()}
    exact = True
    for n, t in src.items():
        want, out = t.to(dtypes[n]).cpu(), got[n]
        nan = torch.isnan(t.cpu().float()) if t.is_floating_point() else\
            torch.zeros(t.shape, dtype=torch.bool)
        exact &= bool(torch.isnan(out[nan]).all()) and torch.equal(
            out[~nan].view(torch.uint8) if out.numel() else out, want[~nan].view(
                torch.uint8) if want.numel() else want)
    ctx.report.check("mixed dtypes round trip bit-exact (NaN -> NaN)", exact)
    tri, ref = ctx.call("checksums", "rmix")
    ctx.report.check("checksums: receiver (Triton) == torch reference == sender",
                 tri == ref == stats.checksum, f"{tri} {ref} {stats.checksum}")
    ctx.report.check("buckets split the 3M tensor", stats.buckets >= 6, f"{stats.buckets}")
    before = ctx.call("checksums", "rmix")[1]
    try:
        snd.sync(2, {**src, "d.fp32": torch.zeros(5, 3, 7, device=ctx.device)})
        ctx.report.check("pre-write rejection", False, "no error")
    except ipc.WeightSyncError as exc:
        ctx.report.check("pre-write rejection leaves weights", exc.stage == "pre-write"
                     and ctx.call("checksums", "rmix")[1] == before
                     and ctx.call("state", "rmix") == (1, False))
    real = CopyPlan.run_bucket

    def corrupt(self, b, memory, *a, **k):
        real(self, b, memory, *a, **k)
        if b == 0:
            memory[self.dst_offsets[0]] ^= 0x40
    CopyPlan.run_bucket = corrupt
    try:
        snd.sync(2, src)
        ctx.report.check("post-write failure detected", False, "no error")
    except ipc.WeightSyncError as exc:
        ctx.report.check("post-write failure: dirty, version kept",
                     exc.stage == "post-write" and ctx.call("state", "rmix") == (1, True),
                     exc.problems[0][:80])
    finally:
        CopyPlan.run_bucket = real
    stats = snd.sync(2, src)
    ctx.report.check("retry of the same version commits",
                 ctx.call("state", "rmix") == (2, False) and
                 ctx.call("checksums", "rmix")[0] == stats.checksum)


def scenario(ctx: "IpcBench", rid, label, src, n, mode="full", version0=1):
    snd = ctx.senders[rid]
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
    if ctx.ceiling.get("payload"):
        row["of_ceiling"] = f"{100 * tb / ctx.ceiling['payload']:.0f}%"
    ctx.report.row(**row)
    return m, stats[-1]


def sec_ours(ctx: "IpcBench") -> None:
    ctx.results["4GB_full"] = scenario(ctx, "r4f", "ipc full sync 4GB, verify=full", ctx.src4,
                                   ctx.reps["4GB"])
    ctx.results["4GB_fused"] = scenario(ctx, "r4u", "ipc full sync 4GB, verify=fused", ctx.src4,
                                    ctx.reps["4GB"])
    ctx.results["16GB_full"] = scenario(ctx, "r16f", "ipc full sync 16GB, verify=full", ctx.src16,
                                    ctx.reps["16GB"])
    ctx.results["16GB_fused"] = scenario(ctx, "r16u", "ipc full sync 16GB, verify=fused", ctx.src16,
                                     ctx.reps["16GB"])
    tri, ref = ctx.call("checksums", "r16f")
    ctx.report.check("16GB: receiver checksum (Triton) == torch reference == sender",
                 tri == ref == ctx.results["16GB_full"][1].checksum)
    ctx.results["adapter"] = scenario(ctx, "rad", f"ipc adapter sync ({len(ctx.src_ad)} tensors)",
                                  ctx.src_ad, ctx.reps["adapter"], mode="adapter")


def sec_buckets(ctx: "IpcBench") -> None:
    snd, pts = ctx.senders["r4f"], []
    version = 1000
    for mb in (512, 128, 32, 8):
        snd.bucket_bytes = mb << 20 if not ctx.args.smoke else max(1 << 16, mb << 10)
        stats = []
        for _ in range(ctx.reps["4GB"] // 2 + 2):
            version += 1
            stats.append(snd.sync(version, ctx.src4))
        m = med([s.seconds for s in stats[2:]])
        pts.append((stats[-1].buckets, m))
        ctx.report.row(what=f"4GB bucket {mb} MB", buckets=stats[-1].buckets,
                   launches=stats[-1].launches, ms=round(m * 1e3, 3))
    (b0, t0), (b1, t1) = pts[0], pts[-1]
    if b1 > b0:
        ctx.report.row(what="per-bucket overhead (slope 512 MB -> 8 MB)",
                   us=round((t1 - t0) / (b1 - b0) * 1e6, 1))
    snd.bucket_bytes = 512 << 20


def sec_baseline(ctx: "IpcBench") -> None:
    """SGLang's update_weights_from_tensor per sync: reduce_tensor per tensor (pickling
    with torch's CUDA reductions), rebuild in the engine (IPC opens), copy_ into the
    weights, device sync, release of the rebuilt tensors (IPC closes), reply. The
    sources are fresh allocations each sync, as full_tensor() results are. `ms` is that
    round trip; `ms_incl_producer_release` adds the trainer dropping its tensors
    (torch.cuda.ipc_collect: blocks a consumer held wait in limbo until then)."""
    for label, src in (("4GB", ctx.src4), ("16GB", ctx.src16)):
        ts, full, phases, handles = [], [], [], 0
        for _ in range(ctx.reps["baseline"]):
            fresh = {n: t.clone() for n, t in src.items()}  # new storages, as each step
            if ctx.device != "cpu" and not handles:  # IPC handles sent (untimed)
                handles = _segments_of(fresh.values())
            _sync_device(ctx.device)
            t0 = time.perf_counter()
            payload = bytes(ForkingPickler.dumps(list(fresh.items())))
            t_dumps = time.perf_counter() - t0
            out = ctx.call("baseline", "r16f", payload)
            ts.append(time.perf_counter() - t0)
            del fresh, payload
            if ctx.device != "cpu":
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
            ours = ctx.results.get(f"{label}_{verify}", (float("nan"),))[0]
            speedups.append(f"{m / ours:.1f}x (verify={verify})")
        if ctx.ceiling.get("payload"):  # what even a copy at the device ceiling could reach
            speedups.append(f"bound {m / (nbytes / ctx.ceiling['payload']):.1f}x (copy_ alone)")
        row["ipc_speedup"] = ", ".join(speedups)
        ctx.report.row(**row)


# ------------------------------------------------------------------------ the run
@dataclass
class IpcBench:
    """What every section of one run reads and fills: options, sources, results so far."""
    args: argparse.Namespace
    device: str
    report: Report
    sizes: dict
    reps: dict
    src4: dict
    src16: dict
    src_ad: dict
    ceiling: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)
    senders: dict = field(default_factory=dict)
    call: Callable | None = None  # a command to the engine process, its reply


def _parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time other (CHUNK, BLOCK32, warps, PACK16) kernel configs "
                         "(~20 s more)")
    return ap.parse_args(argv)


def _environment(device: str, smoke: bool) -> dict:
    """Versions for the report; triton and cupy are optional, recorded when installed."""
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name()
           if device == "cuda" else "cpu", "smoke": smoke}
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
    return env


def _start_engine(ctx: IpcBench, dit4, dit16, ad):
    """The engine process, one receiver per scenario; fills ``ctx.senders`` and ``ctx.call``."""
    jobs = {}
    spec_of = {"r4f": (dit4, {"verify": "full"}), "r4u": (dit4, {"verify": "fused"}),
               "r16f": (dit16, {"verify": "full"}), "r16u": (dit16, {"verify": "fused"}),
               "rad": (ad, {"verify": "full", "modes": {"adapter": [n for n, _, _ in ad]}}),
               "rmix": (mixed_spec(), {"verify": "full"})}
    for rid, (spec, kw) in spec_of.items():
        s_end, r_end = ipc.channel_pair()
        jobs[rid] = (r_end, spec, kw, 1)
        ctx.senders[rid] = ipc.WeightSender(
            s_end, bucket_bytes=(1 << 20) if rid == "rmix" else 512 << 20, timeout_s=120.0)
    ctl, child = CTX.Pipe()
    proc = CTX.Process(target=_engine, args=(child, jobs, ctx.device), daemon=True)
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
    ctx.call = call
    ok = ctl.recv() == "ready"
    ctx.report.check("engine process up", ok, f"({time.perf_counter() - t_spawn:.1f} s)")
    return proc, ctl


def _unit(key: str) -> str | None:
    """The unit a report column's name carries (None: not a figure)."""
    if key == "ms" or key.endswith("_ms") or key.startswith("ms_"):
        return "ms"
    if key == "us":
        return "us"
    if key.endswith("TBps"):
        return "TB/s"
    if key == "bytes":
        return "bytes"
    if key in ("tensors", "buckets", "launches", "handles", "opens_first", "opens_later"):
        return "count"
    return None


def record(rows: list[dict], env: dict, smoke: bool) -> None:
    """Every numeric column of the report as a row of bench/results.csv (bench/results.py):
    the row's label is the case (``ipc-full-sync-16gb-verify=fused``), the column the metric."""
    rec = Recorder("bench_ipc", device=env["device"])
    for row in rows:
        label = str(row["what"]).lower().replace("->", " to ")
        case = re.sub(r"[^a-z0-9=.+-]+", "-", label).strip("-")
        case = f"smoke-{case}" if smoke else case
        for key, value in row.items():
            unit = _unit(key)
            if unit is not None and isinstance(value, (int, float)):
                rec.add(case, key, value, unit)
    rec.write()


def main(argv=None) -> int:
    args = _parse_args(argv)
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
    env = _environment(device, args.smoke)
    print(env, flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    dit16 = dit_spec(int(sizes["16GB"]), hidden, ff)
    dit4 = dit_spec(int(sizes["4GB"]), hidden, ff)
    ad = adapter_spec(ad_modules, ad_rank, ad_dim)
    src16 = {n: torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dt)
             for n, s, dt in dit16}
    src_ad = {n: torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dt)
              for n, s, dt in ad}
    ctx = IpcBench(args, device, Report(), sizes, reps, src4={n: src16[n] for n, _, _ in dit4},
                   src16=src16, src_ad=src_ad)
    report = ctx.report
    report.section("device copy ceiling", lambda: sec_ceiling(ctx))
    report.section("kernel alone", lambda: sec_kernel(ctx))
    if device != "cpu":
        torch.cuda.empty_cache()
    proc, ctl = _start_engine(ctx, dit4, dit16, ad)
    report.section("CUDA backend correctness", lambda: sec_correct(ctx))
    report.section("ipc syncs", lambda: sec_ours(ctx))
    report.section("per-bucket overhead", lambda: sec_buckets(ctx))
    report.section("torch-reductions baseline", lambda: sec_baseline(ctx))
    try:
        ctl.send(("quit",))
    except OSError:
        pass
    proc.join(30)
    for snd in ctx.senders.values():
        snd.close()
    text = render(env, report)
    print(text)
    if args.out:
        args.out.write_text(text)
        Path(str(args.out) + ".json").write_text(json.dumps(
            {"env": env, "rows": report.rows, "checks": report.checks}, indent=1, default=str))
    passed = all(c["ok"] for c in report.checks)
    if passed:  # a run whose correctness checks failed leaves no figures behind
        record(report.rows, env, args.smoke)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
