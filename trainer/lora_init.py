"""``--lora-init-path``: start the LoRA from existing adapter weights instead of zeros.

Two layouts are read (the Flow-GRPO reference resumes from a PEFT directory):

- PEFT: a directory with ``adapter_config.json`` and ``adapter_model.safetensors`` (what
  ``PeftModel.save_pretrained`` and ``python -m trainer export --form adapter`` write); its
  rank and alpha must equal the run's ``lora.rank`` / ``lora.alpha``.
- diffusers: a ``*.safetensors`` file, or a directory holding ``pytorch_lora_weights.safetensors``
  (what ``save_lora_weights`` writes), keys ``transformer.<module>.lora_A.weight`` /
  ``lora_B.weight``. Alpha is not stored there: the run's ``lora.alpha`` is used.

Every LoRA tensor of the model must be present with its shape, and nothing else may be in the
file: a partial or foreign adapter is an error listing every mismatch, not a silent
half-initialisation.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

_PREFIXES = ("base_model.model.", "transformer.")
_ADAPTER_NAME = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")  # peft's ".lora_A.default.weight"


def _canonical(name: str) -> str:
    """``<module>.lora_A.weight`` from a model parameter name or a file key."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return _ADAPTER_NAME.sub(r".\1.weight", name)


def read_lora_file(path: str | Path, *, rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """The adapter tensors under canonical names; raises ValueError listing every problem."""
    from safetensors.torch import load_file

    path = Path(path)
    problems = []
    if path.is_dir() and (path / "adapter_config.json").is_file():
        config = json.loads((path / "adapter_config.json").read_text())
        if int(config.get("r", -1)) != rank:
            problems.append(f"adapter rank r={config.get('r')} != lora.rank={rank}")
        if float(config.get("lora_alpha", -1)) != float(alpha):
            problems.append(f"adapter lora_alpha={config.get('lora_alpha')} != lora.alpha={alpha} "
                            "(the scale alpha / r would differ)")
        weights = path / "adapter_model.safetensors"
    elif path.is_dir():
        weights = path / "pytorch_lora_weights.safetensors"
    else:
        weights = path
    if not weights.is_file():
        problems.append(f"{weights} does not exist (expected a PEFT directory, a diffusers "
                        "LoRA directory or a .safetensors file)")
    if problems:
        raise ValueError(f"--lora-init-path {path}:\n  - " + "\n  - ".join(problems))
    return {_canonical(k): v for k, v in load_file(str(weights)).items()}


@torch.no_grad()
def load_lora_init(model: nn.Module, path: str | Path, *, rank: int, alpha: float) -> int:
    """Copy the adapter at ``path`` into ``model``'s LoRA parameters; returns how many."""
    tensors = read_lora_file(path, rank=rank, alpha=alpha)
    params = {_canonical(n): p for n, p in model.named_parameters() if "lora_" in n}
    problems = []
    missing = sorted(set(params) - set(tensors))
    unknown = sorted(set(tensors) - set(params))
    if missing:
        problems.append(f"{len(missing)} LoRA tensors of the model are not in the file, e.g. {missing[:3]}")
    if unknown:
        problems.append(f"{len(unknown)} tensors of the file match no LoRA parameter of the model "
                        f"(other targets or another model?), e.g. {unknown[:3]}")
    bad_shape = [f"{k}: file {tuple(tensors[k].shape)}, model {tuple(p.shape)}"
                 for k, p in params.items() if k in tensors and tensors[k].shape != p.shape]
    problems += bad_shape[:5]
    if problems:
        raise ValueError(f"--lora-init-path {path} does not fit this model's LoRA:\n  - "
                         + "\n  - ".join(problems))
    for name, param in params.items():
        param.copy_(tensors[name].to(param.dtype))
    return len(params)
