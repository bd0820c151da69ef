"""What the toy diagnostic scripts (toy_count_errors.py, toy_group_spread.py,
toy_grad_agreement.py) share: sampling a toy model on the CPU as the recipe does, and their
JSON output."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: trainer

from trainer.toy.adapter import ToyAdapter  # noqa: E402
from trainer.toy.evaluate import sample_images  # noqa: E402


def sample_on_cpu(model_dir: str | None, prompts: Sequence[str], ids: Sequence[str],
                  **options: Any) -> torch.Tensor:
    """uint8 [B, H, W, 3]: the toy model at ``model_dir`` (None: the shipped one), 10 steps,
    seed 0, ODE unless ``options`` (``trainer.toy.evaluate.sample_images``'s) say otherwise."""
    adapter = ToyAdapter(model_dir)
    return sample_images(adapter, adapter.load_train_model(device="cpu").eval(),
                         adapter.load_frozen(device="cpu", dtype=torch.float32), prompts, ids,
                         num_steps=10, seed=0, batch_size=128, **options)


def print_and_save(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text)
