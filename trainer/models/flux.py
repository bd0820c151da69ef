"""FLUX.1: FluxTransformer2DModel, AutoencoderKL, CLIP (pooled) + T5 (sequence).

Delegates to diffusers' FluxPipeline (built from the loaded parts without a transformer):
``encode_prompt``, 2x2 latent packing, the latent image ids (``_prepare_latent_image_ids``) and
the mu-shifted schedule (``calculate_shift`` on the packed sequence length, fed to the model's
own scheduler with the pipeline's linspace(1, 1/N, N) sigmas).

Guidance: FLUX.1-dev is guidance-distilled (``guidance_embeds`` in its transformer config): the
guidance strength is an input embedding of one forward, not classifier-free guidance, so it is
compatible with guidance_scale == 1.0 (one forward per step, no CFG second forward). It
is fixed for the run by the ``embedded_guidance`` option (3.5, the pipeline's default) and
passed on every forward, rollout and replay alike; for models without the embedding
(FLUX.1-schnell) nothing is passed and the option is ignored.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from trainer.models.diffusers_base import PackedLatentsAdapter, base_module, images_to_uint8
from trainer.models.geometry import Geometry

# diffusers and transformers are imported inside the methods that need them, so importing
# the adapter class (as the config checks do) imports neither: trainer/models/diffusers_base.py.


def _pipeline_cls():
    from diffusers import FluxPipeline

    return FluxPipeline


class FluxAdapter(PackedLatentsAdapter):
    """Adapter of the FLUX.1 family (dotpath ``trainer.models.flux.FluxAdapter``).

    Options: ``revision`` (None), ``max_sequence_length`` (512, T5 tokens),
    ``embedded_guidance`` (3.5; used only when the transformer has guidance embeddings).
    """

    family = "flux"
    # FLUX.1-dev is guidance-distilled: its guidance is the embedded input above, not CFG.
    supports_cfg = False
    transformer_class = "FluxTransformer2DModel"
    supported_tasks = ("t2i",)
    condition_keys = ("prompt_embeds", "pooled_prompt_embeds")
    block_attrs = ("transformer_blocks", "single_transformer_blocks")
    # Attention projections: "attn.to_q/k/v" match both the double-stream and the single-stream
    # blocks; the add_* projections and outputs exist in the double-stream blocks only.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    default_max_sequence_length = 512
    extra_options = {"embedded_guidance": 3.5}
    # SGLang's native serving of this family, read by trainer/engine/sglang/: its DiT (whose
    # name mapping packs nothing of FLUX's) and where its denoising env keeps each condition.
    # SGLang embeds the server's ``embedded_cfg_scale`` (its pipeline config, 3.5 by default),
    # not the request's: a server run with another value must match ``embedded_guidance``.
    sglang_dit = "sglang.multimodal_gen.runtime.models.dits.flux.FluxTransformer2DModel"
    sglang_conditions = {"prompt_embeds": ("pos_cond_kwargs", "encoder_hidden_states"),
                         "pooled_prompt_embeds": ("pos_cond_kwargs", "pooled_projections")}

    def __init__(self, model_path: str, **options: Any) -> None:
        super().__init__(model_path, **options)
        self.embedded_guidance = float(self.options["embedded_guidance"])

    # ---- geometry (packing: PackedLatentsAdapter) ----------------------------------------
    display_name = "FLUX"
    pipeline_class = staticmethod(_pipeline_cls)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config["block_out_channels"]) - 1)

    def scheduler_sigmas(self, num_inference_steps: int, geometry: Geometry) -> torch.Tensor:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        cfg = self.scheduler.config
        sigmas = None if cfg.get("use_flow_sigmas", False) else \
            np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        mu = calculate_shift(self.latent_shape(geometry)[0], cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        return self._scheduler_sigmas(num_inference_steps, sigmas=sigmas, mu=mu)

    # ---- engine side ----------------------------------------------------------------------
    def load_frozen(self, *, device: str | torch.device, dtype: torch.dtype) -> dict[str, Any]:
        from diffusers import AutoencoderKL
        from transformers import CLIPTextModel, T5EncoderModel

        vae = self._from_pretrained(AutoencoderKL, "vae", dtype, device)
        text_encoder = self._from_pretrained(CLIPTextModel, "text_encoder", dtype, device)
        text_encoder_2 = self._from_pretrained(T5EncoderModel, "text_encoder_2", dtype, device)
        tokenizer, tokenizer_2 = self._load_tokenizer("tokenizer"), self._load_tokenizer("tokenizer_2")
        self._check_tokenizers({"tokenizer": (tokenizer, text_encoder),
                                "tokenizer_2": (tokenizer_2, text_encoder_2)})
        pipeline = self.pipeline_class()(scheduler=self.scheduler, vae=vae, text_encoder=text_encoder,
                                         tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                                         tokenizer_2=tokenizer_2, transformer=None)
        return {"pipeline": pipeline, "vae": vae, "text_encoder": text_encoder,
                "text_encoder_2": text_encoder_2, "tokenizer": tokenizer, "tokenizer_2": tokenizer_2,
                "device": torch.device(device), "dtype": dtype}

    @torch.no_grad()
    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _text_ids = frozen["pipeline"].encode_prompt(
            prompt=list(prompts), prompt_2=None, device=frozen["device"],
            max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], geometry: Geometry) -> torch.Tensor:
        latents, cond, dtype = self._cast_inputs(transformer, latents, conditions)
        batch, device = latents.shape[0], latents.device
        sigma = torch.as_tensor(sigma, device=device).reshape(-1).expand(batch)
        timestep = (sigma.to(torch.float32) * 1000).to(dtype) / 1000
        hidden, img_ids = self.image_stream(latents, cond, geometry)
        txt_ids = torch.zeros(cond["prompt_embeds"].shape[1], 3, device=device, dtype=dtype)
        guidance = None
        if base_module(transformer).config.guidance_embeds:
            guidance = torch.full([1], self.embedded_guidance, device=device, dtype=torch.float32).expand(batch)
        out = transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=cond["prompt_embeds"],
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return out if out.shape[1] == latents.shape[1] else out[:, :latents.shape[1]]

    def image_stream(self, latents: torch.Tensor, cond: dict[str, torch.Tensor],
                     geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's image tokens and their position ids [L, 3]: FLUX.1's are the noisy
        latents alone (an editing subclass appends its references; the velocity is always the
        first ``latents.shape[1]`` output tokens)."""
        _, h, w = self.init_noise_shape(geometry)
        ids = self.pipeline_class()._prepare_latent_image_ids(latents.shape[0], h // 2, w // 2,
                                                              latents.device, latents.dtype)
        return latents, ids

    @torch.no_grad()
    def decode(self, frozen: dict[str, Any], latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        pipeline, vae = frozen["pipeline"], frozen["vae"]
        z = pipeline._unpack_latents(latents, geometry.height, geometry.width,
                                     pipeline.vae_scale_factor)
        z = z.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        images = vae.decode(z, return_dict=False)[0]
        return images_to_uint8(pipeline.image_processor, images)
