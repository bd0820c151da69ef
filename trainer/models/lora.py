"""The LoRA layers of a run, on the actor's and on the engine's transformer (one recipe, so
adapter-mode parameter names match on both sides)."""
from __future__ import annotations

from typing import Sequence

from torch import nn


def apply_lora(model: nn.Module, *, rank: int, alpha: float, target_modules: Sequence[str],
               dropout: float = 0.0) -> nn.Module:
    """peft LoRA on ``target_modules``: B initialised to 0 (the wrapped model starts equal to
    the base), base weights frozen by peft."""
    # peft (and the transformers it imports) loads only for LoRA runs.
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=int(rank), lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=list(target_modules), init_lora_weights=True)
    return get_peft_model(model, config)
