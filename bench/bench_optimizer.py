"""One clip + AdamW step over the full bench model's parameters, per implementation, against
the device's copy floor measured in the same run.

    python bench/bench_optimizer.py [--layers 8] [--out FILE]     # H200: ~2 minutes
    python bench/bench_optimizer.py --layers 1 --repeats 2        # checks the script runs

Shapes: every parameter of bench_step.py's Qwen-Image-shaped transformer (``--layers``
blocks, real width), fp32 master parameters with fp32 gradients and AdamW moments, as the
full-fine-tuning actor holds them at world size 1. One step = the gradient-norm clip (one
fused norm over the gradients) and the AdamW update:

``fused`` (the actor's path), ``foreach`` and ``compiled`` (floors.optimizer_step says what
each runs).

Floor: the step must read parameter, gradient and both moments and write parameter and both
moments (28 bytes a parameter), and the clip reads every gradient once more (4 bytes): 32
bytes a parameter at the bandwidth of a large device-to-device copy timed here. Each variant
starts from the same state and its parameters after one step are compared with the fused
step's (``max_abs_diff``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

import torch  # noqa: E402

from floors import _median_ms, _release, optimizer_step  # noqa: E402

VARIANTS = ("fused", "foreach", "compiled")
BYTES_PER_PARAM = 32


def bench_shapes(layers: int) -> list[torch.Size]:
    """The parameter shapes of bench_step.py's transformer, built on the meta device."""
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=layers,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584)
    return [p.shape for p in model.parameters()]


def copy_gb_per_s(gib: int = 2) -> float:
    """Device memory bandwidth of a large copy (bytes read + written per second)."""
    src = torch.empty(gib * 2 ** 30 // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    del src, dst
    return 2 * gib * 2 ** 30 / (ms / 1e3) / 1e9


def make_state(shapes: list[torch.Size], seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.randn(s, device="cuda", generator=gen).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    return params


def measure(variant: str, shapes, repeats: int, reference: list[torch.Tensor] | None):
    params = make_state(shapes)
    opt, step = optimizer_step(variant, params)
    try:
        step()  # the first step (and the compile) on the shared starting state
        torch.cuda.synchronize()
        after_one = [p.detach().cpu() for p in params[::16]]
        diff = (max(float((a - b).abs().max()) for a, b in zip(after_one, reference))
                if reference is not None else 0.0)
        ms = _median_ms(step, warmup=2, iters=repeats)
        return ms, diff, after_one
    finally:
        del params, opt, step
        _release()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    shapes = bench_shapes(args.layers)
    numel = sum(s.numel() for s in shapes)
    bandwidth = copy_gb_per_s()
    floor_ms = BYTES_PER_PARAM * numel / (bandwidth * 1e9) * 1e3
    rows, reference = [], None
    for variant in ["fused"] + [v for v in args.variants if v != "fused"]:
        ms, diff, after_one = measure(variant, shapes, args.repeats, reference)
        reference = reference if reference is not None else after_one
        rows.append({"variant": variant, "ms": ms, "floor_ratio": ms / floor_ms,
                     "max_abs_diff": diff})
    print(f"{numel / 1e9:.3f} B parameters in {len(shapes)} tensors; copy {bandwidth:.0f} GB/s;"
          f" floor ({BYTES_PER_PARAM} B/param) {floor_ms:.2f} ms")
    print("| variant | ms | / floor | max abs diff vs fused |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['ms']:.2f} | {r['floor_ratio']:.2f}x | "
              f"{r['max_abs_diff']:.2e} |")
    result = {"params": numel, "tensors": len(shapes), "copy_gb_per_s": bandwidth,
              "floor_ms": floor_ms, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    record(result, args)
    return 0


def record(result: dict, args) -> None:
    from bench.results import Recorder, device_name

    rec = Recorder("bench_optimizer", device=device_name("cuda"))
    case = f"qwen{args.layers}l-full-fp32"
    rec.add(case, "copy_floor_ms", result["floor_ms"], "ms")
    for r in result["rows"]:
        rec.add(f"{case}-{r['variant']}", "clip_adamw_step_ms", r["ms"], "ms")
        rec.add(f"{case}-{r['variant']}", "floor_ratio", r["floor_ratio"], "x")
    rec.write()


if __name__ == "__main__":
    sys.exit(main())
