"""Per-rank RNG state: torch CPU, CUDA (the rank's device), numpy's global generator and
Python's ``random``.

Stored as tensors, ints and floats only, so that loading uses ``torch.load(weights_only=True)``
(no pickle of arbitrary objects from a checkpoint directory).
"""
from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import torch

from trainer.checkpoint.layout import atomic_write_bytes


def capture_rng(device: torch.device | None = None) -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch_cpu"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss_next"]))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def write_rng(path: Path, state: dict) -> None:
    """Write ``capture_rng``'s state atomically."""
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())


def read_rng(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
