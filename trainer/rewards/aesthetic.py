"""Aesthetic predictor: a linear-stack head on normalised CLIP image embeddings.

The head follows the layout of the LAION "improved aesthetic predictor" checkpoints
(``sac+logos+ava1-l14-linearMSE.pth``): Linear layers stored as ``layers.<i>.weight/bias``
with dropout between them and no activation, so at eval time the head is the composition of
its Linear layers. Input width is read from the file, so any CLIP width works.
"""
from __future__ import annotations

import os
import re
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file
from torch import nn

from trainer.rewards.base import RewardScorer
from trainer.rewards.hf_clip import HFClip

# Looked for inside model_path when head_path is not given, in this order.
HEAD_FILENAMES = ("aesthetic_head.safetensors", "aesthetic_head.pth",
                  "sac+logos+ava1-l14-linearMSE.pth")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(weight|bias)$")


def load_linear_stack(path: str) -> nn.Sequential:
    """Build the head from a ``layers.<i>.{weight,bias}`` state dict (.safetensors or .pth)."""
    if path.endswith(".safetensors"):
        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
    layers: dict[int, dict[str, torch.Tensor]] = {}
    problems = []
    for key, value in state.items():
        match = _LAYER_KEY.match(key)
        if match is None:
            problems.append(f"unexpected key {key!r}")
            continue
        layers.setdefault(int(match.group(1)), {})[match.group(2)] = value
    linears = []
    for index in sorted(layers):
        weight, bias = layers[index].get("weight"), layers[index].get("bias")
        if weight is None or weight.dim() != 2:
            problems.append(f"layers.{index}.weight missing or not 2-D")
            continue
        if linears and linears[-1].out_features != weight.shape[1]:
            problems.append(f"layers.{index} takes {weight.shape[1]} inputs but the previous "
                            f"layer gives {linears[-1].out_features}")
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        linears.append(linear)
    if linears and linears[-1].out_features != 1:
        problems.append(f"the last layer gives {linears[-1].out_features} outputs, not 1")
    if not linears:
        problems.append("no layers.<i>.weight tensors")
    if problems:
        raise ValueError(f"aesthetic head {path}: " + "; ".join(problems))
    return nn.Sequential(*linears)


class AestheticScorer(RewardScorer):
    """``aesthetic = head(clip_image_embedding / ||clip_image_embedding||)``; prompt-free.

    Args:
        model_path: transformers CLIP directory (the LAION head was trained on ViT-L/14).
        head_path: head weights; default: the first of ``HEAD_FILENAMES`` inside model_path.
        processor_path, device, dtype, batch_size: as for PickScoreScorer.
    """

    components: ClassVar[tuple[str, ...]] = ("aesthetic",)
    required_tracks: ClassVar[tuple[str, ...]] = ("image",)

    def __init__(self, *, model_path: str, head_path: str | None = None,
                 processor_path: str | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, batch_size: int = 64) -> None:
        if head_path is None:
            found = [os.path.join(model_path, n) for n in HEAD_FILENAMES
                     if os.path.isfile(os.path.join(model_path, n))]
            if not found:
                raise FileNotFoundError(f"AestheticScorer: no head_path given and none of "
                                        f"{', '.join(HEAD_FILENAMES)} in {model_path}")
            head_path = found[0]
        self.clip = HFClip(model_path, processor_path=processor_path, device=device, dtype=dtype,
                           batch_size=batch_size)
        head = load_linear_stack(head_path)
        width = self.clip.model.config.projection_dim
        if head[0].in_features != width:
            raise ValueError(f"aesthetic head {head_path} takes {head[0].in_features}-d "
                             f"embeddings, the CLIP model gives {width}-d")
        # The head is tiny; fp32 keeps its summed dot products exact enough at no cost.
        self.head = head.to(self.clip.device).eval().requires_grad_(False)

    def to(self, device: str | torch.device) -> "AestheticScorer":
        self.clip.to(device)
        self.head.to(device)
        return self

    @torch.inference_mode()
    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {"aesthetic": self.head(self.clip.image_embeds(images)).squeeze(-1)}
