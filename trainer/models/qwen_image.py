"""Qwen-Image: QwenImageTransformer2DModel, AutoencoderKLQwenImage, Qwen2.5-VL text encoder.

Everything model-specific is delegated to diffusers' QwenImagePipeline (built from the loaded
parts without a transformer): the prompt template and its drop index (``encode_prompt``), 2x2
latent packing (``_pack_latents`` / ``_unpack_latents``) and the resolution-dependent shift
(``calculate_shift`` on the packed sequence length, fed to the model's own scheduler).

Design choices:
- The text window is 512 tokens (``max_sequence_length``), as SGLang's Qwen-Image pipeline fixes it.
- The prompt mask is always kept as a tensor (the pipeline turns an all-ones mask into None);
  a batch-first tensor is what the sidecar and the actor's micro-batches need.
- The timestep is passed as the pipeline passes it: (sigma * 1000) rounded to the latent dtype,
  then divided by 1000.
- Every forward pads the prompt embeddings with masked tokens (mask 0, as the pipeline pads a
  batch to its longest prompt) until image + text tokens are a multiple of
  ``joint_tokens_multiple`` (8). The attention kernels need the joint sequence's strides aligned
  to 8: compiled blocks otherwise build one graph for aligned and another for unaligned lengths
  (a compile in the middle of a run), and each distinct length can cost a first call of its
  own in the attention library. Padding keeps every length aligned and cuts the distinct
  lengths eightfold; a masked key adds nothing to attention and the rotary positions of the
  real tokens do not move, so the velocity is the unpadded one up to rounding. The engine and
  the actor both pad here, so replay sees what sampling saw. 1 turns it off.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from trainer.models.diffusers_base import PackedLatentsAdapter, images_to_uint8
from trainer.models.geometry import Geometry
from trainer.patches.diffusers_qwen_fast_paths import install_fast_paths

# diffusers and transformers are imported inside the methods that need them, so importing
# the adapter class (as the config checks do) imports neither: trainer/models/diffusers_base.py.


def _pipeline_cls():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline


class QwenImageAdapter(PackedLatentsAdapter):
    """Adapter of the Qwen-Image family (dotpath ``trainer.models.qwen_image.QwenImageAdapter``).

    Options: ``revision`` (None), ``max_sequence_length`` (512, text tokens after the template),
    ``joint_tokens_multiple`` (8: the module docstring says why).
    """

    family = "qwen_image"
    transformer_class = "QwenImageTransformer2DModel"
    supported_tasks = ("t2i",)
    condition_keys = ("prompt_embeds", "prompt_embeds_mask")
    block_attrs = ("transformer_blocks",)
    # Image-stream and text-stream attention projections of every block; the
    # SGLang Qwen-Image DiT uses the same names, so adapters load there without renaming.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    default_max_sequence_length = 512
    extra_options = {"joint_tokens_multiple": 8}
    # SGLang's native serving of this family, read by trainer/engine/sglang/: the DiT class
    # whose name mapping says which parameters the server packs, and where SGLang's denoising
    # env keeps each condition (SGLang sends no mask when every text token is real)
    sglang_dit = "sglang.multimodal_gen.runtime.models.dits.qwen_image.QwenImageTransformer2DModel"
    sglang_conditions = {"prompt_embeds": ("pos_cond_kwargs", "encoder_hidden_states"),
                         "prompt_embeds_mask": ("pos_cond_kwargs", "encoder_hidden_states_mask")}
    sglang_implied_masks = {"prompt_embeds_mask": "prompt_embeds"}

    def __init__(self, model_path: str, **options: Any) -> None:
        super().__init__(model_path, **options)
        multiple = self.options["joint_tokens_multiple"]
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"{type(self).__name__}: joint_tokens_multiple must be an integer "
                             f">= 1 (1: no padding), got {multiple!r}")
        self.joint_tokens_multiple = multiple

    # ---- geometry (packing: PackedLatentsAdapter) ----------------------------------------
    display_name = "Qwen-Image"
    pipeline_class = staticmethod(_pipeline_cls)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.vae_config["temperal_downsample"])

    def scheduler_sigmas(self, num_inference_steps: int, geometry: Geometry) -> torch.Tensor:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        cfg = self.scheduler.config
        mu = calculate_shift(self.latent_shape(geometry)[0], cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        return self._scheduler_sigmas(num_inference_steps, sigmas=sigmas, mu=mu)

    # ---- engine side ----------------------------------------------------------------------
    def load_frozen(self, *, device: str | torch.device, dtype: torch.dtype) -> dict[str, Any]:
        from diffusers import AutoencoderKLQwenImage
        from transformers import Qwen2_5_VLForConditionalGeneration

        pipeline_cls = _pipeline_cls()
        vae = self._from_pretrained(AutoencoderKLQwenImage, "vae", dtype, device)
        text_encoder = self._from_pretrained(Qwen2_5_VLForConditionalGeneration, "text_encoder", dtype, device)
        tokenizer = self._load_tokenizer("tokenizer")
        self._check_tokenizers({"tokenizer": (tokenizer, text_encoder)})
        pipeline = pipeline_cls(scheduler=self.scheduler, vae=vae, text_encoder=text_encoder,
                                tokenizer=tokenizer, transformer=None)
        return {"pipeline": pipeline, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
                "device": torch.device(device), "dtype": dtype}

    @torch.no_grad()
    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = frozen["pipeline"].encode_prompt(
            prompt=list(prompts), device=frozen["device"], max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask; keep it batch-first for the sidecar
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def load_train_model(self, *, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> nn.Module:
        install_fast_paths()  # the faster text-length and rotary paths: qwen_fast_paths.py
        return super().load_train_model(dtype=dtype, device=device)

    def block_dynamic_dims(self, kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, int]]:
        """The text length: the prompt embeddings are padded to the longest prompt of the
        batch, so it changes with the prompts; the text embeddings, their mask and the text
        half of the rotary table carry it."""
        dims = [(kwargs[k], 1) for k in ("encoder_hidden_states", "encoder_hidden_states_mask")
                if isinstance(kwargs.get(k), torch.Tensor)]
        rope = kwargs.get("image_rotary_emb")
        if isinstance(rope, (tuple, list)) and len(rope) == 2 and isinstance(rope[1], torch.Tensor):
            dims.append((rope[1], 0))
        return dims

    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], geometry: Geometry) -> torch.Tensor:
        latents, cond, dtype = self._cast_inputs(transformer, latents, conditions)
        batch = latents.shape[0]
        sigma = torch.as_tensor(sigma, device=latents.device).reshape(-1).expand(batch)
        timestep = (sigma.to(torch.float32) * 1000).to(dtype) / 1000
        _, h, w = self.init_noise_shape(geometry)
        cond = self.pad_text(cond, image_tokens=latents.shape[1])
        return transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_mask=cond["prompt_embeds_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * batch,
            return_dict=False,
        )[0]

    def forward_flops(self, geometry: Geometry, *, batch: int, text_tokens: int):
        """As the base, at the padded text length ``velocity`` runs."""
        padded = self.padded_text_length(text_tokens, self.image_tokens(geometry))
        return super().forward_flops(geometry, batch=batch, text_tokens=padded)

    def padded_text_length(self, text_tokens: int, image_tokens: int) -> int:
        """The text length the transformer sees: image + text tokens rounded up to a multiple
        of ``joint_tokens_multiple``."""
        return text_tokens + (-(image_tokens + text_tokens) % self.joint_tokens_multiple)

    def pad_text(self, cond: dict[str, torch.Tensor], *, image_tokens: int) -> dict[str, torch.Tensor]:
        """``cond`` with masked text tokens appended up to ``padded_text_length`` (unchanged
        when it is already that long)."""
        embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
        pad = self.padded_text_length(embeds.shape[1], image_tokens) - embeds.shape[1]
        if pad == 0:
            return cond
        batch = embeds.shape[0]
        return {**cond,
                "prompt_embeds": torch.cat([embeds, embeds.new_zeros(batch, pad, embeds.shape[2])], 1),
                "prompt_embeds_mask": torch.cat([mask, mask.new_zeros(batch, pad)], 1)}

    @torch.no_grad()
    def decode(self, frozen: dict[str, Any], latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        pipeline, vae = frozen["pipeline"], frozen["vae"]
        # Inverse of the pipeline's per-channel latent normalisation, as QwenImagePipeline does it.
        z = pipeline._unpack_latents(latents, geometry.height, geometry.width,
                                     pipeline.vae_scale_factor).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        z = z / inv_std + mean
        if vae.use_tiling or z.shape[2] != 1:
            images = vae.decode(z, return_dict=False)[0][:, :, 0]
        else:
            # One frame: vae.decode's causal-conv cache only copies each activation for frames
            # that never come; without it the decoder computes the same values (tested equal).
            images = vae.decoder(vae.post_quant_conv(z), feat_cache=None).clamp(-1.0, 1.0)[:, :, 0]
        return images_to_uint8(pipeline.image_processor, images)

    def compile_frozen(self, frozen: dict[str, Any]) -> None:
        """The VAE decoder under torch.compile (one image frame, no cache: a static graph),
        its weights channels-last: cuDNN's convolution kernels work in that layout, and
        channels-first weights cost a layout conversion around every convolution."""
        vae = frozen["vae"]
        _channels_last(vae.post_quant_conv)
        _channels_last(vae.decoder)
        vae.decoder.forward = torch.compile(vae.decoder.forward)


def _channels_last(module: nn.Module) -> None:
    """Every convolution weight under ``module`` in the channels-last layout of its rank."""
    formats = {nn.Conv3d: torch.channels_last_3d, nn.Conv2d: torch.channels_last}
    for m in module.modules():
        for kind, memory_format in formats.items():
            if isinstance(m, kind):
                m.weight.data = m.weight.data.contiguous(memory_format=memory_format)

