"""Serving a LoRA adapter merged into the engine's base weights.

In adapter mode the trainer syncs only the LoRA tensors; served unmerged, every targeted
projection then runs the base matmul plus the two thin LoRA matmuls (and their casts). Folding
``W = W_base + scaling * B @ A`` into the weights once per sync makes a LoRA rollout cost what a
full-model rollout costs.

``LoraMerger`` keeps an exact copy of each targeted base weight, so re-merging after the next
adapter sync starts from the base and an unmerge restores it bit for bit (peft's own
merge/unmerge adds and subtracts the delta in the weight dtype, which drifts). The delta is
computed in fp32 and rounded once into the weight dtype. While merged, peft's layers are marked
merged, so their forward is the base layer's alone.
"""
from __future__ import annotations

import torch
from torch import nn


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """peft LoRA layers (those with a base layer and lora_A/lora_B) of ``model``."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, LoraLayer) and hasattr(m, "base_layer")
            and isinstance(getattr(m.base_layer, "weight", None), torch.Tensor)]


class LoraMerger:
    """Merge / unmerge the active adapter of every LoRA layer of one model, in place."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = lora_layers(model)
        if not self.layers:
            raise ValueError("LoRA merge requested but the model has no peft LoRA layers")
        transposed = [n for n, m in self.layers if getattr(m, "fan_in_fan_out", False)]
        if transposed:  # Conv1D-style weights: B @ A would need a transpose; none in diffusers
            raise ValueError(f"LoRA merge does not handle fan_in_fan_out layers: {transposed[:3]}")
        self.base: dict[str, torch.Tensor] = {}
        self.merged = False

    def capture_base(self) -> None:
        """Copy the current (unmerged) base weights: call while they hold the base."""
        with torch.no_grad():
            for name, layer in self.layers:
                weight = layer.base_layer.weight
                kept = self.base.get(name)
                if kept is None or kept.shape != weight.shape or kept.device != weight.device:
                    self.base[name] = weight.detach().clone()
                else:
                    kept.copy_(weight.detach())
        self._set_flags(False)

    def merge(self) -> None:
        """W = W_base + scaling * B @ A for the active adapter (fp32 maths, one rounding)."""
        if not self.base:
            self.capture_base()
        with torch.no_grad():
            for name, layer in self.layers:
                weight = layer.base_layer.weight
                for adapter in layer.active_adapters:
                    if adapter not in layer.lora_A:
                        continue
                    a = layer.lora_A[adapter].weight.float()
                    b = layer.lora_B[adapter].weight.float()
                    # base (weight dtype) + fp32 delta computes in fp32 and rounds once into
                    # the weight: no fp32 copy of the base is materialised
                    torch.add(self.base[name], b @ a, alpha=float(layer.scaling[adapter]),
                              out=weight.data)
        self._set_flags(True)

    def unmerge(self) -> None:
        """Restore the captured base weights exactly."""
        with torch.no_grad():
            for name, layer in self.layers:
                layer.base_layer.weight.data.copy_(self.base[name])
        self._set_flags(False)

    def _set_flags(self, merged: bool) -> None:
        for _, layer in self.layers:
            layer.merged_adapters = list(layer.active_adapters) if merged else []
        self.merged = merged

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())
