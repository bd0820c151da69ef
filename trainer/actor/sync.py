"""Trainer side of the weight sync: full tensors out of FSDP2, named as the engine names them.

Payloads (derived from the LoRA flags, spec "权重同步" / lora-rl):
- full:    every trainable-model tensor (full training);
- adapter: LoRA tensors only; the base goes once, in the first (full) sync;
- merge:   LoRA folded into the base, sent under the plain model's names (the engine holds
           no LoRA layers).
Tensors are produced lazily, one at a time (``DTensor.full_tensor()`` per parameter), so the
transport can stream them into its buckets without a whole-model copy on the trainer side.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from trainer.actor.model import strip_wrapper_names

_PEFT_PREFIX = "base_model.model."


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def named_full_tensors(model: nn.Module, *, only_lora: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(engine-facing name, full tensor) for every parameter (buffers are not trained and
    the engine loads its own).

    Every rank must iterate the same sequence: full_tensor() is a collective.
    """
    for name, p in model.named_parameters():
        name = strip_wrapper_names(name)
        if only_lora and "lora_" not in name:
            continue
        yield name, _full(p)


def merged_full_tensors(model: nn.Module, scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """LoRA folded into the base: W + scaling * B @ A (fp32 math), plain-model names.

    peft names: ``base_model.model.<m>.base_layer.weight`` with ``<m>.lora_A.default.weight``
    and ``<m>.lora_B.default.weight``; the merged tensor goes out as ``<m>.weight``.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named_full_tensors(model):
        plain = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        if ".lora_" in plain:
            mod, rest = plain.split(".lora_", 1)
            kind = "A" if rest.startswith("A.") else "B" if rest.startswith("B.") else None
            if kind is None:
                continue  # lora_embedding / magnitude vectors are not produced by our config
            pending.setdefault(mod, {})[kind] = t
        elif ".base_layer." in plain:
            mod, leaf = plain.split(".base_layer.", 1)
            pending.setdefault(mod, {})["base:" + leaf] = t
        else:
            yield plain, t
            continue
        entry = pending.get(mod, {})
        if "A" in entry and "B" in entry and "base:weight" in entry:
            w = entry.pop("base:weight")
            delta = entry.pop("B").float() @ entry.pop("A").float()
            yield f"{mod}.weight", (w.float() + scaling * delta).to(w.dtype)
            for key in [k for k in entry if k.startswith("base:")]:
                yield f"{mod}.{key[5:]}", entry.pop(key)
            pending.pop(mod)
    for mod, entry in pending.items():
        for key, t in entry.items():
            if key.startswith("base:"):
                yield f"{mod}.{key[5:]}", t
            else:
                raise RuntimeError(f"LoRA module {mod} has lora_{key} without its base weight")


def sync_payload(model: nn.Module, mode: str, *, scaling: float = 1.0, first: bool = False,
                 name_map: dict[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one sync of ``mode`` (the first adapter-mode sync sends everything)."""
    if mode == "merge":
        it = merged_full_tensors(model, scaling)
    else:
        it = named_full_tensors(model, only_lora=(mode == "adapter" and not first))
    for name, t in it:
        yield (name_map.get(name, name) if name_map else name), t
