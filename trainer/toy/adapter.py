"""ToyAdapter: the tiny pixel-space SD3-family model behind the real adapter contract.

The shipped model (``trainer.toy.weights_dir()``) is a diffusers ``SD3Transformer2DModel`` whose
latent is the image itself in [-1, 1] (``[3, H, W]``), conditioned on a tiny transformers
``CLIPTextModel``: its last hidden states are the joint-attention context and its EOS-pooled
output the pooled projection, the two inputs SD3 takes. The velocity convention is the
rectified-flow one of diffusers' FlowMatchEulerDiscreteScheduler: x_sigma = (1 - sigma) x0 +
sigma noise, v = noise - x0, and the transformer sees timestep = 1000 sigma, as in SD3.

Noise is a pure function of (seed, sample id[, step]) through a CPU ``torch.Generator`` seeded
from sha256, drawn in fp32 and only then cast and moved: the same candidate gets the same x_T
and step noise on any device, dtype, batch composition or rank.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from trainer.models.base import GenerativeModelAdapter


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from sha256 of the parts joined by ':' (never Python's salted hash())."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def _seeded_normal(shape: Sequence[int], *parts: object) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(stable_seed(*parts))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float32)


class ToyAdapter(GenerativeModelAdapter):
    """Adapter for the toy model directory (default: the shipped weights).

    Args:
        model_path: diffusers-style directory written by ``trainer.toy.modeling``; None or
            "toy" means ``trainer.toy.weights_dir()``.
        **options: kept in ``self.options`` (none are read yet).
    """

    family: ClassVar[str] = "toy"
    supported_tasks: ClassVar[tuple[str, ...]] = ("t2i",)

    def __init__(self, model_path: str | Path | None = None, **options: Any) -> None:
        if model_path in (None, "toy"):
            from trainer.toy import weights_dir
            model_path = weights_dir()
        root = Path(model_path)
        missing = [p for p in ("transformer", "text_encoder", "tokenizer", "toy_config.json")
                   if not (root / p).exists()]
        if missing:
            raise FileNotFoundError(f"{root} is not a toy model directory: missing {missing}")
        super().__init__(str(root), **options)
        self.root = root
        self.toy_config = json.loads((root / "toy_config.json").read_text())
        tcfg = json.loads((root / "transformer" / "config.json").read_text())
        self.patch_size = int(tcfg["patch_size"])
        self.channels = int(tcfg["in_channels"])
        self.max_grid = int(tcfg["pos_embed_max_size"])
        self.resolution = int(self.toy_config["resolution"])

    # ---- actor side -------------------------------------------------------------------
    def load_train_model(self, *, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> nn.Module:
        from diffusers import SD3Transformer2DModel
        model = SD3Transformer2DModel.from_pretrained(self.root, subfolder="transformer",
                                                      torch_dtype=dtype)
        return model.to(device)

    def transformer_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.transformer_blocks)

    def lora_target_modules(self) -> list[str]:
        # Both streams' attention projections. The last SD3 block is context_pre_only and has
        # no to_add_out; peft matches by suffix, so its absence there is fine.
        return ["to_q", "to_k", "to_v", "to_out.0",
                "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]

    # ---- engine side ------------------------------------------------------------------
    def load_frozen(self, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """{"tokenizer", "text_encoder"}; no VAE in pixel space (``decode`` is arithmetic)."""
        from transformers import CLIPTextModel, PreTrainedTokenizerFast
        tokenizer = PreTrainedTokenizerFast.from_pretrained(self.root / "tokenizer")
        text_encoder = CLIPTextModel.from_pretrained(self.root / "text_encoder",
                                                     torch_dtype=dtype).to(device)
        text_encoder.eval().requires_grad_(False)
        return {"tokenizer": tokenizer, "text_encoder": text_encoder}

    def tokenize(self, tokenizer: Any, prompts: list[str]) -> torch.Tensor:
        """input_ids [B, max_prompt_tokens]; ValueError naming every prompt that is too long."""
        length = int(self.toy_config["max_prompt_tokens"])
        ids = tokenizer(list(prompts), padding="max_length", max_length=length,
                        truncation=False, return_tensors=None)["input_ids"]
        long = [f"{i}: {p!r} ({len(t)} tokens)" for i, (p, t) in enumerate(zip(prompts, ids))
                if len(t) > length]
        if long:
            raise ValueError(f"prompts longer than {length} tokens: " + "; ".join(long))
        return torch.tensor(ids, dtype=torch.long)

    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": [B, L, D], "pooled_prompt_embeds": [B, D]} from the text encoder."""
        encoder = frozen["text_encoder"]
        ids = self.tokenize(frozen["tokenizer"], prompts).to(encoder.device)
        out = encoder(input_ids=ids)
        return {"prompt_embeds": out.last_hidden_state, "pooled_prompt_embeds": out.pooler_output}

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        problems = []
        for name, v in (("height", height), ("width", width)):
            if v % self.patch_size:
                problems.append(f"{name}={v} is not a multiple of the patch size {self.patch_size}")
            elif v // self.patch_size > self.max_grid:
                problems.append(f"{name}={v} exceeds {self.max_grid * self.patch_size} px "
                                f"(pos_embed_max_size {self.max_grid} x patch {self.patch_size})")
        if problems:
            raise ValueError("ToyAdapter.latent_shape: " + "; ".join(problems))
        return (self.channels, height, width)

    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], height: int, width: int) -> torch.Tensor:
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, device=latents.device, dtype=torch.float32)
        timestep = (sigma.reshape(-1).expand(b) if sigma.numel() == 1 else sigma.reshape(b)) * 1000
        dtype = latents.dtype
        return transformer(
            hidden_states=latents,
            encoder_hidden_states=conditions["prompt_embeds"].to(dtype),
            pooled_projections=conditions["pooled_prompt_embeds"].to(dtype),
            timestep=timestep,
            return_dict=False,
        )[0]

    def decode(self, frozen: dict[str, Any], latents: torch.Tensor, height: int,
               width: int) -> torch.Tensor:
        """[-1, 1] pixels [B, 3, H, W] -> uint8 [B, H, W, 3] (clamped, rounded)."""
        img = (latents.float().clamp(-1.0, 1.0) + 1.0) * 127.5
        return img.round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()

    # ---- per-candidate noise ----------------------------------------------------------
    def initial_latents(self, sample_ids: Sequence[str], height: int, width: int, *, seed: int,
                        dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> torch.Tensor:
        """x_T [B, *latent_shape]: row i depends only on (seed, sample_ids[i])."""
        shape = self.latent_shape(height, width)
        rows = [_seeded_normal(shape, "toy-xT", seed, sid) for sid in sample_ids]
        return torch.stack(rows).to(device=device, dtype=dtype)

    def step_noise(self, sample_ids: Sequence[str], step_index: int, shape: Sequence[int], *,
                   seed: int, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> torch.Tensor:
        """Noise [B, *shape] for SDE step ``step_index``; ``shape`` is the per-sample shape.

        Row i depends only on (seed, sample_ids[i], step_index).
        """
        rows = [_seeded_normal(shape, "toy-step", seed, sid, int(step_index)) for sid in sample_ids]
        return torch.stack(rows).to(device=device, dtype=dtype)
