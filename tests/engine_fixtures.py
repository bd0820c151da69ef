"""A minimal model adapter for the engine and rollout tests (fast: no text encoder, no VAE).

``FixtureAdapter`` wraps a tiny random ``QwenImageTransformer2DModel`` saved with
``save_pretrained`` and loaded back through ``from_pretrained``; its "text encoder" is a byte
embedding table and its "decoder" a per-channel linear map to RGB, both saved as safetensors
in the model directory. Latents use Qwen-Image's 2x2 packing. Everything the engine and the
driver call goes through the real ``GenerativeModelAdapter`` contract (request building,
validation and packing are the base class's, from trainer/models/wire/).

``build_fixture_model_dir(root)`` writes::

    root/transformer/{config.json, diffusion_pytorch_model.safetensors}
    root/frozen.safetensors          text.embedding [256, JOINT], decoder.weight [3, C]
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.models.base import GenerativeModelAdapter
from trainer.models.geometry import Geometry
from trainer.models.qwen_image import QwenImageAdapter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ADAPTER_PATH = "engine_fixtures.FixtureAdapter"
LATENT_CHANNELS = 4          # unpacked latent channels; packed 2x2 -> 16
JOINT = 16                   # text embedding width
TEXT_LEN = 6                 # bytes of the prompt kept
HEIGHT = WIDTH = 32          # pixels: a 2x2 grid of packed tokens (VAE factor 8, 2x2 packing)
VAE_FACTOR = 8


def build_fixture_model_dir(root: str | Path, *, seed: int = 0) -> Path:
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=4 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
            num_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=JOINT,
            axes_dims_rope=(2, 2, 4))
        transformer.save_pretrained(root / "transformer")
        save_file({"text.embedding": torch.randn(256, JOINT),
                   "decoder.weight": torch.randn(3, LATENT_CHANNELS) * 0.5},
                  str(root / "frozen.safetensors"))
    return root


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C] (Qwen-Image's 2x2 packing)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, packed_c = latents.shape
    c = packed_c // 4
    x = latents.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


class FixtureAdapter(GenerativeModelAdapter):
    family = "engine_fixture"
    supported_tasks = ("t2i",)
    condition_keys = ("prompt_embeds", "prompt_embeds_mask")

    def load_train_model(self, *, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> nn.Module:
        from diffusers import QwenImageTransformer2DModel

        from trainer.patches.diffusers_qwen_fast_paths import install_fast_paths

        install_fast_paths()  # as QwenImageAdapter loads the same transformer
        return QwenImageTransformer2DModel.from_pretrained(
            self.model_path, subfolder="transformer", torch_dtype=dtype).to(device)

    def transformer_blocks(self, model: nn.Module) -> list[nn.Module]:
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        return list(inner.transformer_blocks)

    def lora_target_modules(self) -> list[str]:
        return ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]

    # the transformer is Qwen-Image's: its blocks take the text length where Qwen-Image's do
    block_dynamic_dims = QwenImageAdapter.block_dynamic_dims

    def load_frozen(self, *, device: str | torch.device, dtype: torch.dtype) -> dict[str, Any]:
        from safetensors.torch import load_file

        state = load_file(str(Path(self.model_path) / "frozen.safetensors"))
        text = nn.Embedding.from_pretrained(state["text.embedding"].to(dtype)).to(device)
        decoder = nn.Linear(LATENT_CHANNELS, 3, bias=False).to(device=device, dtype=dtype)
        with torch.no_grad():
            decoder.weight.copy_(state["decoder.weight"])
        return {"text": text.requires_grad_(False), "decoder": decoder.requires_grad_(False),
                "device": torch.device(device)}

    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        ids = torch.zeros(len(prompts), TEXT_LEN, dtype=torch.long)
        mask = torch.zeros(len(prompts), TEXT_LEN, dtype=torch.long)
        for i, p in enumerate(prompts):
            raw = list(p.encode("utf-8"))[:TEXT_LEN] or [0]
            ids[i, :len(raw)] = torch.tensor(raw)
            mask[i, :len(raw)] = 1
        device = frozen["device"]
        return {"prompt_embeds": frozen["text"](ids.to(device)), "prompt_embeds_mask": mask.to(device)}

    def resolution_problems(self, geometry: Geometry) -> list[str]:
        step = VAE_FACTOR * 2
        problems = super().resolution_problems(geometry)
        if geometry.height % step or geometry.width % step:
            problems.append(f"height and width must be multiples of {step}, got {geometry}")
        return problems

    def init_noise_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        return LATENT_CHANNELS, geometry.height // VAE_FACTOR, geometry.width // VAE_FACTOR

    def latent_shape(self, geometry: Geometry) -> tuple[int, int]:
        c, h, w = self.init_noise_shape(geometry)
        return (h // 2) * (w // 2), 4 * c

    def noise_to_latents(self, noise: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return pack(noise)

    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], geometry: Geometry) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        batch = latents.shape[0]
        _, h, w = self.init_noise_shape(geometry)
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=torch.as_tensor(sigma, device=latents.device).reshape(-1).expand(batch).to(dtype),
            encoder_hidden_states=conditions["prompt_embeds"].to(dtype),
            encoder_hidden_states_mask=conditions["prompt_embeds_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * batch,
            return_dict=False,
        )[0]

    def decode(self, frozen: dict[str, Any], latents: torch.Tensor,
               geometry: Geometry) -> torch.Tensor:
        _, h, w = self.init_noise_shape(geometry)
        z = unpack(latents, h, w).to(frozen["decoder"].weight.dtype)       # [B, C, h, w]
        rgb = frozen["decoder"](z.permute(0, 2, 3, 1)).tanh()              # [B, h, w, 3]
        rgb = rgb.repeat_interleave(VAE_FACTOR, 1).repeat_interleave(VAE_FACTOR, 2)
        return ((rgb.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)


SAMPLING = {
    "height": HEIGHT, "width": WIDTH, "num_inference_steps": 6, "guidance_scale": 1.0,
    "eta": 0.7, "sde_type": "sde", "sde_indices": [1, 3, 4],
}


def make_request(adapter: GenerativeModelAdapter, prompts: list[str], ids: list[str], *,
                 sampling: dict | None = None, seed: int = 1234, rollout_id: int | None = 0,
                 sde_indices: list[int] | None = None) -> dict[str, Any]:
    return adapter.build_rollout_request(prompts, ids, sampling or SAMPLING, rollout_id=rollout_id,
                                         seed=seed, sde_indices=sde_indices)


EDIT_ADAPTER_PATH = "engine_fixtures.EditFixtureAdapter"


class EditFixtureAdapter(FixtureAdapter):
    """``FixtureAdapter`` with conditioning media: up to two reference images per candidate,
    each one token (its mean colour at the output size, mapped through the first three rows
    of the byte embedding table) appended to the text tokens the transformer attends to. The
    real editing families put VAE latents on the image sequence instead (qwen_image_edit.py);
    this one exercises the contract's path, request to replay, in a fraction of the time."""

    family = "edit_fixture"
    supported_tasks = ("edit",)
    condition_keys = ("prompt_embeds", "prompt_embeds_mask", "image_embeds", "image_mask")
    max_condition_images = 2

    def encode_conditions(self, frozen: dict[str, Any], prompts: list[str], images,
                          geometry: Geometry) -> dict[str, torch.Tensor]:
        import numpy as np

        cond = self.encode_prompts(frozen, prompts)
        table = frozen["text"].weight[:3]
        k = max(len(refs) for refs in images)
        embeds = table.new_zeros(len(prompts), k, table.shape[1])
        mask = torch.zeros(len(prompts), k, dtype=torch.long, device=table.device)
        for row, refs in enumerate(images):
            for col, ref in enumerate(refs):
                pixels = np.asarray(ref.open().resize((geometry.width, geometry.height)))
                colour = torch.tensor(pixels).float().mean((0, 1)) / 127.5 - 1
                embeds[row, col] = colour.to(table) @ table
                mask[row, col] = 1
        return {**cond, "image_embeds": embeds, "image_mask": mask}

    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], geometry: Geometry) -> torch.Tensor:
        joined = {"prompt_embeds": torch.cat([conditions["prompt_embeds"],
                                              conditions["image_embeds"]], 1),
                  "prompt_embeds_mask": torch.cat([conditions["prompt_embeds_mask"],
                                                   conditions["image_mask"]], 1)}
        return super().velocity(transformer, latents, sigma, joined, geometry)
