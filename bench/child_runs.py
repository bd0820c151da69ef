"""What the benches that measure each variant in a fresh process share (bench_forward.py,
bench_text_length.py): the model arguments, and the same script run once per variant, so
that no variant compiles against another's code or inherits its caches."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """bench_step.py's model: where it lives, its depth, tiny widths, the LoRA rank."""
    parser.add_argument("--model-dir", help="bench_step.py's model directory, built there "
                        "when absent (default: a temporary one)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="tiny widths (a smoke run)")
    parser.add_argument("--rank", type=int, default=64)


def figures_per_variant(script: str, prefix: str, args: argparse.Namespace,
                        argv: list[str] | None, variants: list[str]) -> list[dict]:
    """Build (or reuse) the model, then run ``script`` with its own arguments plus ``--one
    VARIANT`` once per variant; each child prints its figures as JSON on its last stdout
    line (its stderr passes through). A child that fails ends this process with its status."""
    from bench_step import prepare_work

    _, model_dir = prepare_work(prefix, args.layers, args.tiny,
                                Path(args.model_dir) if args.model_dir else None)
    given = list(sys.argv[1:] if argv is None else argv)
    figures = []
    for variant in variants:
        child = subprocess.run([sys.executable, script, *given, "--model-dir", str(model_dir),
                                "--one", variant], stdout=subprocess.PIPE, text=True)
        if child.returncode != 0:
            print(child.stdout[-3000:], file=sys.stderr)
            raise SystemExit(child.returncode)
        figures.append(json.loads(child.stdout.strip().splitlines()[-1]))
    return figures
