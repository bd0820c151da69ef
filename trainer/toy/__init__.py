"""The embedded default task: a procedural prompt->image world (``world``), a rule-based
reward (``reward``), and a tiny pretrained pixel-space flow model (``adapter``, ``pretrain``)
whose weights ship in ``weights/``.

Submodules import lazily: ``world`` and ``reward`` need only numpy, PIL and torch, while the
model modules need diffusers and transformers.
"""
from __future__ import annotations

from pathlib import Path


def weights_dir() -> Path:
    """The shipped pretrained toy model (a diffusers-style directory, see ``modeling``)."""
    return Path(__file__).resolve().parent / "weights"
