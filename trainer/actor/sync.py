"""Trainer side of the weight sync: the actor's tensors, named as the engine names them.

Payloads (derived from the LoRA flags; docs/design.md#weight-sync):
- full:    every trainable-model tensor (full training);
- adapter: LoRA tensors only; the base goes once, in the first (full) sync;
- merge:   LoRA folded into the base, sent under the plain model's names (the engine holds
           no LoRA layers).
Nothing is gathered here: sharded parameters and merged weights go out as lazy tensors, so
the transport gathers / produces one tensor at a time in bucket order and the full model never
exists twice on the trainer side. Every rank yields the same sequence, so the collectives
inside the gathers line up.

FSDP2 parameters bypass DTensor's dispatch, whose per-call cost (tens to hundreds of us per
DTensor op) dominated a full-model sync otherwise (bench/RESULTS.md, "Figures behind code
choices"):
- a mesh of one rank: the local tensor IS the whole tensor; it goes out as a plain tensor, the
  same object at the same address step after step, so the transport's scan is reused;
- a 1-D mesh sharded on dim 0 (FSDP2's layout): one ``all_gather_into_tensor`` of the local
  rows, padded to the even chunk ``torch.chunk`` gives every rank;
- anything else: ``DTensor.full_tensor()``.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from ipc import LazyTensor
from trainer.actor.model import strip_wrapper_names
from trainer.models.lora import merged_lora_weight

_PEFT_PREFIX = "base_model.model."


def _gather_rows(local: torch.Tensor, shape: tuple[int, ...], group, world: int
                 ) -> torch.Tensor:
    """The full tensor of dim-0 shards laid out as ``torch.chunk`` does (FSDP2, DTensor
    Shard(0)): every rank's rows padded to ceil(n / world), one all-gather, the padding cut."""
    chunk = -(-shape[0] // world)
    if local.shape[0] == chunk and local.is_contiguous():
        send = local
    else:
        send = local.new_zeros((chunk,) + tuple(shape[1:]))
        send[: local.shape[0]].copy_(local)
    out = local.new_empty((chunk * world,) + tuple(shape[1:]))
    dist.all_gather_into_tensor(out, send, group=group)
    return out[: shape[0]]


def _sync_view(p: Any) -> Any:
    """What the transport reads for parameter ``p``: a plain tensor, or a lazy one (see the
    module docstring for the three DTensor cases)."""
    local = getattr(p, "_local_tensor", None)  # DTensor's local shard, read without dispatch
    if local is None or not hasattr(p, "device_mesh"):
        return p.detach() if isinstance(p, torch.Tensor) else p
    mesh = p.device_mesh
    if mesh.size() == 1 and tuple(local.shape) == tuple(p.shape):
        # plain tensor; FSDP2's local shard needs no grad, and handing out the same object
        # every step lets the transport reuse its scan (a detach() would be a new object)
        return local if not local.requires_grad else local.detach()
    if mesh.ndim == 1 and len(p.placements) == 1 and type(p.placements[0]) is Shard \
            and p.placements[0].dim == 0 and p.dim() > 0:
        shape, group, world = tuple(p.shape), mesh.get_group(), mesh.size()
        return LazyTensor(shape, p.dtype, lambda: _gather_rows(local, shape, group, world))
    return p.detach()


def _full(t: Any) -> torch.Tensor:
    """A full (replicated) tensor of ``t``: gathered, produced, or ``t`` itself."""
    t = _sync_view(t)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def named_sync_tensors(model: nn.Module, *, only_lora: bool = False
                       ) -> Iterator[tuple[str, Any]]:
    """(name without wrapper segments, tensor or lazy tensor) for every parameter, not
    gathered.

    Buffers are not trained and the engine loads its own, so they are not synced.
    """
    for name, p in model.named_parameters():
        name = strip_wrapper_names(name)
        if only_lora and "lora_" not in name:
            continue
        yield name, _sync_view(p)


def named_full_tensors(model: nn.Module, *, only_lora: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Like ``named_sync_tensors`` but gathered (a collective per tensor, on every rank)."""
    for name, t in named_sync_tensors(model, only_lora=only_lora):
        yield name, _full(t)


def _merged(weight: Any, lora_a: Any, lora_b: Any, scaling: float):
    """W + scaling * B @ A, computed in fp32 when the transport asks for it."""
    def produce() -> torch.Tensor:
        w, b, a = _full(weight), _full(lora_b), _full(lora_a)
        return merged_lora_weight(w, a, b, scaling)

    return LazyTensor(tuple(weight.shape), weight.dtype, produce)


def merged_sync_tensors(model: nn.Module, scaling: float) -> Iterator[tuple[str, Any]]:
    """LoRA folded into the base, plain-model names, lazily.

    peft names: ``base_model.model.<m>.base_layer.weight`` with ``<m>.lora_A.default.weight``
    and ``<m>.lora_B.default.weight``; the merged tensor goes out as ``<m>.weight``.
    """
    pending: dict[str, dict[str, Any]] = {}
    for name, t in named_sync_tensors(model):
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
            yield f"{mod}.weight", _merged(entry.pop("base:weight"), entry.pop("A"),
                                           entry.pop("B"), scaling)
            for key in [k for k in entry if k.startswith("base:")]:
                yield f"{mod}.{key[5:]}", entry.pop(key)
            pending.pop(mod)
    for mod, entry in pending.items():
        for key, t in entry.items():
            if key.startswith("base:"):
                yield f"{mod}.{key[5:]}", t
            else:
                raise RuntimeError(f"LoRA module {mod} has lora_{key} without its base weight")


def merged_full_tensors(model: nn.Module, scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """``merged_sync_tensors`` gathered (for checks and exports)."""
    for name, t in merged_sync_tensors(model, scaling):
        yield name, _full(t)


def sync_payload(model: nn.Module, mode: str, *, scaling: float = 1.0, first: bool = False,
                 name_map: dict[str, str] | None = None) -> Iterator[tuple[str, Any]]:
    """The tensors of one sync of ``mode`` (the first adapter-mode sync sends everything)."""
    if mode == "merge":
        it = merged_sync_tensors(model, scaling)
    else:
        it = named_sync_tensors(model, only_lora=(mode == "adapter" and not first))
    for name, t in it:
        yield (name_map.get(name, name) if name_map else name), t
