"""Stable Diffusion 3 / 3.5: SD3Transformer2DModel, AutoencoderKL, CLIP-L + CLIP-G + T5.

Delegates to diffusers' StableDiffusion3Pipeline (built from the loaded parts without a
transformer): ``encode_prompt`` (the three encoders, CLIP states zero-padded to the T5 width,
pooled CLIP-L/G concatenated) and the schedule, which is the model's own scheduler stepped the
way the pipeline calls it: ``set_timesteps(N)`` with the static shift of the scheduler config
(3.0 for SD3/3.5), or with ``mu`` when the config enables dynamic shifting.

Design choices:
- Latents stay in the transformer's [C, h, w] layout (SD3 patchifies inside the model), so x_T
  needs no packing; the transformer timestep is sigma * num_train_timesteps, as the pipeline.
- The T5 window is the pipeline's default, 256 tokens (``max_sequence_length``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.models.diffusers_base import DiffusersAdapter, images_to_uint8
from trainer.models.geometry import Geometry

# diffusers and transformers are imported inside the methods that need them, so importing
# the adapter class (as the config checks do) imports neither: trainer/models/diffusers_base.py.


class SD3Adapter(DiffusersAdapter):
    """Adapter of the SD3 family (dotpath ``trainer.models.sd3.SD3Adapter``).

    Options: ``revision`` (None), ``max_sequence_length`` (256, T5 tokens).
    """

    family = "sd3"
    transformer_class = "SD3Transformer2DModel"
    supported_tasks = ("t2i",)
    condition_keys = ("prompt_embeds", "pooled_prompt_embeds")
    block_attrs = ("transformer_blocks",)
    # The joint-attention projections of both streams, as Flow-GRPO's SD3.5 LoRA recipe.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    default_max_sequence_length = 256
    # SGLang's native serving of this family, read by trainer/engine/sglang/: its DiT (whose
    # name mapping packs nothing of SD3's: every served name is ours) and where its denoising
    # env keeps each condition (both in the positive conditioning kwargs)
    sglang_dit = ("sglang.multimodal_gen.runtime.models.dits.stablediffusion3."
                  "SD3Transformer2DModel")
    sglang_conditions = {"prompt_embeds": ("pos_cond_kwargs", "encoder_hidden_states"),
                         "pooled_prompt_embeds": ("pos_cond_kwargs", "pooled_projections")}
    # diffusers keeps the sin-cos position table as a buffer (never trained or sent); SGLang's
    # native DiT holds it as a parameter, which the extension's receiver leaves out of syncs
    sglang_fixed_parameters = ("pos_embed.pos_embed",)

    # ---- geometry -----------------------------------------------------------------------
    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config["block_out_channels"]) - 1)

    def resolution_problems(self, geometry: Geometry) -> list[str]:
        problems = super().resolution_problems(geometry)
        height, width = geometry.height, geometry.width
        patch = self.transformer_config["patch_size"]
        multiple = self.vae_scale_factor * patch
        if height % multiple or width % multiple:
            return problems + [f"height and width must be multiples of {multiple} for SD3 "
                    f"(VAE x{self.vae_scale_factor}, patch {patch}), got {height}x{width}"]
        limit = self.transformer_config["pos_embed_max_size"] * multiple
        if height > limit or width > limit:
            return problems + [f"height and width must be at most {limit} for this SD3 transformer "
                    f"(pos_embed_max_size {self.transformer_config['pos_embed_max_size']}), "
                    f"got {height}x{width}"]
        return problems

    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        vsf = self.vae_scale_factor
        return (self.transformer_config["in_channels"], int(geometry.height) // vsf,
                int(geometry.width) // vsf)

    def scheduler_sigmas(self, num_inference_steps: int, geometry: Geometry) -> torch.Tensor:
        cfg = self.scheduler.config
        if not cfg.get("use_dynamic_shifting", False):
            return self._scheduler_sigmas(num_inference_steps)
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        _, h, w = self.latent_shape(geometry)
        patch = self.transformer_config["patch_size"]
        mu = calculate_shift((h // patch) * (w // patch), cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.16))
        return self._scheduler_sigmas(num_inference_steps, mu=mu)

    # ---- engine side ----------------------------------------------------------------------
    def load_frozen(self, *, device: str | torch.device, dtype: torch.dtype) -> dict[str, Any]:
        from diffusers import AutoencoderKL, StableDiffusion3Pipeline
        from transformers import CLIPTextModelWithProjection, T5EncoderModel

        vae = self._from_pretrained(AutoencoderKL, "vae", dtype, device)
        encoders = {
            "text_encoder": self._from_pretrained(CLIPTextModelWithProjection, "text_encoder", dtype, device),
            "text_encoder_2": self._from_pretrained(CLIPTextModelWithProjection, "text_encoder_2", dtype, device),
            "text_encoder_3": self._from_pretrained(T5EncoderModel, "text_encoder_3", dtype, device),
        }
        tokenizers = {name: self._load_tokenizer(name) for name in ("tokenizer", "tokenizer_2", "tokenizer_3")}
        self._check_tokenizers({
            "tokenizer": (tokenizers["tokenizer"], encoders["text_encoder"]),
            "tokenizer_2": (tokenizers["tokenizer_2"], encoders["text_encoder_2"]),
            "tokenizer_3": (tokenizers["tokenizer_3"], encoders["text_encoder_3"]),
        })
        pipeline = StableDiffusion3Pipeline(transformer=None, scheduler=self.scheduler, vae=vae,
                                            **encoders, **tokenizers)
        return {"pipeline": pipeline, "vae": vae, **encoders, **tokenizers,
                "device": torch.device(device), "dtype": dtype}

    @torch.no_grad()
    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        prompts = list(prompts)
        embeds, _, pooled, _ = frozen["pipeline"].encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=frozen["device"],
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], geometry: Geometry) -> torch.Tensor:
        latents, cond, _ = self._cast_inputs(transformer, latents, conditions)
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, device=latents.device).reshape(-1).expand(batch)
        timestep = sigma.to(torch.float32) * float(self.scheduler.config.num_train_timesteps)
        return transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, frozen: dict[str, Any], latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        pipeline, vae = frozen["pipeline"], frozen["vae"]
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(z, return_dict=False)[0]
        return images_to_uint8(pipeline.image_processor, images)
