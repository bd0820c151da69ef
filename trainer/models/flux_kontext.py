"""FLUX.1 Kontext: FLUX.1's transformer, VAE and CLIP + T5 encoders, conditioned on one
reference image (task ``edit``).

Everything FLUX.1 does is inherited from the text-to-image adapter (trainer/models/flux.py):
the prompt encoding (text only: Kontext's prompt never sees the picture), the packing, the
mu-shifted schedule on the output's packed length and the embedded guidance. What editing adds
is delegated to diffusers' FluxKontextPipeline, built from the loaded parts without a
transformer: the reference's VAE encoding with FLUX's shift and scale (``_encode_vae_image``;
no generator: the latent distribution's mode, so a reference always encodes to the same
latents), its 2x2 packing, and its position ids, the output's grid with the first id axis set
to 1. As in the pipeline, the reference's packed latents follow the noisy latents on the
sequence axis, the ids follow theirs, and the prediction's first tokens are the velocity.

Design choices:
- The reference is resized to the output geometry before the VAE (the pipeline resizes it to
  the preferred Kontext resolution nearest its aspect ratio): at a training resolution this
  keeps the joint sequence short, and every candidate's reference latents have one shape, so
  the conditions of a rollout stay one tensor. The pipeline accepts a reference of any size at
  inference, so an export is used as diffusers' own Kontext pipeline uses it.
- The conditions are FLUX.1's (``prompt_embeds``, ``pooled_prompt_embeds``) plus
  ``image_latents`` [B, L, C * 4]; the rollout records them and the replay feeds exactly those
  tensors back, so it never re-encodes.
- Guidance: FLUX.1 Kontext [dev] is guidance-distilled like FLUX.1-dev: ``embedded_guidance``
  (3.5, also the Kontext pipeline's default) on every forward, no CFG.
- SGLang 0.5.23 has no native Kontext pipeline (its multimodal_gen package serves FLUX.1
  text-to-image only; its ComfyUI FLUX executor refuses Kontext reference latents), so this
  family names no SGLang DiT and preflight refuses ``rollout.engine = "sglang"`` for it
  (trainer/engine/sglang/sync.py); the embedded engine rolls it out.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from trainer.models.flux import FluxAdapter
from trainer.models.geometry import Geometry


def _kontext_pipeline_cls():
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline


class FluxKontextAdapter(FluxAdapter):
    """Adapter of FLUX.1 Kontext (dotpath ``trainer.models.flux_kontext.FluxKontextAdapter``):
    one reference image per candidate.

    Options: FLUX.1's (``revision``, ``max_sequence_length``, ``embedded_guidance``).
    """

    family = "flux_kontext"
    supported_tasks = ("edit",)
    condition_keys = ("prompt_embeds", "pooled_prompt_embeds", "image_latents")
    max_condition_images = 1
    display_name = "FLUX.1 Kontext"
    pipeline_class = staticmethod(_kontext_pipeline_cls)
    # no native SGLang serving (module docstring): preflight refuses the sglang engine with
    # ``sglang_refusal`` (trainer/engine/sglang/sync.py)
    sglang_dit = None
    sglang_conditions = None
    sglang_implied_masks = None
    sglang_refusal = ("SGLang 0.5.23 has no native FLUX.1 Kontext pipeline (its multimodal_gen "
                      "package serves FLUX.1 text-to-image only; its ComfyUI FLUX executor "
                      "refuses Kontext reference latents), so no SGLang server rolls this "
                      "family out")

    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        raise ValueError(f"{type(self).__name__} edits reference images: its conditions come from "
                         "encode_conditions(frozen, prompts, images, geometry)")

    @torch.no_grad()
    def encode_conditions(self, frozen: dict[str, Any], prompts: list[str],
                          images: Sequence[Sequence[Any]] | None,
                          geometry: Geometry) -> dict[str, torch.Tensor]:
        self.require_condition_images(images)
        cond = super().encode_prompts(frozen, list(prompts))
        cond["image_latents"] = torch.cat([self.reference_latents(frozen, refs[0], geometry)
                                           for refs in images])
        return cond

    def reference_latents(self, frozen: dict[str, Any], ref: Any, geometry: Geometry) -> torch.Tensor:
        """One reference, resized to the output geometry -> its shifted, scaled and packed VAE
        latents [1, L, C * 4], as FluxKontextPipeline.prepare_latents computes them."""
        pipeline, vae = frozen["pipeline"], frozen["vae"]
        picture = ref.open()  # PIL RGB; a bad image raises naming it
        resized = pipeline.image_processor.resize(picture, geometry.height, geometry.width)
        pixels = pipeline.image_processor.preprocess(resized, geometry.height, geometry.width)
        z = pipeline._encode_vae_image(image=pixels.to(device=frozen["device"], dtype=vae.dtype),
                                       generator=None)
        return pipeline._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3]).to(torch.float32)

    def image_stream(self, latents: torch.Tensor, cond: dict[str, torch.Tensor],
                     geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """[x_t; reference] and [output ids; reference ids]: the reference at the output's grid,
        its ids' first axis 1 (the pipeline's marker of a context image)."""
        latents, ids = super().image_stream(latents, cond, geometry)
        reference_ids = ids.clone()
        reference_ids[..., 0] = 1
        return torch.cat([latents, cond["image_latents"]], dim=1), torch.cat([ids, reference_ids], dim=0)

    def image_tokens(self, geometry: Geometry) -> int:
        """The output's tokens and the reference's (one, at the output geometry)."""
        return 2 * super().image_tokens(geometry)
