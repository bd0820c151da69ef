"""The rollout wire's JSON codec: a tensor as a tagged, base64-encoded one-tensor safetensors
file, so bf16 and integer dtypes survive bit-exactly. The embedded engine's HTTP mode, the
SGLang client and the response checks all use it.

``to_wire`` / ``to_jsonable`` encode every tensor at any depth; ``from_jsonable`` decodes ours;
``from_wire`` also accepts SGLang's own tag (``{"__tensor__": true, "data": <base64
safetensors>, ...}``, what its diffusion rollout endpoint emits): the payload format is the
same, only the tag's value differs.
"""
from __future__ import annotations

import base64
from typing import Any, Mapping

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

TENSOR_TAG = "__tensor__"
_TENSOR_FORMAT = "safetensors+base64"


def encode_tensor(t: torch.Tensor) -> dict[str, str]:
    """A tensor as a JSON object: its one-entry safetensors file, base64-encoded (any dtype)."""
    blob = save_safetensors({"t": t.detach().to("cpu").contiguous()})
    return {TENSOR_TAG: _TENSOR_FORMAT, "data": base64.b64encode(blob).decode("ascii")}


def decode_tensor(obj: Mapping[str, Any]) -> torch.Tensor:
    if obj.get(TENSOR_TAG) != _TENSOR_FORMAT:
        raise ValueError(f"unknown tensor encoding {obj.get(TENSOR_TAG)!r} (expected {_TENSOR_FORMAT!r})")
    return load_safetensors(base64.b64decode(obj["data"]))["t"]


def to_jsonable(obj: Any) -> Any:
    """Replace every tensor (at any depth) with ``encode_tensor``; the rest is left as is."""
    if isinstance(obj, torch.Tensor):
        return encode_tensor(obj)
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def from_jsonable(obj: Any) -> Any:
    """Inverse of ``to_jsonable``: decode every tagged tensor (nested lists stay lists)."""
    if isinstance(obj, Mapping):
        if TENSOR_TAG in obj:
            return decode_tensor(obj)
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    return obj


def to_wire(obj: Any) -> Any:
    return to_jsonable(obj)


def from_wire(obj: Any) -> Any:
    """Decode every tagged tensor at any depth (both tag flavours); lists stay lists."""
    if isinstance(obj, dict):
        tag = obj.get(TENSOR_TAG)
        if tag is True:  # SGLang's flavour
            data = obj["data"]
            raw = base64.b64decode(data) if isinstance(data, str) else bytes(data)
            tensors = load_safetensors(raw)
            if len(tensors) != 1:
                raise ValueError(f"a wire tensor must hold one tensor, got {sorted(tensors)}")
            return next(iter(tensors.values()))
        if tag is not None:
            return decode_tensor(obj)
        return {k: from_wire(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_wire(v) for v in obj]
    return obj
