"""Qwen-Image-Edit and Qwen-Image-Edit-Plus: Qwen-Image's transformer, VAE and Qwen2.5-VL text
encoder, conditioned on reference images (task ``edit``).

Everything model-specific is delegated to diffusers' QwenImageEditPipeline /
QwenImageEditPlusPipeline, built from the loaded parts without a transformer: the prompt
template with the picture(s) in it and its drop index (``encode_prompt``, which runs the
processor and the text encoder's vision tower), the VAE encoding of a reference with its
per-channel normalisation (``_encode_vae_image``; no generator: the latent distribution's
mode, so a reference always encodes to the same latents), the 2x2 packing, the
resolution-dependent shift (on the output's packed length, as the pipelines compute it) and
decoding. As in the pipelines, the references' packed latents are concatenated to the noisy
latents on the sequence axis, the transformer is told each one's grid (``img_shapes``), and
the prediction's first tokens (the output's) are the velocity.

Design choices:
- Where a reference is resized before the VAE is the option ``reference_area``. Unset (the
  default), a reference is resized to the output geometry: at a training resolution this keeps
  the joint sequence short, and every candidate's reference latents have one shape. Set to a
  pixel count, each reference is resized to about that many pixels at its own aspect ratio,
  each side a multiple of 32 (diffusers' ``calculate_dimensions``, the pipelines' own
  function): what diffusers' QwenImageEdit(Plus)Pipeline does at inference with 1024 * 1024,
  and what SGLang's native Edit pipelines do. A user who will serve the trained LoRA in
  diffusers' edit pipeline, or who rolls out through SGLang, wants the pipelines' area
  (1024 * 1024): the model then trains on the reference grid it will be served with.
- The text encoder sees, for Edit, the picture the VAE encodes (the Edit pipeline shows it
  the picture it encodes); for Plus, each reference at ``condition_image_area`` pixels at its
  own aspect ratio (the Plus pipeline's 384x384 by default), whatever ``reference_area``.
- The conditions are Qwen-Image's (``prompt_embeds``, ``prompt_embeds_mask``) plus
  ``image_latents`` [B, L, C * 4]: the K references' packed latents, in order. With
  ``reference_area`` set they also carry ``reference_grids`` [B, K, 2] (int64): each
  reference's packed latent grid (rows, columns), which the transformer is told in
  ``img_shapes``. The grid travels per sample in the conditions, not beside the batch, because
  references of different aspect ratios have different grids: a rollout's candidates (and a
  replay micro-batch) may mix them. ``image_latents`` is then right-padded with zeros to the
  longest candidate's, and ``velocity`` runs one transformer forward per distinct grid row,
  each on its own candidates' unpadded tokens. The rollout records the conditions; the replay
  feeds exactly those tensors back, so it never re-encodes.
- Each distinct (prompt, references) is encoded alone: Plus's template lists every picture of
  a call in every prompt, so a batched call would show each prompt the others' pictures. The
  engine already encodes a group's shared prompt and references once.
- Plus: every candidate of a request carries the same number of references; the data keeps a
  run to one count.
- The CFG negative is the empty prompt with the same references (as the pipelines encode
  their negative prompt with the image).
- SGLang 0.5.23 has native Edit and Edit-Plus pipelines that take the references by path
  (``RolloutRequest.image_path``) and size each one at its pipeline config's area (1024 * 1024)
  at its own aspect ratio; preflight probes that sizing in SGLang's own config code
  (``sglang_reference_sizing``; trainer/engine/sglang/sync.py) and allows
  ``rollout.engine = "sglang"`` only when ``reference_area`` sizes every probe the same way.
  SGLang's answer carries each reference's grid (``img_shapes``, read by
  ``grids_from_img_shapes``) but, stock, none of the references' VAE latents
  (``sglang_stock_refusal``), so these families roll out on SGLang with the trainer's
  extension only (trainer/engine/sglang/extension.py returns them).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from trainer.models.batch import pad_and_cat
from trainer.models.geometry import Geometry
from trainer.models.qwen_image import QwenImageAdapter

#: The edit pipelines round each side of a reference to a multiple of this many pixels.
REFERENCE_GRID_PIXELS = 32


def _edit_pipeline_cls():
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline


def _edit_plus_pipeline_cls():
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline


#: The area SGLang 0.5.23's Edit pipeline configs size a reference at (their hard-coded
#: 1024 * 1024), used where SGLang does not import to read it (trainer/engine/sglang/sync.py).
SGLANG_REFERENCE_AREA = 1024 * 1024
_SGLANG_CONFIGS = "sglang.multimodal_gen.configs.pipeline_configs.qwen_image."


def reference_dimensions(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of a ``width`` x ``height`` picture resized to about ``area`` pixels at
    its aspect ratio: diffusers' edit pipelines' ``calculate_dimensions``."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    new_width, new_height, _ = calculate_dimensions(area, width / height)
    return new_width, new_height


def grids_from_img_shapes(img_shapes: Any) -> torch.Tensor:
    """SGLang's ``img_shapes`` of one rollout output (``[[(1, h, w) of the output, (1, h, w) of
    each reference]]``, tuples as lists after msgpack) -> the references' packed grids [K, 2]
    (int64), what this adapter's ``reference_grids`` condition holds."""
    if (not isinstance(img_shapes, (list, tuple)) or len(img_shapes) != 1
            or not isinstance(img_shapes[0], (list, tuple)) or len(img_shapes[0]) < 2):
        raise ValueError(f"expected [[output grid, reference grids...]], got {img_shapes!r}")
    grids = []
    for entry in img_shapes[0][1:]:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3 or entry[0] != 1
                or not all(isinstance(v, int) and v > 0 for v in entry)):
            raise ValueError(f"a reference grid must be (1, rows, columns), got {entry!r}")
        grids.append([entry[1], entry[2]])
    return torch.tensor(grids, dtype=torch.long)


def _sglang_stock_refusal(pipeline: str) -> str:
    """Why stock SGLang 0.5.23's native ``pipeline`` cannot roll out for this adapter's replay."""
    return (f"stock SGLang 0.5.23's native {pipeline} returns the prompt embeddings and each "
            "reference's grid (img_shapes) but not the references' VAE latents that its denoising "
            "stage concatenates to the noisy latents (batch.image_latent: the denoising_env it "
            "returns holds only image_kwargs, pos_cond_kwargs, neg_cond_kwargs and guidance), so "
            "the trainer cannot replay what its DiT saw; the trainer's SGLang extension returns them")


class QwenImageEditAdapter(QwenImageAdapter):
    """Adapter of Qwen-Image-Edit (dotpath ``trainer.models.qwen_image_edit.QwenImageEditAdapter``):
    one reference image per candidate.

    Options: Qwen-Image's (``revision``, ``max_sequence_length``, ``joint_tokens_multiple``), and
    ``reference_area`` (None: each reference at the output geometry; an integer: each reference
    at about that many pixels at its own aspect ratio, as the edit pipelines size it with
    1024 * 1024; the module docstring says when to want which).
    """

    family = "qwen_image_edit"
    supported_tasks = ("edit",)
    condition_keys = ("prompt_embeds", "prompt_embeds_mask", "image_latents")
    max_condition_images = 1
    display_name = "Qwen-Image-Edit"
    pipeline_class = staticmethod(_edit_pipeline_cls)
    # SGLang's native serving (its QwenImageEditPipeline, Qwen-Image's DiT), read by
    # trainer/engine/sglang/: the references' latents come back only through the trainer's
    # extension, their grids in SGLang's own img_shapes (module docstring)
    sglang_dit = QwenImageAdapter.sglang_dit
    sglang_conditions = {**QwenImageAdapter.sglang_conditions,
                         "image_latents": ("pos_cond_kwargs", "flowgrpo_image_latent"),
                         "reference_grids": ("pos_cond_kwargs", "img_shapes")}
    sglang_implied_masks = QwenImageAdapter.sglang_implied_masks
    sglang_readers = {"reference_grids": grids_from_img_shapes}  # not a tensor on the wire
    sglang_stock_refusal = _sglang_stock_refusal("QwenImageEditPipeline")
    # where SGLang sizes a reference for the VAE: (pipeline config class, its method taking
    # (image, width, height) and answering (width, height)); preflight probes it
    sglang_reference_sizing = (_SGLANG_CONFIGS + "QwenImageEditPipelineConfig",
                               "calculate_condition_image_size")
    extra_options = {**QwenImageAdapter.extra_options, "reference_area": None}

    def __init__(self, model_path: str, **options: Any) -> None:
        super().__init__(model_path, **options)
        area = self.options["reference_area"]
        if area is not None and (isinstance(area, bool) or not isinstance(area, int)
                                 or area < REFERENCE_GRID_PIXELS ** 2):
            raise ValueError(f"{type(self).__name__}: reference_area must be None (references at "
                             f"the output geometry) or an integer of at least "
                             f"{REFERENCE_GRID_PIXELS ** 2} pixels, got {area!r}")
        self.reference_area = area
        if area is not None:  # the grids travel with the conditions (module docstring)
            self.condition_keys = (*type(self).condition_keys, "reference_grids")

    # ---- engine side ----------------------------------------------------------------------
    def load_frozen(self, *, device: str | torch.device, dtype: torch.dtype) -> dict[str, Any]:
        from diffusers import AutoencoderKLQwenImage
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLProcessor

        vae = self._from_pretrained(AutoencoderKLQwenImage, "vae", dtype, device)
        text_encoder = self._from_pretrained(Qwen2_5_VLForConditionalGeneration, "text_encoder", dtype, device)
        tokenizer = self._load_tokenizer("tokenizer")
        processor = Qwen2VLProcessor.from_pretrained(self.model_path, subfolder="processor",
                                                     revision=self.revision)
        self._check_tokenizers({"tokenizer": (tokenizer, text_encoder),
                                "processor": (processor.tokenizer, text_encoder)})
        pipeline = self.pipeline_class()(scheduler=self.scheduler, vae=vae, text_encoder=text_encoder,
                                          tokenizer=tokenizer, processor=processor, transformer=None)
        return {"pipeline": pipeline, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
                "processor": processor, "device": torch.device(device), "dtype": dtype}

    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        raise ValueError(f"{type(self).__name__} edits reference images: its conditions come from "
                         "encode_conditions(frozen, prompts, images, geometry)")

    @torch.no_grad()
    def encode_conditions(self, frozen: dict[str, Any], prompts: list[str],
                          images: Sequence[Sequence[Any]] | None,
                          geometry: Geometry) -> dict[str, torch.Tensor]:
        self.require_condition_images(images)
        rows = [self._encode_one(frozen, prompt, refs, geometry) for prompt, refs in zip(prompts, images)]
        # text lengths differ between prompts: right-padded, the padding masked (mask 0)
        out = {"prompt_embeds": pad_and_cat([r[0] for r in rows]),
               "prompt_embeds_mask": pad_and_cat([r[1] for r in rows])}
        if self.reference_area is None:  # every reference at the output geometry: one length
            return {**out, "image_latents": torch.cat([r[2] for r in rows])}
        # references of other aspect ratios have other lengths: zero-padded, the grids say how
        # many tokens of each row are real
        return {**out, "image_latents": pad_and_cat([r[2] for r in rows]),
                "reference_grids": torch.cat([r[3] for r in rows])}

    def _encode_one(self, frozen: dict[str, Any], prompt: str, refs: Sequence[Any],
                    geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One candidate: (prompt embeddings [1, T, D], their mask [1, T], packed reference
        latents [1, L, C * 4], each reference's packed grid [1, K, 2])."""
        pipeline, device = frozen["pipeline"], frozen["device"]
        pictures = [ref.open() for ref in refs]  # PIL RGB; a bad image raises naming it
        sizes = [self.reference_size(picture, geometry, ref) for picture, ref in zip(pictures, refs)]
        resized = [pipeline.image_processor.resize(p, h, w) for p, (h, w) in zip(pictures, sizes)]
        embeds, mask = pipeline.encode_prompt(prompt=[prompt], image=self.prompt_images(pipeline, pictures, resized),
                                              device=device)
        if mask is None:  # the pipeline drops an all-ones mask; keep it batch-first for the sidecar
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        latents = [self._reference_latents(frozen, picture, h, w) for picture, (h, w) in zip(resized, sizes)]
        grids = torch.tensor([[z.shape[3] // 2, z.shape[4] // 2] for _, z in latents],
                             dtype=torch.long, device=embeds.device)
        return embeds, mask, torch.cat([packed for packed, _ in latents], dim=1), grids[None]

    def reference_size(self, picture: Any, geometry: Geometry, ref: Any = None) -> tuple[int, int]:
        """(height, width) a reference is resized to before the VAE: the output geometry, or
        ``reference_area`` pixels at the picture's aspect ratio with diffusers' edit pipelines'
        ``calculate_dimensions`` (each side rounded to a multiple of 32)."""
        if self.reference_area is None:
            return geometry.height, geometry.width
        width, height = reference_dimensions(self.reference_area, picture.width, picture.height)
        if width < REFERENCE_GRID_PIXELS or height < REFERENCE_GRID_PIXELS:
            raise ValueError(f"reference {ref if ref is not None else picture!r} ({picture.width}x"
                             f"{picture.height}) rounds to {width}x{height} pixels at reference_area="
                             f"{self.reference_area}: its aspect ratio is too extreme for that area")
        return height, width

    def prompt_images(self, pipeline: Any, pictures: list, resized: list) -> Any:
        """What the text encoder sees: Edit's one reference, as resized for the VAE."""
        return resized[0]

    def _reference_latents(self, frozen: dict[str, Any], picture: Any, height: int,
                           width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One reference at ``height`` x ``width`` -> (its normalised, packed VAE latents
        [1, L, C * 4], the unpacked latents [1, C, 1, h, w])."""
        pipeline, vae = frozen["pipeline"], frozen["vae"]
        pixels = pipeline.image_processor.preprocess(picture, height, width)
        pixels = pixels.unsqueeze(2).to(device=frozen["device"], dtype=vae.dtype)  # one frame
        z = pipeline._encode_vae_image(image=pixels, generator=None)  # [1, C, 1, h, w]
        return pipeline._pack_latents(z, 1, z.shape[1], z.shape[3], z.shape[4]).to(torch.float32), z

    # ---- the forward ------------------------------------------------------------------------
    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], geometry: Geometry) -> torch.Tensor:
        latents, cond, dtype = self._cast_inputs(transformer, latents, conditions)
        batch, tokens = latents.shape[:2]
        sigma = torch.as_tensor(sigma, device=latents.device).reshape(-1).expand(batch)
        timestep = (sigma.to(torch.float32) * 1000).to(dtype) / 1000
        _, h, w = self.init_noise_shape(geometry)
        output_grid = (h // 2, w // 2)
        grids = cond.get("reference_grids")
        if grids is None:  # every reference at the output geometry
            count = cond["image_latents"].shape[1] // tokens
            return self._joint_forward(transformer, latents, timestep, cond,
                                       [output_grid] * (1 + count))
        # one forward per distinct row of grids (module docstring); .tolist() is a host sync
        # of a few integers per forward
        groups: dict[tuple, list[int]] = {}
        for row, grid in enumerate(grids.tolist()):
            groups.setdefault(tuple(map(tuple, grid)), []).append(row)
        if len(groups) == 1:
            return self._joint_forward(transformer, latents, timestep, cond,
                                       [output_grid, *next(iter(groups))])
        parts, order = [], []
        for grid, rows in groups.items():
            shapes = [output_grid, *grid]
            index = torch.tensor(rows, device=latents.device)
            part = {k: v.index_select(0, index) for k, v in cond.items()}
            parts.append(self._joint_forward(transformer, latents.index_select(0, index),
                                             timestep.index_select(0, index), part, shapes))
            order += rows
        inverse = torch.empty(batch, dtype=torch.long, device=latents.device)
        inverse[torch.tensor(order, device=latents.device)] = torch.arange(batch, device=latents.device)
        return torch.cat(parts).index_select(0, inverse)

    def _joint_forward(self, transformer: nn.Module, latents: torch.Tensor, timestep: torch.Tensor,
                       cond: dict[str, torch.Tensor], shapes: list[tuple[int, int]]) -> torch.Tensor:
        """The transformer on [x_t; references] for candidates that share ``shapes`` (the
        output's packed grid, then each reference's): the output's tokens of its prediction."""
        batch, tokens = latents.shape[:2]
        reference_tokens = sum(rows * cols for rows, cols in shapes[1:])
        hidden = torch.cat([latents, cond["image_latents"][:, :reference_tokens]], dim=1)
        cond = self.pad_text(cond, image_tokens=hidden.shape[1])
        out = transformer(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            encoder_hidden_states_mask=cond["prompt_embeds_mask"],
            img_shapes=[[(1, rows, cols) for rows, cols in shapes]] * batch,
            return_dict=False,
        )[0]
        return out[:, :tokens]

    def reference_tokens(self, geometry: Geometry) -> int:
        """Tokens of one reference: the output's, or with ``reference_area`` that area over a
        token's pixels (before the 32-pixel rounding, which moves it by a few percent)."""
        if self.reference_area is None:
            return super().image_tokens(geometry)
        side = 2 * self.vae_scale_factor  # pixels per packed token, each way
        return self.reference_area // (side * side)

    def image_tokens(self, geometry: Geometry) -> int:
        """The output's tokens and one reference's."""
        return super().image_tokens(geometry) + self.reference_tokens(geometry)


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Adapter of Qwen-Image-Edit-Plus (``trainer.models.qwen_image_edit.QwenImageEditPlusAdapter``):
    up to three reference images per candidate, the same number for every candidate of a
    request, in the order the prompt refers to them ("Picture 1", "Picture 2", ...).

    Options: Qwen-Image's, and ``condition_image_area`` (384 * 384: pixels of each picture the
    text encoder sees, at the picture's aspect ratio, as the Plus pipeline's default).
    """

    family = "qwen_image_edit_plus"
    max_condition_images = 3
    display_name = "Qwen-Image-Edit-Plus"
    pipeline_class = staticmethod(_edit_plus_pipeline_cls)
    extra_options = {**QwenImageEditAdapter.extra_options, "condition_image_area": 384 * 384}
    sglang_stock_refusal = _sglang_stock_refusal("QwenImageEditPlusPipeline")
    sglang_reference_sizing = (_SGLANG_CONFIGS + "QwenImageEditPlusPipelineConfig",
                               "calculate_vae_image_size")

    def __init__(self, model_path: str, **options: Any) -> None:
        super().__init__(model_path, **options)
        area = self.options["condition_image_area"]
        if isinstance(area, bool) or not isinstance(area, int) or area < 28 * 28:
            raise ValueError(f"{type(self).__name__}: condition_image_area must be an integer of "
                             f"at least {28 * 28} pixels, got {area!r}")
        self.condition_image_area = area

    def condition_image_problems(self, images: Sequence[Sequence[Any]] | None) -> list[str]:
        problems = super().condition_image_problems(images)
        counts = sorted({len(refs) for refs in images or ()})
        if len(counts) > 1:
            problems.append(f"{self.family!r} takes the same number of reference images for every "
                            f"candidate of a request, got counts {counts}")
        return problems

    def prompt_images(self, pipeline: Any, pictures: list, resized: list) -> Any:
        """Every reference at ``condition_image_area`` pixels, its aspect ratio kept (the Plus
        pipeline's ``calculate_dimensions``)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        shown = []
        for picture in pictures:
            width, height = calculate_dimensions(self.condition_image_area, picture.width / picture.height)
            shown.append(pipeline.image_processor.resize(picture, height, width))
        return shown

    def forward_flops(self, geometry: Geometry, *, batch: int, text_tokens: int):
        """None: the joint sequence grows with the references, whose number the geometry does
        not say (the MFU of a Plus run is not logged)."""
        return None
