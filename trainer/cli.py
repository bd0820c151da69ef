"""`python -m trainer <command>`: a thin dispatcher; each command lives in its own module.

Commands import lazily so that `--help`, `data` and preflight errors never pay for torch
or model imports.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "launch": ("trainer.launch", "main", "start a training run (one rank per local GPU)"),
    "train": ("trainer.launch", "rank_main", "one rank's entry point (used by launch)"),
    "data": ("trainer.data.cli", "main", "prepare | curate | inspect prompt data"),
    "export": ("trainer.checkpoint.export", "main", "export a checkpoint (merged / adapter / full)"),
}


def _usage() -> str:
    lines = ["usage: python -m trainer <command> [args]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)
