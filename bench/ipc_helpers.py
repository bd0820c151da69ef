"""Payloads and measuring helpers of bench/bench_ipc.py (DiT-shaped, adapter and mixed-dtype
weight sets; timing; the report and its markdown table)."""
from __future__ import annotations

import bisect
import statistics
import time
import traceback

import numpy as np
import torch

from ipc._copyplan import CopyPlan, fold_lanes
from ipc.protocol import plan_buckets


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
