"""The LoRA layers of a run, on the actor's and on the engine's transformer (one recipe, so
adapter-mode parameter names match on both sides), and the merge of an adapter into its base
weight (one function, so a weight merged where it is served equals the actor's)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def apply_lora(model: nn.Module, *, rank: int, alpha: float, target_modules: Sequence[str],
               dropout: float = 0.0, init_a: str = "kaiming") -> nn.Module:
    """peft LoRA on ``target_modules``: B initialised to 0 (the wrapped model starts equal to
    the base), base weights frozen by peft. ``init_a``: A as peft's default Kaiming-uniform, or
    ``"gaussian"`` (peft's ``init_lora_weights="gaussian"``: normal with std 1 / rank), the
    Flow-GRPO reference's choice (``lora.init_a``)."""
    # peft (and the transformers it imports) loads only for LoRA runs.
    from peft import LoraConfig, get_peft_model

    if init_a not in ("kaiming", "gaussian"):
        raise ValueError(f"init_a must be 'kaiming' or 'gaussian', got {init_a!r}")
    config = LoraConfig(r=int(rank), lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules),
                        init_lora_weights=True if init_a == "kaiming" else "gaussian")
    return get_peft_model(model, config)


def lora_scaling(rank: int, alpha: float | None) -> float:
    """The factor a LoRA pair's product is added with: alpha / rank (alpha unset: 1), as
    peft's layers scale it and as every merge of the trainer's adapters must."""
    return (alpha or rank) / max(1, rank)


def merged_lora_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """``W + scaling * B @ A``: the delta in fp32, added to W in fp32, rounded once into W's
    dtype, on the tensors' device. The actor's merged payloads (merge sync mode, exports) and
    the SGLang extension's adapter receiver both call this, so the receiver's merged weight is
    the actor's bit for bit where both run the same fp32 GEMM (the same device kind)."""
    delta = lora_b.float() @ lora_a.float()
    return (weight.float() + scaling * delta).to(weight.dtype)
