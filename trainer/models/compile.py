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

Shapes: batch and text length vary between requests and micro-batches. The adapter names the
block inputs whose size changes at one geometry (``block_dynamic_dims``: Qwen-Image's text
length); they are marked dynamic before every call, so the first compile already treats that
dimension as symbolic and a second prompt length compiles nothing. Any other dimension that
changes turns symbolic through torch's automatic dynamic shapes the second time it changes
(one recompile). ``compile_events()`` counts compilations (first compiles and recompiles);
the trainer logs its per-step growth as ``perf/recompiles``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

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


DynamicDims = Callable[[dict[str, Any]], list[tuple[torch.Tensor, int]]]


def compile_blocks(blocks: list[nn.Module], dynamic_dims: DynamicDims | None = None) -> int:
    """Compile each block's forward in place; returns how many were compiled.

    ``dynamic_dims(kwargs)`` gives the (tensor, dim) pairs of a call's keyword inputs to mark
    dynamic before the compiled code sees them."""
    _raise_recompile_limit()
    for block in blocks:
        compiled = torch.compile(block.forward)
        block.forward = compiled if dynamic_dims is None else _marking(compiled, dynamic_dims)
    return len(blocks)


def _marking(compiled: Callable, dynamic_dims: DynamicDims) -> Callable:
    # maybe_mark_dynamic, not mark_dynamic: where a block's code specializes a marked size
    # (a branch on it, in some diffusers release), torch compiles for that size instead of
    # raising a constraint violation.
    def forward(*args, **kwargs):
        for tensor, dim in dynamic_dims(kwargs):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return compiled(*args, **kwargs)

    return forward


def compile_events() -> int:
    """Frames compiled so far in this process (each compile or recompile counts once)."""
    return int(counters["frames"]["ok"])


def _raise_recompile_limit() -> None:
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
            return
