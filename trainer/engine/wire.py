"""JSON wire format of the HTTP mode and of the SGLang client.

Encoding is the project's one codec, ``trainer.models.schema.to_jsonable`` (a tensor becomes
``{"__tensor__": "safetensors+base64", "data": ...}``: a one-tensor safetensors file, so bf16
and integer dtypes survive bit-exactly). Decoding also accepts SGLang's own tag
(``{"__tensor__": true, "data": <base64 safetensors>, ...}``, what its diffusion rollout
endpoint emits): the payload format is the same, only the tag's value differs.
"""
from __future__ import annotations

import base64
from typing import Any

from trainer.models.schema import TENSOR_TAG, decode_tensor, to_jsonable

__all__ = ["to_wire", "from_wire"]


def to_wire(obj: Any) -> Any:
    return to_jsonable(obj)


def from_wire(obj: Any) -> Any:
    """Decode every tagged tensor at any depth (both tag flavours); lists stay lists."""
    if isinstance(obj, dict):
        tag = obj.get(TENSOR_TAG)
        if tag is True:  # SGLang's flavour
            from safetensors.torch import load

            data = obj["data"]
            raw = base64.b64decode(data) if isinstance(data, str) else bytes(data)
            tensors = load(raw)
            if len(tensors) != 1:
                raise ValueError(f"a wire tensor must hold one tensor, got {sorted(tensors)}")
            return next(iter(tensors.values()))
        if tag is not None:
            return decode_tensor(obj)
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_wire(v) for v in obj]
    return obj
