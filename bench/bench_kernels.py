"""SDE transition + Gaussian log-prob, forward / backward / both: Triton vs eager vs torch.compile.

    python bench/bench_kernels.py --out kernels.md            # the table (GPU: ~2 minutes)
    python bench/bench_kernels.py --quick --out quick.md      # bf16, 8x36,864 and 64x1,048,576 (<1 min)
    python bench/bench_kernels.py --sweep --out sweep.md      # + forward tilings, for tuning
    python -m pytest bench/bench_kernels.py --benchmark-enable   # the same cases, pytest-benchmark

The baseline ("eager") is Flow-GRPO's formula written plainly in torch, fp32 math on
the stored dtype, autograd for the backward; "compile" is ``torch.compile`` of that function;
"triton" is ``kernels.sde_log_prob(..., backend="triton", validate=False)`` (the actor's hot
path after its schedule was validated once). Sigmas are per-sample [B] tensors, eta = 0.7.

Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs): device
time. Launch-bound cases are also timed "host-inclusive": back-to-back calls, one sync at the
end, so that Python, autograd and launch overheads count. A third table times the Triton kernels
alone, replayed from a CUDA graph (no Python, no autograd): the gap between it and the first
table is host overhead that do_bench could not hide. Bandwidth counts the bytes a fused
kernel must move: forward reads x, v, prev; backward reads them again and writes dv (it
recomputes the mean instead of saving a residual: saving one would cost a write in the
forward that forward-only callers would pay too). The copy
ceiling (read + write) is measured in the same run with a 1 GiB device-to-device copy.
Needs torch and triton only (no diffusers). Without CUDA it times the small shape on CPU
(Triton under TRITON_INTERPRET=1), which checks that the script works, nothing more.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.testing  # noqa: E402

import flowgrpo_kernels as kernels  # noqa: E402
from bench.results import Recorder, device_name  # noqa: E402
from flowgrpo_kernels import sde_triton  # noqa: E402
from trainer.utils.dtypes import RUN_DTYPES, TORCH_DTYPES  # noqa: E402

SHAPES = ((8, 36_864), (32, 262_144), (64, 1_048_576))
DTYPES = {name: TORCH_DTYPES[name] for name in RUN_DTYPES}
OPS = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("eager", "compile", "triton")
ETA = 0.7
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def eager_log_prob(x, v, prev, sigma, sigma_next):
    """Flow-GRPO's sde_step_with_logprob replay (paper, appendix A.4), fp32 math."""
    x, v, prev = x.float(), v.float(), prev.float()
    sigma, sigma_next = sigma.float()[:, None], sigma_next.float()[:, None]
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - sigma)) * ETA
    mean = (x * (1 + std_dev_t ** 2 / (2 * sigma) * dt)
            + v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt)
    std = std_dev_t * torch.sqrt(-dt)
    log_prob = -((prev.detach() - mean) ** 2) / (2 * std ** 2) - torch.log(std) - LOG_SQRT_2PI
    return log_prob.mean(dim=1)


def triton_log_prob(x, v, prev, sigma, sigma_next):
    return kernels.sde_log_prob(x, v, prev, sigma, sigma_next, eta=ETA, backend="triton", validate=False)


_COMPILED = {}
# One compiled graph per (shape, dtype): keep dynamo from falling back to eager after 8.
for _knob in ("cache_size_limit", "recompile_limit"):
    if hasattr(torch._dynamo.config, _knob):
        setattr(torch._dynamo.config, _knob, 64)


def implementation(name):
    if name == "eager":
        return eager_log_prob
    if name == "triton":
        return triton_log_prob
    if "compile" not in _COMPILED:
        _COMPILED["compile"] = torch.compile(eager_log_prob, dynamic=False)
    return _COMPILED["compile"]


def make_case(batch, n, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, n, generator=g, device=device).to(dtype)
    v = torch.randn(batch, n, generator=g, device=device).to(dtype).requires_grad_()
    sigma = torch.linspace(0.95, 0.3, batch, device=device)
    sigma_next = sigma - 0.05
    with torch.no_grad():
        noise = torch.randn(batch, n, generator=g, device=device)
        prev = kernels.sde_step(x, v, sigma, sigma_next, eta=ETA, noise=noise).prev_sample
    grad = torch.linspace(0.5, 1.5, batch, device=device)
    return x, v, prev, sigma, sigma_next, grad


def op_callable(fn, op, case):
    """A zero-argument callable timing ``op`` of ``fn``; the backward never accumulates into .grad."""
    x, v, prev, sigma, sigma_next, grad = case
    if op == "fwd":
        return lambda: fn(x, v, prev, sigma, sigma_next)
    if op == "fwd+bwd":
        return lambda: torch.autograd.grad(fn(x, v, prev, sigma, sigma_next), v, grad)
    out = fn(x, v, prev, sigma, sigma_next)
    return lambda: torch.autograd.grad(out, v, grad, retain_graph=True)


def bytes_moved(batch, n, dtype, op):
    elements = batch * n * torch.tensor([], dtype=dtype).element_size()
    return {"fwd": 3, "bwd": 4, "fwd+bwd": 7}[op] * elements


class Timer:
    """Device time with triton's do_bench on CUDA; wall-clock medians on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def device_ms(self, fn):
        if self.cuda:
            return triton.testing.do_bench(fn, return_mode="median")
        return self.host_ms(fn)

    def host_ms(self, fn, budget_s=0.25):
        """Back-to-back calls, one sync at the end: what a Python loop of calls costs."""
        fn()
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        once = max(time.perf_counter() - start, 1e-6)
        iters = max(3, min(1000, int(budget_s / once)))
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            self.sync()
            samples.append((time.perf_counter() - start) / iters * 1e3)
        return statistics.median(samples)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def copy_ceiling_gbs(device, timer):
    """Device-to-device copy of 1 GiB (256 MiB on CPU), counting read + write."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 26)
    src = torch.empty(numel, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = timer.device_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def check_against_eager(case):
    """Max |difference| of log_prob and of dv between Triton and the eager baseline."""
    x, v, prev, sigma, sigma_next, grad = case
    out_e = eager_log_prob(x, v, prev, sigma, sigma_next)
    out_t = triton_log_prob(x, v, prev, sigma, sigma_next)
    dv_e, = torch.autograd.grad(out_e, v, grad)
    dv_t, = torch.autograd.grad(out_t, v, grad)
    return ((out_e - out_t).abs().max().item(),
            ((dv_e.float() - dv_t.float()).abs().max() / dv_e.float().abs().max()).item())


def run_table(shapes, dtypes, impls, device, timer, ceiling, log):
    rows, host_rows = [], []
    nan = float("nan")
    for batch, n in shapes:
        for dname in dtypes:
            dtype = DTYPES[dname]
            case = make_case(batch, n, dtype, device)
            err_lp, err_dv = check_against_eager(case)
            log(f"  {batch}x{n:,} {dname}: |dlogp| vs eager {err_lp:.2e}, rel |ddv| {err_dv:.2e}")
            times = {(impl, op): nan for impl in IMPLS for op in OPS}
            for impl in impls:
                fn = implementation(impl)
                for op in OPS:
                    try:
                        times[impl, op] = timer.device_ms(op_callable(fn, op, case))
                    except Exception as exc:  # e.g. torch.compile without a C compiler on CPU
                        log(f"  {impl} {op} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                        times[impl, op] = float("nan")
            for op in OPS:
                tri = times["triton", op]
                gbs = bytes_moved(batch, n, dtype, op) / (tri * 1e-3) / 1e9
                rows.append((f"{batch}x{n:,}", dname, op, times["eager", op], times["compile", op], tri,
                             gbs, 100 * gbs / ceiling, times["eager", op] / tri, times["compile", op] / tri))
            host = {impl: nan for impl in IMPLS}
            for impl in impls:
                if not math.isnan(times[impl, "fwd+bwd"]):
                    host[impl] = timer.host_ms(op_callable(implementation(impl), "fwd+bwd", case))
            host_rows.append((f"{batch}x{n:,}", dname, host["eager"], host["compile"], host["triton"]))
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows, host_rows


def run_graph_table(shapes, dtypes, device, timer, ceiling, log):
    """Device time of the Triton launches alone: fwd, bwd and both, replayed from a CUDA graph."""
    rows = []
    params = sde_triton.step_params("sde", ETA)
    for batch, n in shapes:
        for dname in dtypes:
            dtype = DTYPES[dname]
            x, v, prev, sigma, sigma_next, grad = make_case(batch, n, dtype, device)
            v = v.detach()
            calls = {
                "fwd": lambda: sde_triton.log_prob_forward(x, v, prev, sigma, sigma_next, params),
                "bwd": lambda: sde_triton.log_prob_backward(x, v, prev, grad, sigma, sigma_next, params),
            }
            calls["fwd+bwd"] = lambda: (calls["fwd"](), calls["bwd"]())
            for op, call in calls.items():
                try:
                    stream = torch.cuda.Stream(device)
                    with torch.cuda.stream(stream):  # warm-up (tuning, workspace) off the capture
                        for _ in range(3):
                            call()
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        call()
                    ms = timer.device_ms(graph.replay)
                except Exception as exc:
                    log(f"  graph {batch}x{n:,} {dname} {op} failed: {type(exc).__name__}: {exc}")
                    ms = float("nan")
                gbs = bytes_moved(batch, n, dtype, op) / (ms * 1e-3) / 1e9
                rows.append((f"{batch}x{n:,}", dname, op, ms, gbs, 100 * gbs / ceiling))
            del x, v, prev
            torch.cuda.empty_cache()
    return rows


def format_graph_table(rows):
    lines = ["", "Triton kernels alone (CUDA-graph replay: no Python, no autograd), device time:", "",
             "| shape | dtype | op | ms | GB/s | % of copy ceiling | x bytes floor |", "|---|---|---|---|---|---|---|"]
    for shape, dname, op, ms, gbs, pct in rows:
        lines.append(f"| {shape} | {dname} | {op} | {_ms(ms)} | {gbs:,.0f} | {pct:.0f}% | {100 / pct:.2f} |")
    return lines


def record(rows, host_rows, graph_rows, ceiling, device):
    """The tables as rows of bench/results.csv (bench/results.py): one case per shape, dtype
    and op (``64x1048576/bf16/fwd+bwd``), one metric per implementation; failed timings
    (NaN) are left out."""
    rec = Recorder("bench_kernels", device=device_name(device))
    rec.add("copy", "copy_ceiling", ceiling, "GB/s")

    def add(shape, dname, op, metric, value, unit):
        if not math.isnan(value):
            rec.add(f"{shape.replace(',', '')}/{dname}/{op}", metric, value, unit)

    for shape, dname, op, eager, comp, tri, gbs, *_ in rows:
        for metric, value in (("eager_ms", eager), ("compile_ms", comp), ("triton_ms", tri)):
            add(shape, dname, op, metric, value, "ms")
        add(shape, dname, op, "triton_bandwidth", gbs, "GB/s")
    for shape, dname, eager, comp, tri in host_rows:
        for metric, value in (("host_eager_ms", eager), ("host_compile_ms", comp),
                              ("host_triton_ms", tri)):
            add(shape, dname, "fwd+bwd", metric, value, "ms")
    for shape, dname, op, ms, gbs, _ in graph_rows:
        add(shape, dname, op, "triton_graph_ms", ms, "ms")
        add(shape, dname, op, "triton_graph_bandwidth", gbs, "GB/s")
    rec.write()


def run_sweep(device, timer, ceiling, log):
    """Forward-kernel tilings (the forward's tiling is fixed per N for determinism, not autotuned)."""
    rows = []
    for batch, n in ((8, 36_864), (64, 1_048_576)):
        x, v, prev, sigma, sigma_next, _ = make_case(batch, n, torch.bfloat16, device)
        v = v.detach()
        params = sde_triton.StepParams("sde", ETA)
        for block in (1024, 2048, 4096, 8192):
            for tiles in (1, 2, 4):
                for warps in (4, 8):
                    cfg = sde_triton.reduction_config(n, block=block, tiles=tiles, num_warps=warps)
                    ms = timer.device_ms(lambda: sde_triton.log_prob_forward(x, v, prev, sigma, sigma_next,
                                                                             params, cfg))
                    gbs = bytes_moved(batch, n, torch.bfloat16, "fwd") / (ms * 1e-3) / 1e9
                    rows.append((f"{batch}x{n:,}", block, tiles, warps, cfg.num_chunks(n), ms, 100 * gbs / ceiling))
        log(f"  swept {batch}x{n:,}")
    default = {(f"{b}x{n:,}", *(lambda c: (c.block, c.tiles, c.num_warps))(sde_triton.reduction_config(n)))
               for b, n in ((8, 36_864), (64, 1_048_576))}
    lines = ["| shape (bf16) | BLOCK | tiles | warps | chunks/sample | fwd ms | % of copy ceiling |",
             "|---|---|---|---|---|---|---|"]
    for shape, block, tiles, warps, chunks, ms, pct in rows:
        mark = " (default)" if (shape, block, tiles, warps) in default else ""
        lines.append(f"| {shape} | {block}{mark} | {tiles} | {warps} | {chunks} | {ms:.4f} | {pct:.0f}% |")
    return lines


def _ms(value):
    return "n/a" if math.isnan(value) else f"{value:.4f}"


def _ratio(value):
    return "n/a" if math.isnan(value) else f"{value:.1f}x"


def format_table(rows, host_rows, ceiling):
    lines = ["| shape | dtype | op | eager ms | compile ms | triton ms | triton GB/s | % of copy ceiling "
             "| x bytes floor | vs eager | vs compile |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, dname, op, eager, comp, tri, gbs, pct, r_e, r_c in rows:
        lines.append(f"| {shape} | {dname} | {op} | {_ms(eager)} | {_ms(comp)} | {_ms(tri)} | {gbs:,.0f} | "
                     f"{pct:.0f}% | {100 / pct:.2f} | {_ratio(r_e)} | {_ratio(r_c)} |")
    lines += ["", "Host-inclusive fwd+bwd (back-to-back calls, one sync at the end), ms per call:", "",
              "| shape | dtype | eager | compile | triton |", "|---|---|---|---|---|"]
    for shape, dname, eager, comp, tri in host_rows:
        lines.append(f"| {shape} | {dname} | {_ms(eager)} | {_ms(comp)} | {_ms(tri)} |")
    return lines


def parse_shapes(text):
    return tuple(tuple(int(p.replace(",", "").replace("_", "")) for p in item.split("x"))
                 for item in text.split(","))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown to this file")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="e.g. 8x36864,64x1048576 (default: the issue's three on CUDA, the small one on CPU)")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--impls", default=None,
                        help="subset of eager,compile,triton (default: all on CUDA, eager,triton on CPU)")
    parser.add_argument("--sweep", action="store_true", help="also time forward tilings")
    parser.add_argument("--quick", action="store_true",
                        help="bf16 at 8x36,864 and 64x1,048,576 only (a re-measure in under a minute)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        args.shapes = args.shapes or ((SHAPES[0], SHAPES[-1]) if device.type == "cuda" else SHAPES[:1])
        args.dtypes = "bf16"
    shapes = args.shapes or (SHAPES if device.type == "cuda" else SHAPES[:1])
    dtypes = [d for d in args.dtypes.split(",") if d]
    impls = (args.impls or ("eager,compile,triton" if device.type == "cuda" else "eager,triton")).split(",")
    timer = Timer(device)
    started = time.perf_counter()

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    ceiling = copy_ceiling_gbs(device, timer)
    log(f"copy ceiling {ceiling:,.0f} GB/s on {name}")
    rows, host_rows = run_table(shapes, dtypes, impls, device, timer, ceiling, log)
    lines = [f"Date {datetime.date.today().isoformat()}; device {name}; torch {torch.__version__}; "
             f"triton {triton.__version__}; command `python bench/bench_kernels.py"
             f"{' ' + ' '.join(sys.argv[1:]) if argv is None and sys.argv[1:] else ''}`.", "",
             f"Copy ceiling ({'1 GiB' if device.type == 'cuda' else '256 MiB'} copy, read + write): "
             f"{ceiling:,.0f} GB/s.", ""]
    lines += format_table(rows, host_rows, ceiling)
    graph_rows = run_graph_table(shapes, dtypes, device, timer, ceiling, log) if device.type == "cuda" else []
    if graph_rows:
        lines += format_graph_table(graph_rows)
    if args.sweep and device.type != "cuda":
        log("  --sweep needs CUDA; skipped")
    elif args.sweep:
        lines += ["", "Forward-kernel tilings:", ""] + run_sweep(device, timer, ceiling, log)
    if device.type == "cuda":
        tuned = ", ".join(f"{key[0]} N={key[1]} {str(key[2]).replace('torch.', '')}: BLOCK {cfg[0]}, "
                          f"{cfg[1]} warps" for key, cfg in sorted(sde_triton._TUNED.items(), key=str))
        lines += ["", f"Elementwise kernels' tuned configs: {tuned}."]
    lines += ["", f"Total benchmark time {time.perf_counter() - started:.0f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    record(rows, host_rows, graph_rows, ceiling, device)


# ------------------------------------------------------------------------------ pytest-benchmark

def _bench_cases():
    cuda = torch.cuda.is_available()
    for batch, n in SHAPES:
        for dname in DTYPES:
            for op in OPS:
                for impl in IMPLS:
                    on_cpu = (batch, n) == SHAPES[0] and impl != "compile"
                    marks = [] if cuda or on_cpu else [_pytest.mark.skip(reason="CUDA only")]
                    yield _pytest.param(batch, n, dname, op, impl, marks=marks,
                                       id=f"{batch}x{n}-{dname}-{op}-{impl}")


try:
    import pytest as _pytest
except ImportError:  # the script needs no pytest
    _pytest = None

if _pytest is not None:
    @_pytest.mark.parametrize("batch, n, dname, op, impl", list(_bench_cases()))
    def test_sde_log_prob(benchmark, batch, n, dname, op, impl):
        """pytest-benchmark timing (host-inclusive, synchronised per round) of one case."""
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        timer = Timer(device)
        dtype = DTYPES[dname]
        call = op_callable(implementation(impl), op, make_case(batch, n, dtype, device))

        def synced():
            call()
            timer.sync()

        synced()  # compile / autotune outside the timed rounds
        benchmark.extra_info["bytes"] = bytes_moved(batch, n, dtype, op)
        benchmark.pedantic(synced, rounds=20 if device.type == "cuda" else 3, warmup_rounds=2)


if __name__ == "__main__":
    main()
