"""The Qwen-Image transformer's compiled forward and forward + backward, with the trainer's fast
paths (trainer/patches/diffusers_qwen_fast_paths.py) and with diffusers' own code, each in its own process.

    python bench/bench_forward.py --model-dir /tmp/bench_qwen8       # H200: ~3 minutes
    python bench/bench_forward.py --tiny --layers 2 --repeats 2      # checks the script runs

Model: bench_step.py's Qwen-Image-shaped transformer (built into ``--model-dir`` when absent),
bf16, LoRA r64 on the adapter's targets, each block compiled (what the engine and the actor
run). Inputs: bench_step.py's geometry (384x384, 576 image tokens) and its prompt's text
length. Timed on the device (CUDA events, median of ``--repeats``): the no-grad forward of
``--batch`` rows (the engine's denoise step) and the forward + backward of ``--rows`` rows
(one replay micro-batch: 4 samples x 3 trained steps). Each path runs in a fresh process so
that neither compiles against the other's code.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from child_runs import add_model_args, figures_per_variant  # noqa: E402

PATHS = ("fast", "stock")


def measure(path: str, args) -> dict:
    """One path's figures, in this process."""
    from floors import _median_ms, floor_step, lora_transformer, text_tokens

    from trainer.patches.diffusers_qwen_fast_paths import install_fast_paths

    tokens = text_tokens(args.model_dir)
    adapter, model = lora_transformer(args.model_dir, args.rank, compiled=True)
    install_fast_paths(path == "fast")  # after loading, which installs them
    size = 64 if args.tiny else 384
    forward = floor_step(adapter, model, args.batch, tokens=tokens, height=size, width=size,
                         forward_only=True)
    forward_backward = floor_step(adapter, model, args.rows, tokens=tokens, height=size,
                                  width=size)
    warmup = max(2, args.repeats // 5)
    return {"path": path, "text_tokens": tokens,
            "forward_ms": _median_ms(forward, warmup, args.repeats),
            "fwd_bwd_ms": _median_ms(forward_backward, warmup, args.repeats)}


def record(figures: list[dict], args) -> None:
    from bench.results import Recorder, device_name

    rec = Recorder("bench_forward", device=device_name("cuda"))
    setup = f"{'tiny-' if args.tiny else ''}qwen{args.layers}l-lora{args.rank}"
    for f in figures:
        rec.add(f"{setup}-{f['path']}-paths", f"forward_b{args.batch}_ms", f["forward_ms"], "ms")
        rec.add(f"{setup}-{f['path']}-paths", f"fwd_bwd_b{args.rows}_ms", f["fwd_bwd_ms"], "ms")
    fast, stock = figures  # the same-run ratios
    rec.add(f"{setup}-fast-over-stock", f"forward_b{args.batch}_ratio",
            fast["forward_ms"] / stock["forward_ms"], "x")
    rec.add(f"{setup}-fast-over-stock", f"fwd_bwd_b{args.rows}_ratio",
            fast["fwd_bwd_ms"] / stock["fwd_bwd_ms"], "x")
    rec.write()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--batch", type=int, default=8, help="rows of the no-grad forward")
    p.add_argument("--rows", type=int, default=12, help="rows of the forward + backward")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--one", choices=PATHS, help=argparse.SUPPRESS)  # the child's path
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args)), flush=True)
        return 0
    figures = figures_per_variant(__file__, "bench_forward_", args, argv, list(PATHS))
    fast, stock = figures
    print(f"text tokens {fast['text_tokens']}; compiled blocks, bf16, LoRA r{args.rank}")
    print("| paths | forward B=%d ms | fwd+bwd B=%d ms |\n|---|---|---|" % (args.batch, args.rows))
    for f in figures:
        print(f"| {f['path']} | {f['forward_ms']:.2f} | {f['fwd_bwd_ms']:.2f} |")
    print(f"fast / stock: forward {fast['forward_ms'] / stock['forward_ms']:.3f}, "
          f"fwd+bwd {fast['fwd_bwd_ms'] / stock['fwd_bwd_ms']:.3f}")
    record(figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
