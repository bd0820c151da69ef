"""ToyAdapter: the tiny pixel-space SD3-family model behind the real adapter contract.

The toy model (``trainer.toy.weights_dir()``, written by ``trainer.toy.modeling``) is a diffusers
``SD3Transformer2DModel`` whose latent is the image itself in [-1, 1] (``[3, H, W]``; the
transformer patchifies it), conditioned on a tiny transformers ``CLIPTextModel``: its last
hidden states are the joint-attention context and its EOS-pooled output the pooled projection,
the two inputs SD3 takes. So everything but the text encoding and the decode is the SD3 path:
the same ``DiffusersAdapter`` loading, block list, LoRA targets, engine-name map, schedule
(the directory's own FlowMatchEulerDiscreteScheduler, shift 1) and timestep = 1000 sigma.

x_T and the SDE step noise come from the base class, i.e. the shared recipe of
``trainer.models.noise`` (a CPU generator seeded from a hashlib digest of seed, sample id and
stream): a toy candidate is bit-identical on any device, batch, rank or engine.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from trainer.data.prompt_files import cut
from trainer.models.diffusers_base import DiffusersAdapter, freeze
from trainer.models.sd3 import SD3Adapter
from trainer.models.geometry import Geometry
from trainer.toy import weights_dir

# transformers is imported inside load_frozen, as the other adapters import diffusers and
# transformers: importing the adapter class imports neither (trainer/models/diffusers_base.py).


class ToyAdapter(DiffusersAdapter):
    """Adapter for a toy model directory (dotpath ``trainer.toy.adapter.ToyAdapter``).

    Args:
        model_path: the directory; None or "toy" means the shipped ``trainer.toy.weights_dir()``.
        revision: unused (local directory), accepted like every diffusers adapter.
        max_sequence_length: prompt tokens incl. BOS/EOS, padded to; default and maximum are
            the text encoder's ``max_prompt_tokens`` from toy_config.json (12).
    """

    family: ClassVar[str] = "toy"
    transformer_class: ClassVar[str] = "SD3Transformer2DModel"
    supported_tasks: ClassVar[tuple[str, ...]] = ("t2i",)
    condition_keys: ClassVar[tuple[str, ...]] = ("prompt_embeds", "pooled_prompt_embeds")
    block_attrs: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    # Both streams' joint-attention projections, as the SD3 adapter (the last block is
    # context_pre_only and has no to_add_out; peft only needs each name to match somewhere).
    lora_targets: ClassVar[tuple[str, ...]] = (
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    default_max_sequence_length: ClassVar[int] = 12

    def __init__(self, model_path: str | Path | None = None, **options: Any) -> None:
        if model_path is None or str(model_path) == "toy":
            model_path = weights_dir()
        root = Path(model_path)
        missing = [p for p in ("transformer", "text_encoder", "tokenizer", "scheduler",
                               "toy_config.json") if not (root / p).exists()]
        if missing:
            raise FileNotFoundError(f"{root} is not a toy model directory: missing {missing}")
        super().__init__(str(root), **options)
        self.root = root
        self.toy_config = json.loads((root / "toy_config.json").read_text())
        self.resolution = int(self.toy_config["resolution"])
        limit = int(self.toy_config["max_prompt_tokens"])
        if not 3 <= self.max_sequence_length <= limit:
            raise ValueError(f"ToyAdapter: max_sequence_length={self.max_sequence_length} must be "
                             f"in [3, {limit}] (the text encoder's positions)")

    # ---- geometry -----------------------------------------------------------------------
    def resolution_problems(self, geometry: Geometry) -> list[str]:
        patch = int(self.transformer_config["patch_size"])
        limit = int(self.transformer_config["pos_embed_max_size"]) * patch
        problems = super().resolution_problems(geometry)
        for name, v in (("height", geometry.height), ("width", geometry.width)):
            if v <= 0 or v % patch:
                problems.append(f"{name}={v} must be a positive multiple of the patch size {patch}")
            elif v > limit:
                problems.append(f"{name}={v} exceeds {limit} px (pos_embed_max_size x patch)")
        return problems

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        problems = self.resolution_problems(geometry)
        if problems:
            raise ValueError("ToyAdapter: " + "; ".join(problems))
        return int(self.transformer_config["in_channels"]), int(geometry.height), int(geometry.width)

    def scheduler_sigmas(self, num_inference_steps: int, geometry: Geometry) -> torch.Tensor:
        return self._scheduler_sigmas(num_inference_steps)

    # ---- engine side --------------------------------------------------------------------
    def load_frozen(self, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """{"tokenizer", "text_encoder", "device", "dtype"}: no VAE in pixel space."""
        from transformers import CLIPTextModel

        text_encoder = self._from_pretrained(CLIPTextModel, "text_encoder", dtype, device)
        tokenizer = self._load_tokenizer("tokenizer")
        self._check_tokenizers({"tokenizer": (tokenizer, text_encoder)})
        return {"tokenizer": tokenizer, "text_encoder": freeze(text_encoder),
                "device": torch.device(device), "dtype": dtype}

    def tokenize(self, tokenizer: Any, prompts: list[str]) -> torch.Tensor:
        """input_ids [B, max_sequence_length]; one ValueError naming every too-long prompt."""
        length = self.max_sequence_length
        ids = tokenizer(list(prompts), padding="max_length", max_length=length,
                        truncation=False)["input_ids"]
        # cut(): a 40k-token prompt stays one short line
        long = [f"{i}: {cut(p)} ({len(t)} tokens)" for i, (p, t) in enumerate(zip(prompts, ids))
                if len(t) > length]
        if long:
            raise ValueError(f"prompts longer than {length} tokens: " + "; ".join(long))
        return torch.tensor(ids, dtype=torch.long)

    @torch.no_grad()
    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": [B, L, D] last hidden states, "pooled_prompt_embeds": [B, D]}."""
        encoder = frozen["text_encoder"]
        out = encoder(input_ids=self.tokenize(frozen["tokenizer"], list(prompts)).to(encoder.device))
        return {"prompt_embeds": out.last_hidden_state, "pooled_prompt_embeds": out.pooler_output}

    # The same SD3Transformer2DModel call as the SD3 family (timestep = sigma x 1000).
    velocity = SD3Adapter.velocity

    @torch.no_grad()
    def decode(self, frozen: dict[str, Any], latents: torch.Tensor,
               geometry: Geometry) -> torch.Tensor:
        """Pixels in [-1, 1], [B, 3, H, W] -> uint8 [B, H, W, 3], clamped and rounded."""
        img = (latents.float().clamp(-1.0, 1.0) + 1.0) * 127.5
        return img.round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
