"""Wan 2.1 / 2.2 image-to-video (task ``i2v``): Wan's transformer, VAE and UMT5 text encoder,
conditioned on a first frame (the prompt record's one image), and for Wan 2.1 on that frame's
CLIP image embeddings.

Everything text-to-video does is inherited from ``trainer.models.wan.WanAdapter`` (the
schedule, the latent geometry, the prompt encoding, Wan 2.2's two experts, decoding). What the
first frame adds is delegated to diffusers' WanImageToVideoPipeline, built from the loaded parts
without a transformer: ``encode_image`` (the CLIP processor and the vision tower's
second-to-last hidden states, on the picture as given) and ``prepare_latents``' condition (the
picture resized to the output geometry by the pipeline's video processor, followed by
frames - 1 black frames, VAE-encoded to its latent distribution's mode and normalised, behind
a mask that is 1 on the first frame's latent positions and 0 elsewhere). As in the pipeline,
the transformer takes [x_t; mask; condition latents] on the channel axis, so the latents it
predicts have the VAE's channels while its input has 2 x those + the VAE's temporal factor
(16 + 4 + 16 = 36 published); Wan 2.1's transformer also attends to the image embeddings
(``image_dim`` set), Wan 2.2 A14B's (no image encoder) does not.

Design choices:
- The conditions are ``prompt_embeds``, ``condition_latents`` [B, T + C, F', h, w] (mask and
  latents as the pipeline concatenates them) and, for Wan 2.1, ``image_embeds`` [B, 257, 1280]
  (CLIP ViT-H/14's tokens). The rollout records them; the replay feeds exactly those tensors
  back, so nothing is re-encoded.
- The first frame is resized to the output geometry as the pipeline does (no crop: its aspect
  ratio is the data's business); the CLIP tower sees the picture as given (its processor
  resizes and crops to 224).
- Wan 2.1 I2V needs the 512-token text window: diffusers' Wan attention finds the image tokens
  in the cross-attention context as everything before its last 512 tokens
  (``WanAttnProcessor``), so ``max_sequence_length`` other than 512 is refused.
- The CFG negative is the empty prompt with the same first frame (the pipeline's negative
  shares the image embeddings and the condition).
- Each distinct first frame of a call is encoded alone (CLIP and VAE), so a candidate's
  conditions do not depend on what else is in the batch; the engine already encodes a group's
  shared prompt and frame once. The CFG negative takes the first frame's conditions from the
  positive (``negative_conditions``): the CLIP tower and the VAE see the frame alone, so only
  the empty prompt is encoded again.
- LoRA targets: text-to-video's, plus the image cross-attention's key and value projections
  (``add_k_proj`` / ``add_v_proj``, diffusers' names for Wan's ``k_img`` / ``v_img``) where the
  model has them (Wan 2.1).
- SGLang 0.5.23 ships a native Wan image-to-video pipeline that takes the first frame by path
  (``RolloutRequest.image_path``; our client writes it to a file per call), but its stock
  rollout answer leaves out the first frame's condition latents the replay needs
  (``sglang_stock_refusal`` says what): preflight refuses stock SGLang with that reason, and
  the trainer's SGLang extension returns them (trainer/engine/sglang/extension.py).
- The MFU of Wan 2.1 I2V is not logged: the FLOP count (``trainer.compute.flops``) does not
  count the image cross-attention.
"""
from __future__ import annotations

from functools import cached_property
from typing import Any, Sequence

import torch
from torch import nn

from trainer.models.geometry import Geometry
from trainer.models.wan import WanAdapter

#: The text window diffusers' Wan attention assumes when it splits image from text tokens.
WAN_I2V_TEXT_TOKENS = 512
#: LoRA targets of the image cross-attention (Wan 2.1 I2V only).
IMAGE_ATTENTION_TARGETS = ("add_k_proj", "add_v_proj")


class WanI2VAdapter(WanAdapter):
    """Adapter of Wan image-to-video (dotpath ``trainer.models.wan_i2v.WanI2VAdapter``): Wan 2.1
    I2V (14B, 480P / 720P; CLIP image embeddings) and Wan 2.2 I2V-A14B (two experts, as
    text-to-video's); one first frame per candidate (Wan 2.1 FLF2V, first and last frame, is
    refused).

    Options: Wan's (``revision``, ``max_sequence_length``: 512, which Wan 2.1 I2V requires).
    """

    family = "wan_i2v"
    supported_tasks = ("i2v",)
    condition_keys = ("prompt_embeds", "image_embeds", "condition_latents")
    max_condition_images = 1
    lora_targets = WanAdapter.lora_targets + IMAGE_ATTENTION_TARGETS
    # SGLang's native serving (its WanImageToVideoPipeline, the Wan DiT), read by
    # trainer/engine/sglang/: the first frame's condition latents come back only through the
    # trainer's extension (module docstring), so stock SGLang is refused with the reason
    sglang_dit = WanAdapter.sglang_dit
    sglang_conditions = {"prompt_embeds": ("pos_cond_kwargs", "encoder_hidden_states"),
                         "image_embeds": ("image_kwargs", "encoder_hidden_states_image"),
                         "condition_latents": ("pos_cond_kwargs", "flowgrpo_image_latent")}
    sglang_optional_conditions = ("image_embeds",)  # Wan 2.2 I2V has no CLIP image encoder
    sglang_stock_refusal = ("stock SGLang 0.5.23's WanImageToVideoPipeline returns the first "
                            "frame's CLIP embeddings but not its condition latents (its VAE "
                            "latents with the frame mask) that its denoising stage concatenates "
                            "to the noisy latents (batch.image_latent: the denoising_env it "
                            "returns holds only image_kwargs, pos_cond_kwargs, neg_cond_kwargs "
                            "and guidance), so the trainer cannot replay what its DiT saw; the "
                            "trainer's SGLang extension returns them")

    def __init__(self, model_path: str, **options: Any) -> None:
        super().__init__(model_path, **options)
        problems = self.model_problems()
        if problems:
            raise ValueError(f"{type(self).__name__} at {model_path}: " + "; ".join(problems))
        if not self.image_conditioned:  # Wan 2.2: no image embeddings to record
            self.condition_keys = ("prompt_embeds", "condition_latents")

    # ---- configs --------------------------------------------------------------------------
    @property
    def image_conditioned(self) -> bool:
        """Whether the transformer attends to CLIP image embeddings (Wan 2.1 I2V), as the
        pipeline decides it (``transformer.config.image_dim``)."""
        return self.transformer_config.get("image_dim") is not None

    @cached_property
    def latent_channels(self) -> int:
        """The VAE's latent channels: what x_t and the velocity have (``z_dim``)."""
        return int(self.vae_config["z_dim"])

    def model_problems(self) -> list[str]:
        """Why the model directory is not a Wan image-to-video model this adapter serves."""
        temporal, _ = self.vae_scale_factors
        want = 2 * self.latent_channels + temporal
        got = int(self.transformer_config["in_channels"])
        problems = []
        if got != want:
            problems.append(f"the transformer takes {got} input channels, not the {want} of image-to-"
                            f"video (latents {self.latent_channels} + mask {temporal} + first-frame "
                            f"latents {self.latent_channels}): a text-to-video model is "
                            "trainer.models.wan.WanAdapter's")
        if self.transformer_config.get("pos_embed_seq_len") is not None:
            problems.append("a first-and-last-frame model (pos_embed_seq_len: its image embedder takes "
                            "two frames' CLIP tokens) is not supported; one first frame per candidate is")
        if self.image_conditioned and self.max_sequence_length != WAN_I2V_TEXT_TOKENS:
            problems.append(f"max_sequence_length must be {WAN_I2V_TEXT_TOKENS} for Wan 2.1 I2V "
                            f"(diffusers' Wan attention takes all but the last {WAN_I2V_TEXT_TOKENS} "
                            f"context tokens as the image's), got {self.max_sequence_length}")
        return problems

    def lora_target_modules(self) -> list[str]:
        """Text-to-video's targets, and the image cross-attention's where the model has one."""
        if self.image_conditioned:
            return list(self.lora_targets)
        return [t for t in self.lora_targets if t not in IMAGE_ATTENTION_TARGETS]

    # ---- geometry -------------------------------------------------------------------------
    def latent_shape(self, geometry: Geometry) -> tuple[int, int, int, int]:
        """[C, F', h, w] with C the VAE's channels (the transformer's input has more: the
        module docstring)."""
        _, frames, h, w = super().latent_shape(geometry)
        return self.latent_channels, frames, h, w

    def condition_image_problems(self, images: Sequence[Sequence[Any]] | None) -> list[str]:
        if images is None:
            return [f"{self.family!r} animates a first frame: every candidate needs one image"]
        return [f"candidate {row} has {len(refs)} images; {self.family!r} takes exactly one, "
                "the first frame" for row, refs in enumerate(images) if len(refs) != 1]

    def forward_flops(self, geometry: Geometry, *, batch: int, text_tokens: int):
        """None for Wan 2.1 I2V (the image cross-attention is not counted: its MFU is not
        logged); Wan 2.2 I2V's count is text-to-video's at its input channels."""
        if self.image_conditioned:
            return None
        return super().forward_flops(geometry, batch=batch, text_tokens=text_tokens)

    # ---- engine side ----------------------------------------------------------------------
    def load_frozen(self, *, device: str | torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """Text-to-video's parts (UMT5, the fp32 VAE, Wan 2.2's low-noise expert), Wan 2.1's
        CLIP vision tower in fp32 (as the pipeline's published example loads it) and its
        processor, and a WanImageToVideoPipeline over them."""
        from diffusers import WanImageToVideoPipeline

        frozen = super().load_frozen(device=device, dtype=dtype)
        image_encoder = image_processor = None
        if self.image_conditioned:
            from transformers import CLIPImageProcessor, CLIPVisionModel

            missing = [part for part in ("image_encoder", "image_processor")
                       if (self.pipeline_config.get(part) or [None])[0] is None]
            if missing:
                raise ValueError(f"{type(self).__name__} at {self.model_path}: the transformer takes "
                                 f"CLIP image embeddings (image_dim) but model_index.json names no {missing}")
            image_encoder = self._from_pretrained(CLIPVisionModel, "image_encoder", torch.float32, device)
            image_processor = CLIPImageProcessor.from_pretrained(self.model_path, subfolder="image_processor",
                                                                 revision=self.revision)
        frozen["pipeline"] = WanImageToVideoPipeline(
            tokenizer=frozen["tokenizer"], text_encoder=frozen["text_encoder"], vae=frozen["vae"],
            scheduler=self.scheduler, image_processor=image_processor, image_encoder=image_encoder,
            transformer=None, transformer_2=None)
        frozen.update(image_encoder=image_encoder, image_processor=image_processor)
        return frozen

    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        raise ValueError(f"{type(self).__name__} animates a first frame: its conditions come from "
                         "encode_conditions(frozen, prompts, images, geometry)")

    @torch.no_grad()
    def encode_conditions(self, frozen: dict[str, Any], prompts: list[str],
                          images: Sequence[Sequence[Any]] | None,
                          geometry: Geometry) -> dict[str, torch.Tensor]:
        self.require_condition_images(images)
        cond = super().encode_prompts(frozen, list(prompts))
        frames = [refs[0] for refs in images]
        encoded = {ref: self.first_frame_conditions(frozen, ref, geometry) for ref in dict.fromkeys(frames)}
        for key in encoded[frames[0]]:
            cond[key] = torch.cat([encoded[ref][key] for ref in frames])
        return cond

    @torch.no_grad()
    def negative_conditions(self, frozen: dict[str, Any], positive: dict[str, torch.Tensor],
                            geometry: Geometry) -> dict[str, torch.Tensor]:
        """The empty prompt, with the positive's first-frame conditions (the pipeline's negative
        shares its condition latents and image embeddings)."""
        rows = positive["prompt_embeds"].shape[0]
        empty = super().encode_prompts(frozen, [""])
        out = {key: value.repeat(rows, *[1] * (value.dim() - 1)) for key, value in empty.items()}
        return {**out, **{key: positive[key] for key in positive if key not in out}}

    def first_frame_conditions(self, frozen: dict[str, Any], ref: Any,
                               geometry: Geometry) -> dict[str, torch.Tensor]:
        """One first frame -> ``condition_latents`` [1, T + C, F', h, w] fp32 and, for Wan 2.1,
        ``image_embeds`` [1, tokens, width] fp32, as WanImageToVideoPipeline computes them."""
        pipeline, device = frozen["pipeline"], frozen["device"]
        picture = ref.open()  # PIL RGB; a bad image raises naming it
        pixels = pipeline.video_processor.preprocess(picture, height=geometry.height, width=geometry.width)
        # x_T is ours (trainer.models.noise): zeros stand in so prepare_latents draws nothing
        placeholder = torch.zeros((1, *self.latent_shape(geometry)), device=device)
        _, condition = pipeline.prepare_latents(
            pixels.to(device, dtype=torch.float32), 1, self.latent_channels, geometry.height,
            geometry.width, geometry.frames, torch.float32, device, None, placeholder)
        out = {"condition_latents": condition.to(torch.float32)}
        if self.image_conditioned:
            out["image_embeds"] = pipeline.encode_image(picture, device).to(torch.float32)
        return out

    # ---- the forward ------------------------------------------------------------------------
    def _forward(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """One expert on [x_t; mask; condition latents], with the image embeddings where the
        conditions carry them (Wan 2.1), as the pipeline's loop calls it."""
        timestep = sigma.to(torch.float32) * float(self.scheduler.config.num_train_timesteps)
        return transformer(hidden_states=torch.cat([latents, cond["condition_latents"]], dim=1),
                           timestep=timestep, encoder_hidden_states=cond["prompt_embeds"],
                           encoder_hidden_states_image=cond.get("image_embeds"), return_dict=False)[0]
