"""What a new prompt length costs the compiled LoRA blocks, per attention backend.

    python bench/bench_text_length.py --model-dir /tmp/bench_qwen8
    python bench/bench_text_length.py --backends efficient --profile-length 77  # where it goes
    python bench/bench_text_length.py --tiny --layers 2 --lengths 5 6 9         # runs at all

Qwen-Image pads a batch's prompt embeddings to its longest prompt, so the text length of the
actor's and the engine's forwards changes with the prompts; the adapter then pads it further,
with masked tokens, until image + text tokens are a multiple of 8 (the table gives both). The
blocks are compiled as the trainer compiles them (the adapter's text dimension marked dynamic),
and called through the adapter's velocity as the trainer calls them. For each length in
``--lengths``, in order, one forward + backward of ``--rows`` rows is timed on its first call
and again once warm; beside them, the compile events (torch.compile frames) and the files the
Inductor cache gained during that first call. A first call well above the warm one with no
compile event and no new file is a per-shape cost outside torch.compile.

Each attention backend runs in its own process (its choice is traced into the compiled
blocks): ``default`` is torch's own pick for the joint attention's boolean mask; the others
force one SDPA backend. ``--profile-length N`` prints the cProfile of the first call at N.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from child_runs import add_model_args, figures_per_variant  # noqa: E402

BACKENDS = {"default": None, "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
            "flash": "FLASH_ATTENTION", "math": "MATH"}


def _cache_files() -> int:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return sum(1 for f in Path(cache_dir()).rglob("*") if f.is_file())


def _timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(backend: str, args) -> dict:
    """One backend's figures, in this process."""
    import cProfile
    import pstats
    from contextlib import nullcontext

    from floors import floor_step, lora_transformer
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.models.compile import compile_blocks, compile_events
    from trainer.models.geometry import Geometry

    adapter, model = lora_transformer(args.model_dir, args.rank, compiled=False)
    compile_blocks(adapter.transformer_blocks(model), adapter.block_dynamic_dims)
    size = 64 if args.tiny else 384
    image_tokens = adapter.latent_shape(Geometry(size, size))[0]
    forced = BACKENDS[backend]
    lengths = []
    with nullcontext() if forced is None else sdpa_kernel([getattr(SDPBackend, forced)]):
        for tokens in args.lengths:
            step = floor_step(adapter, model, args.rows, tokens=tokens, height=size, width=size)
            files, compiles = _cache_files(), compile_events()
            profile = cProfile.Profile() if tokens == args.profile_length else None
            first = _timed(lambda: profile.runcall(step) if profile else step())
            if profile:
                print(f"--- cProfile, first call at {tokens} tokens ({backend})", file=sys.stderr)
                pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(30)
            lengths.append({"tokens": tokens,
                            "padded": adapter.padded_text_length(tokens, image_tokens),
                            "first_s": first,
                            "warm_s": statistics.median(_timed(step) for _ in range(3)),
                            "compiles": compile_events() - compiles,
                            "new_files": _cache_files() - files})
    return {"backend": backend, "lengths": lengths}


def summary(figures: dict) -> dict:
    """The first length compiles; the second may too (a dimension turning symbolic); from the
    third on, a first call's excess over the warm one is what each new length costs."""
    later = figures["lengths"][2:] or figures["lengths"][-1:]
    return {"new_length_first_s": statistics.median(x["first_s"] for x in later),
            "warm_fwd_bwd_ms": 1000 * statistics.median(x["warm_s"] for x in figures["lengths"]),
            "compiles_after_first": sum(x["compiles"] for x in figures["lengths"][1:])}


def record(all_figures: list[dict], args) -> None:
    from bench.results import Recorder, device_name

    rec = Recorder("bench_text_length", device=device_name("cuda"))
    setup = f"{'tiny-' if args.tiny else ''}qwen{args.layers}l-lora{args.rank}-b{args.rows}"
    for figures in all_figures:
        s = summary(figures)
        case = f"{setup}-sdpa-{figures['backend']}"
        rec.add(case, "new_length_first_call_s", s["new_length_first_s"], "s")
        rec.add(case, "warm_fwd_bwd_ms", s["warm_fwd_bwd_ms"], "ms")
        rec.add(case, "compiles_after_first_length", s["compiles_after_first"], "count")
    rec.write()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--rows", type=int, default=4, help="rows of the forward + backward")
    p.add_argument("--lengths", type=int, nargs="+", default=[40, 41, 56, 64, 77, 100],
                   help="text lengths, in the order they arrive (the defaults stay distinct "
                        "after the adapter's padding, and 40 then 41 cross the alignment of 8 "
                        "without it)")
    p.add_argument("--backends", nargs="+", choices=sorted(BACKENDS),
                   default=["default", "efficient"])
    p.add_argument("--profile-length", type=int, help="cProfile the first call at this length")
    p.add_argument("--one", choices=sorted(BACKENDS), help=argparse.SUPPRESS)  # the child's
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args)), flush=True)
        return 0
    all_figures = figures_per_variant(__file__, "bench_text_length_", args, argv, args.backends)
    print(f"compiled LoRA r{args.rank} blocks, forward + backward of {args.rows} rows")
    print("| backend | tokens | padded | first call s | warm s | compiles | new cache files |\n"
          "|---|---|---|---|---|---|---|")
    for figures in all_figures:
        for x in figures["lengths"]:
            print(f"| {figures['backend']} | {x['tokens']} | {x['padded']} | {x['first_s']:.3f} | "
                  f"{x['warm_s']:.4f} | {x['compiles']} | {x['new_files']} |")
    record(all_figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
