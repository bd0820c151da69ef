"""ImageReward (Xu et al., NeurIPS 2023): BLIP's ViT-L/16 image tower, its BERT text encoder
cross-attending to the image, and an MLP head on the [CLS] state, trained on human
preference rankings. Score = (mlp(cls) - 0.16717362830052426) / 1.0333394966054072, the
normalisation the released model ships with.

The towers are transformers' BLIP classes (``BlipVisionModel``, ``BlipTextModel``: BLIP's own
architecture ported), built from ``ARCHITECTURE`` (or the ``architecture`` option, which is how
tests build a tiny one with random weights). The released checkpoint (``ImageReward.pt``, a
state dict in BLIP's original names) is renamed onto them by ``convert_original``; every
tensor of the towers and head must be found there, so a wrong or truncated file fails at load.

Files: ``model_path`` is ``ImageReward.pt`` or a directory holding it; the tokenizer is
bert-base-uncased's (``tokenizer_path``, default: ``model_path``'s directory), tokenised as
the released code does (padded and truncated to 35 tokens). Images: bicubic resize of the
short side to 224, centre crop, CLIP's mean and std.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from trainer.rewards.base import RewardScorer
from trainer.rewards.preprocess import ClipImageTransform

ARCHITECTURE: dict[str, int] = dict(
    image_size=224, patch_size=16, vision_hidden=1024, vision_layers=24, vision_heads=16,
    vision_mlp=4096, text_hidden=768, text_layers=12, text_heads=12, text_mlp=3072,
    vocab_size=30524, max_positions=512, max_length=35)
SCORE_MEAN, SCORE_STD = 0.16717362830052426, 1.0333394966054072
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CHECKPOINT_NAME = "ImageReward.pt"

# BLIP's ViT names -> BlipVisionModel's (the text encoder's names are already BLIP's own)
_VISION_RENAMES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


class ImageRewardHead(nn.Module):
    """The released head: five linear layers, no activations, dropout between (inactive in
    eval). Same module names as the checkpoint (``mlp.layers.N``)."""

    def __init__(self, width: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ImageRewardModel(nn.Module):
    def __init__(self, arch: dict[str, int]):
        super().__init__()
        # local: transformers is a multi-second import, paid only by a run that scores with it
        from transformers import (BlipTextConfig, BlipTextModel, BlipVisionConfig,
                                  BlipVisionModel)
        a = {**ARCHITECTURE, **arch}
        self.vision = BlipVisionModel(BlipVisionConfig(
            hidden_size=a["vision_hidden"], intermediate_size=a["vision_mlp"],
            num_hidden_layers=a["vision_layers"], num_attention_heads=a["vision_heads"],
            image_size=a["image_size"], patch_size=a["patch_size"], layer_norm_eps=1e-6))
        self.text = BlipTextModel(BlipTextConfig(
            vocab_size=a["vocab_size"], hidden_size=a["text_hidden"],
            encoder_hidden_size=a["vision_hidden"], intermediate_size=a["text_mlp"],
            num_hidden_layers=a["text_layers"], num_attention_heads=a["text_heads"],
            max_position_embeddings=a["max_positions"], is_decoder=True,
            bos_token_id=None, sep_token_id=None),  # generation ids: unused when scoring
            add_pooling_layer=False)  # is_decoder builds the cross-attention layers
        self.mlp = ImageRewardHead(a["text_hidden"])

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        image = self.vision(pixel_values=pixels).last_hidden_state
        image_mask = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
        text = self.text(input_ids=input_ids, attention_mask=attention_mask,
                         encoder_hidden_states=image, encoder_attention_mask=image_mask,
                         is_decoder=False).last_hidden_state  # bidirectional, as BLIP's encoder
        return ((self.mlp(text[:, 0].float()) - SCORE_MEAN) / SCORE_STD).squeeze(-1)


def convert_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ImageReward.pt names (``blip.visual_encoder.*``, ``blip.text_encoder.*``,
    ``mlp.layers.*``) -> ImageRewardModel's; other tensors (BLIP's unused heads) dropped."""
    out = {}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            name = key[len("blip.visual_encoder."):]
            for pattern, repl in _VISION_RENAMES:
                name, n = re.subn(pattern, repl, name)
                if n:
                    break
            out["vision." + name] = value
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            out["text." + key[len("blip.text_encoder."):]] = value
        elif key.startswith("mlp."):
            out[key] = value
    return out


def _checkpoint_file(model_path: str) -> Path:
    p = Path(model_path)
    return p / CHECKPOINT_NAME if p.is_dir() else p


class ImageRewardScorer(RewardScorer):
    """Options: ``model_path`` (required), ``tokenizer_path``, ``architecture`` (overrides of
    ARCHITECTURE), ``batch_size``, ``dtype`` ("fp32" | "bf16")."""

    components: ClassVar[tuple[str, ...]] = ("imagereward",)

    def __init__(self, *, model_path: str, tokenizer_path: str | None = None,
                 architecture: dict | None = None, batch_size: int = 16, dtype: str = "fp32",
                 device: str | torch.device | None = None) -> None:
        from transformers import AutoTokenizer  # local: a multi-second import
        problems = self.check_options(architecture=architecture, dtype=dtype)
        ckpt = _checkpoint_file(model_path)
        if not ckpt.is_file():
            problems.append(f"no ImageReward checkpoint at {ckpt}")
        tokenizer_dir = Path(tokenizer_path or ckpt.parent)
        if not any((tokenizer_dir / f).is_file() for f in ("vocab.txt", "tokenizer.json")):
            problems.append(f"no tokenizer (vocab.txt / tokenizer.json) in {tokenizer_dir}: "
                            "ImageReward uses bert-base-uncased's; pass tokenizer_path")
        if problems:
            raise ValueError("; ".join(problems))
        self.arch = {**ARCHITECTURE, **(architecture or {})}
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.model = ImageRewardModel(self.arch).eval()
        state = convert_original(torch.load(ckpt, map_location="cpu", weights_only=True))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(f"{ckpt} does not match the ImageReward architecture: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}")
        self.dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.model.to(self.device, self.dtype).requires_grad_(False)
        size = self.arch["image_size"]
        self.transform = ClipImageTransform(resize=("shortest", size), crop=(size, size),
                                            mean=CLIP_MEAN, std=CLIP_STD,
                                            crop_rounding="round")
        self.batch_size = int(batch_size)

    @classmethod
    def check_options(cls, architecture: dict | None = None, dtype: str = "fp32",
                      **_: Any) -> list[str]:
        problems = []
        unknown = sorted(set(architecture or {}) - set(ARCHITECTURE))
        if unknown:
            problems.append(f"architecture keys {unknown} unknown (known: "
                            f"{sorted(ARCHITECTURE)})")
        if dtype not in ("fp32", "bf16"):
            problems.append(f"dtype={dtype!r}: choose fp32 or bf16")
        return problems

    @torch.no_grad()
    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        out = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            pixels = self.transform(images[chunk], device=self.device, dtype=self.dtype)
            text = self.tokenizer(prompts[chunk], padding="max_length", truncation=True,
                                  max_length=self.arch["max_length"], return_tensors="pt")
            out.append(self.model(pixels, text.input_ids.to(self.device),
                                  text.attention_mask.to(self.device)).float().cpu())
        return {"imagereward": torch.cat(out)}
