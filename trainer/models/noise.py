"""The driver's x_T recipe: every random draw of a candidate is a pure function of its sample id.

A candidate's initial latent x_T and the noise injected at each SDE step depend only on
``(seed, sample_id, stream)``, where stream is ``"x_T"`` or ``"step:<index>"``. Nothing depends
on the batch a candidate lands in, its position in that batch, the engine that serves it or the
number of candidates generated before it, so a regenerated candidate is bit-identical and the
candidates of one group differ (their sample ids differ).

Recipe ``RECIPE`` (the name travels in the rollout request so that both ends agree):

1. key = UTF-8 of ``f"{seed}\\x1f{sample_id}\\x1f{stream}"`` (0x1f, the ASCII unit separator,
   cannot appear by accident in the decimal seed, and a sample id containing it still gives a
   distinct key because the seed prefix and the stream suffix are fixed-format);
2. generator seed = first 8 bytes of BLAKE2b(key, digest_size=8), little-endian, masked to 63
   bits (torch seeds must fit a signed 64-bit integer);
3. draw ``torch.randn(shape, dtype=float32)`` from a fresh CPU ``torch.Generator`` seeded with it;
4. cast to the requested dtype and move to the requested device.

Why a CPU generator: torch's CUDA generator (Philox) and CPU generator (MT19937) give different
numbers for one seed, so drawing on the device would make the latents depend on where a
candidate was generated. NOTE: the host draws of a group cost a small fraction of its
transformer forwards (figures: bench/reports/2026-12-04_cpu-h200_comment-figures.md); engines
should draw a step's noise for the whole batch at once and copy it with one transfer.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch

RECIPE = "blake2b64-cpu-mt19937-randn-v1"
_SEP = "\x1f"
_MASK63 = (1 << 63) - 1


def stream_seed(seed: int, sample_id: str, stream: str) -> int:
    """The 63-bit generator seed of one candidate's random stream (step 1-2 of the recipe)."""
    key = f"{int(seed)}{_SEP}{sample_id}{_SEP}{stream}".encode("utf-8")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _MASK63


def gaussian(sample_ids: Sequence[str], stream: str, shape: Sequence[int], *, seed: int,
             dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> torch.Tensor:
    """Standard normal draws [B, *shape], row b a pure function of (seed, sample_ids[b], stream)."""
    shape = tuple(int(s) for s in shape)
    out = torch.empty((len(sample_ids), *shape), dtype=torch.float32)
    gen = torch.Generator(device="cpu")
    for row, sample_id in enumerate(sample_ids):
        gen.manual_seed(stream_seed(seed, sample_id, stream))
        torch.randn(shape, generator=gen, dtype=torch.float32, out=out[row])
    return out.to(device=device, dtype=dtype)


def initial_stream() -> str:
    return "x_T"


def step_stream(step_index: int) -> str:
    return f"step:{int(step_index)}"
