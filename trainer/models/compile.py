"""Regional compilation: each repeated transformer block under ``torch.compile``.

The blocks are most of the model's compute and all share one code object, so compiling the
block (not the whole model) costs one compile for the whole depth and leaves the model's
Python around them (embeddings, RoPE tables, the output head) eager. The block's ``forward``
is replaced by its compiled version in place:
- parameter names do not change (no ``_orig_mod.`` segment), so weight-sync names, checkpoints
  and peft see the same model;
- module hooks stay outside the compiled code, so FSDP2's all-gather / reshard hooks (installed
  after compiling, as torchtitan orders it) and activation checkpointing's wrapper (compiled
  with the block when present) work unchanged.

Shapes: batch and text length vary between requests and micro-batches; torch's automatic
dynamic shapes turn a dimension symbolic the second time it changes, so after a short warm-up
nothing recompiles. ``compile_events()`` counts compilations (first compiles and recompiles);
the trainer logs its per-step growth as ``perf/recompiles``.
"""
from __future__ import annotations

import logging

import torch
import torch._dynamo.config as dynamo_config
from torch import nn
from torch._dynamo.utils import counters

log = logging.getLogger("trainer")

COMPILE_MODES = ("auto", "blocks", "none")
# Frames compiled per code object before torch gives up and runs it eager: a few batch sizes,
# grad / no-grad and the LoRA-disabled reference each compile once; leave room for them.
_RECOMPILE_LIMIT = 32


def compile_wanted(setting: str, device: torch.device | str) -> bool:
    """'blocks' -> True, 'none' -> False, 'auto' -> True on CUDA only."""
    if setting not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {setting!r}")
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "blocks"


def compile_blocks(blocks: list[nn.Module]) -> int:
    """Compile each block's forward in place; returns how many were compiled."""
    _raise_recompile_limit()
    for block in blocks:
        block.forward = torch.compile(block.forward)
    return len(blocks)


def compile_events() -> int:
    """Frames compiled so far in this process (each compile or recompile counts once)."""
    return int(counters["frames"]["ok"])


def _raise_recompile_limit() -> None:
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
            return
