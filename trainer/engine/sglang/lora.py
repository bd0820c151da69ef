"""The adapter sync mode into SGLang: LoRA pairs as ``weight_update_mode="lora_merge"`` and the
SHA-256 manifest the server must then hold.

What SGLang 0.5.23 does with a ``lora_merge`` update (``WeightsUpdater._update_lora_from_tensor``,
``LoRAPipeline.convert_to_lora_layers``, ``BaseLayerWithLoRA.set_lora_weights``):

- tensors are grouped per layer by splitting their names at ``.lora_A`` / ``.lora_B``; a layer
  with only one of the two is skipped with a log line, and the request still succeeds, so a
  pair must never be split across two requests;
- the first such update wraps every ``nn.Linear`` of the transformer in a LoRA layer (the base
  weight then lives at ``<layer>.base_layer.weight``, the adapter at ``<layer>.lora_A`` and
  ``<layer>.lora_B``) and snapshots the base;
- each update restores the snapshot and merges ``W = W_base + (alpha / rank) * B @ A``: in fp32
  (``addmm_`` over row chunks of 32 MiB, rank from A's shape, alpha as sent, no scaling when
  they are equal), rounded once into the weight's dtype, on the server's device.

``merged_weight`` repeats that arithmetic so the trainer can name the SHA-256 of every merged
weight and ask SGLang's checker for them. The bytes agree when both sides run the same fp32
GEMM: same device kind (the payload's device: the colocated GPU), TF32 matmuls off (SGLang's
default and torch's). Where they cannot agree the checker reports a mismatch and the sync
fails with SGLang's message, never silently.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

#: Row chunk of SGLang's in-place merge (``LORA_MERGE_CHUNK_BYTES`` in its LoRA layer module):
#: the GEMM is split the same way so each chunk runs the same kernel.
MERGE_CHUNK_BYTES = 32 * 1024 * 1024


def lora_layer(name: str) -> tuple[str, str] | None:
    """(layer name, "A" or "B") of a LoRA tensor, split as SGLang splits it; None otherwise."""
    for kind in ("A", "B"):
        marker = f".lora_{kind}"
        if marker in name:
            return name.split(marker, 1)[0], kind
    return None


def lora_pairs(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (A, B); raises ValueError naming every layer that lacks one of the two."""
    partial: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        found = lora_layer(name)
        if found is None:
            raise ValueError(f"{name!r} is not a LoRA tensor (no .lora_A / .lora_B)")
        partial.setdefault(found[0], {})[found[1]] = t
    broken = sorted(layer for layer, ab in partial.items() if len(ab) != 2)
    if broken:
        raise ValueError(f"LoRA layers without both lora_A and lora_B: {broken[:5]}"
                         + (f" (+{len(broken) - 5} more)" if len(broken) > 5 else ""))
    return {layer: (ab["A"], ab["B"]) for layer, ab in partial.items()}


def merge_scale(alpha: float | None, rank: int) -> float:
    """The factor SGLang applies to B @ A: alpha / rank, exactly 1.0 when they are equal."""
    scale = 1.0
    if alpha is not None and alpha != rank:
        scale *= alpha / rank
    return scale


@torch.no_grad()
def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  alpha: float | None) -> torch.Tensor:
    """``base + (alpha / rank) * B @ A`` as SGLang computes it (see the module docstring), on
    the device of ``lora_a``; returned in ``base``'s dtype on that device."""
    device = lora_a.device
    target = base.dtype
    data = base.to(device=device, dtype=torch.float32 if base.is_floating_point() else None,
                   copy=True)
    a, b = lora_a.to(data), lora_b.to(data)
    scale = merge_scale(alpha, int(lora_a.shape[-2]))
    rows = max(1, MERGE_CHUNK_BYTES // (data.shape[-1] * max(1, data.element_size())))
    for start in range(0, b.shape[0], rows):
        data[start:start + rows].addmm_(b[start:start + rows], a, alpha=scale)
    return data.to(target)


@torch.no_grad()
def merged_packed_weight(base: torch.Tensor, lora_a: list[torch.Tensor],
                         lora_b: list[torch.Tensor], alpha: float | None) -> torch.Tensor:
    """A packed layer's merge as SGLang computes it: the sections' pairs stacked
    (``stack_or_compose_fused_lora`` with equal sections), one batched ``B @ A`` in fp32
    flattened to the packed rows, added with ``alpha / rank``; in ``base``'s dtype."""
    device = lora_a[0].device
    data = base.to(device=device, dtype=torch.float32, copy=True)
    a, b = torch.stack(lora_a).to(data), torch.stack(lora_b).to(data)
    delta = (b @ a).reshape(-1, a.shape[-1])
    data.reshape(-1, data.shape[-1]).add_(delta, alpha=merge_scale(alpha, int(a.shape[-2])))
    return data.to(base.dtype)


def served_names(layer: str) -> dict[str, str]:
    """Where SGLang's LoRA layer keeps the merged weight and the adapter tensors."""
    return {"weight": f"{layer}.base_layer.weight", "A": f"{layer}.lora_A",
            "B": f"{layer}.lora_B"}


#: One served LoRA layer of a sync: (served layer, [(section index or None, sent layer, (A, B))]).
LoraGroup = tuple[str, list[tuple[int | None, str, tuple[torch.Tensor, torch.Tensor]]]]


def pair_buckets(groups: list[LoraGroup], bucket_bytes: int) -> Iterable[list[LoraGroup]]:
    """Served layers in buckets of at most ``bucket_bytes`` (one layer may exceed it alone): a
    pair, and the sections of a packed layer, are never split, since SGLang skips a layer
    whose A and B arrive apart and composes a packed layer from the sections of one request."""
    bucket: list[LoraGroup] = []
    size = 0
    for group in groups:
        nbytes = sum(t.numel() * t.element_size() for _, _, ab in group[1] for t in ab)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(group)
        size += nbytes
    if bucket:
        yield bucket


class LoraBases:
    """The base weights of LoRA layers as the server holds them (the sent bytes, packed as
    the server packs them), kept on the host by served layer name: the snapshot SGLang
    merges every adapter update into."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def keep(self, layer: str, weight: torch.Tensor) -> None:
        self.weights[layer] = weight.detach().to("cpu", copy=True)

    def manifest(self, bucket: list[LoraGroup], alpha: float | None, digest: Any
                 ) -> dict[str, str]:
        """Served name -> SHA-256 after SGLang merged ``bucket``; raises KeyError naming the
        layers whose base was never sent."""
        unknown = [layer for layer, _ in bucket if layer not in self.weights]
        if unknown:
            raise KeyError(f"no base weight was synced for LoRA layers {unknown[:5]}")
        out = {}
        for layer, sections in bucket:
            names = served_names(layer)
            a_list = [ab[0] for _, _, ab in sections]
            b_list = [ab[1] for _, _, ab in sections]
            if sections[0][0] is None:
                a, b = a_list[0], b_list[0]
                out[names["weight"]] = digest(merged_weight(self.weights[layer], a, b, alpha))
            else:
                a, b = torch.stack(a_list), torch.stack(b_list)
                out[names["weight"]] = digest(merged_packed_weight(self.weights[layer], a_list,
                                                                   b_list, alpha))
            out[names["A"]], out[names["B"]] = digest(a), digest(b)
        return out
