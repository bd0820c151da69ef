"""The model-adapter contract: everything model-specific that the engine and the actor need.

One adapter class per model family, chosen by dotpath (``--model-adapter-path``). The engine
(rollout side) and the actor (training side) only ever talk to a model through this class, so
adding a family means adding one adapter, never touching the loop.

Every size-dependent method takes one ``Geometry`` (height, width, frames:
``trainer.models.geometry``). Conditioning media (reference images) reach the family through
``encode_conditions``; what it returns is recorded with the rollout and handed back to
``velocity`` unchanged by the replay (trainer/models/README.md draws the whole path).

Invariant the whole trainer rests on: ``velocity()`` is the single transformer forward used
both by the engine's sampler and by the actor's replay, and both then call the same
``kernels`` function, so the first on-policy update sees ratio == 1 exactly.
"""
from __future__ import annotations

import abc
import math
from typing import Any, ClassVar, Iterable, Mapping, Sequence

import torch
from torch import nn

from trainer.models import noise, wire
from trainer.models.geometry import Geometry
from trainer.models.batch import RolloutBatch  # noqa: F401  (its home; re-exported for importers)
from trainer.tasks import GENERATION_TASKS  # noqa: E402,F401  (torch-free home, re-exported)


class GenerativeModelAdapter(abc.ABC):
    """Base class of every model family's adapter.

    Subclasses set ``family`` and ``supported_tasks`` and implement the abstract methods.
    Constructor: ``Adapter(model_path, **options)`` where model_path is a diffusers-layout
    directory (``transformer/``, ``vae/``, ``text_encoder*/``, ``tokenizer*/``, ``scheduler/``).
    """

    family: ClassVar[str] = "base"
    supported_tasks: ClassVar[tuple[str, ...]] = ("t2i",)
    #: Keys of ``encode_conditions``' output that ``velocity`` needs (checked in every response).
    condition_keys: ClassVar[tuple[str, ...]] = ()
    #: Reference images one candidate may carry: 0 for a family without conditioning media
    #: (text-to-image), 1 for a single-source edit, more for a multi-reference family.
    max_condition_images: ClassVar[int] = 0

    def __init__(self, model_path: str, **options: Any) -> None:
        self.model_path = model_path
        self.options = dict(options)

    # ---- actor side -------------------------------------------------------------------
    @abc.abstractmethod
    def load_train_model(self, *, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> nn.Module:
        """The trainable transformer only (the VAE and text encoders stay in the engine)."""

    @abc.abstractmethod
    def transformer_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks: the unit of fully_shard and of activation checkpointing."""

    @abc.abstractmethod
    def lora_target_modules(self) -> list[str]:
        """peft target module names for LoRA on this family's transformer."""

    def block_dynamic_dims(self, kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, int]]:
        """(tensor, dim) pairs among a repeated block's keyword inputs whose size changes
        between calls at one geometry (a text length that follows the prompts). Compiled
        blocks mark them dynamic from the first call, so a new length compiles nothing."""
        return []

    def weight_name_map(self, train_names: Iterable[str]) -> dict[str, str]:
        """Trainer parameter name -> engine parameter name (identity unless overridden).

        Names reach this method already stripped of activation-checkpoint and FSDP wrappers.
        """
        return {n: n for n in train_names}

    # ---- engine side ------------------------------------------------------------------
    @abc.abstractmethod
    def load_frozen(self, *, device: str | torch.device, dtype: torch.dtype) -> dict[str, Any]:
        """Frozen pipeline parts for the engine: VAE, text encoder(s), tokenizer(s)."""

    @abc.abstractmethod
    def encode_prompts(self, frozen: dict[str, Any], prompts: list[str]) -> dict[str, torch.Tensor]:
        """Batch-first frozen conditions for ``velocity`` (embeddings, pooled, masks)."""

    def encode_conditions(self, frozen: dict[str, Any], prompts: list[str],
                          images: Sequence[Sequence[Any]] | None,
                          geometry: Geometry) -> dict[str, torch.Tensor]:
        """Batch-first frozen conditions of B candidates: their prompts and, per candidate, its
        reference images (``trainer.media.ImageRef``; None or all empty: none), encoded for
        the output ``geometry``. What it returns is all ``velocity`` gets, image latents
        included, and what the rollout records for the replay.

        Default: the prompts alone (``encode_prompts``); a family with conditioning media
        (``max_condition_images`` > 0) overrides this."""
        if images is not None and any(len(refs) for refs in images):
            raise ValueError(f"{type(self).__name__} ({self.family!r}) takes no reference images")
        return self.encode_prompts(frozen, prompts)

    def negative_conditions(self, frozen: dict[str, Any], positive: dict[str, torch.Tensor],
                            geometry: Geometry) -> dict[str, torch.Tensor] | None:
        """The CFG negative of the B candidates whose conditions are ``positive``, where part
        of it can be taken from ``positive`` rather than encoded again; None (the default): the
        engine encodes the empty prompt with the same reference images (``encode_conditions``).
        A family overrides this when its reference encoders (a VAE, a CLIP tower) see the
        references alone, so the negative's image conditions are the positive's."""
        return None

    def condition_image_problems(self, images: Sequence[Sequence[Any]] | None) -> list[str]:
        """Why these per-candidate reference images cannot condition this family ([] when
        they can): more images than ``max_condition_images``, or none where it needs some."""
        if images is None:
            return [] if self.max_condition_images == 0 else [
                f"{self.family!r} edits reference images: every candidate needs at least one"]
        problems = []
        for row, refs in enumerate(images):
            if len(refs) > self.max_condition_images:
                problems.append(f"candidate {row} has {len(refs)} reference images; "
                                f"{self.family!r} takes at most {self.max_condition_images}")
            elif self.max_condition_images and not refs:
                problems.append(f"candidate {row} has no reference image; {self.family!r} edits one")
        return problems

    def require_condition_images(self, images: Sequence[Sequence[Any]] | None) -> None:
        """Raises one ValueError naming every ``condition_image_problems`` of ``images``."""
        problems = self.condition_image_problems(images)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))

    @abc.abstractmethod
    def latent_shape(self, geometry: Geometry) -> tuple[int, ...]:
        """Per-sample latent shape as the transformer takes it."""

    @abc.abstractmethod
    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], geometry: Geometry) -> torch.Tensor:
        """The one transformer forward: x_t at sigma [B] -> predicted velocity, same shape.

        ``conditions`` is what ``encode_conditions`` returned (reference-image latents
        included), gathered and batched by the engine, or the same tensors as the rollout
        recorded them (the replay)."""

    @abc.abstractmethod
    def decode(self, frozen: dict[str, Any], latents: torch.Tensor,
               geometry: Geometry) -> torch.Tensor:
        """Final latents -> images [B, H, W, 3] uint8."""

    def compile_frozen(self, frozen: dict[str, Any]) -> None:
        """Compile what of the frozen parts pays for it (the engine calls this when it compiles
        its transformer); nothing by default."""

    def scheduler_sigmas(self, num_inference_steps: int, geometry: Geometry) -> torch.Tensor:
        """The sampling schedule: num_inference_steps + 1 sigmas from 1.0 down to 0.0 (fp32).

        Default: linear spacing as FlowMatchEulerDiscreteScheduler without shift; families
        with a resolution-dependent shift override this.
        """
        return torch.linspace(1.0, 0.0, num_inference_steps + 1, dtype=torch.float32)

    def timesteps_from_sigmas(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The family's timestep of each step (``sigmas`` holds N+1 values) -> [N] fp32.

        Default: diffusers' FlowMatchEulerDiscreteScheduler convention, sigma * 1000.
        """
        return sigmas[:-1].to(torch.float32) * 1000.0

    def forward_flops(self, geometry: Geometry, *, batch: int, text_tokens: int):
        """FLOPs of one transformer forward of ``batch`` samples at this geometry and text
        length, from the config alone (a ``trainer.compute.flops.FlopCount``), or None where
        the family does not state them: its MFU is then not logged."""
        return None

    # ---- checks (tasks: trainer.tasks; guidance: docs/design.md#sampling-and-the-sde-step) --
    @classmethod
    def check_task(cls, task: str) -> None:
        """Raise ValueError unless ``task`` is in GENERATION_TASKS and this family declares it."""
        problems = []
        if task not in GENERATION_TASKS:
            problems.append(f"generation task {task!r} is not in GENERATION_TASKS {GENERATION_TASKS}")
        if task not in cls.supported_tasks:
            problems.append(f"{cls.__name__} ({cls.family!r}) supports {cls.supported_tasks}, not {task!r}")
        if problems:
            raise ValueError("; ".join(problems))

    #: Whether classifier-free guidance (a second, negative-prompt forward) is offered.
    supports_cfg: ClassVar[bool] = True

    @classmethod
    def check_guidance(cls, guidance_scale: Any) -> None:
        """Raise ValueError unless guidance_scale is 1.0 (no CFG) or, with ``supports_cfg``,
        a number > 1: the engine and the replay then both run the conditional and the
        empty-prompt forward (trainer.models.guidance)."""
        ok = not isinstance(guidance_scale, bool) and isinstance(guidance_scale, (int, float)) \
            and math.isfinite(guidance_scale)
        if ok and float(guidance_scale) == 1.0:
            return
        if not cls.supports_cfg:
            raise ValueError(f"guidance_scale must be 1.0 for {cls.family!r} (no classifier-free "
                             f"guidance for this family), got {guidance_scale!r}")
        if not ok or guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be a number >= 1.0, got {guidance_scale!r}")

    # ---- latent geometry and the x_T recipe ------------------------------------------------
    def resolution_problems(self, geometry: Geometry) -> list[str]:
        """Why ``geometry`` cannot be generated by this family ([] when it can). The default
        refuses frames > 1: a family that generates video overrides it."""
        if geometry.frames != 1:
            return [f"{type(self).__name__} ({self.family!r}) generates images: frames must be "
                    f"1, got {geometry.frames}"]
        return []

    def init_noise_shape(self, geometry: Geometry) -> tuple[int, ...]:
        """Per-sample shape x_T is drawn in (before ``noise_to_latents``); default latent_shape."""
        return tuple(self.latent_shape(geometry))

    def latent_grid(self, geometry: Geometry) -> tuple[int, int]:
        """(h, w) of the latent grid: the last two dims of ``init_noise_shape``."""
        shape = self.init_noise_shape(geometry)
        return int(shape[-2]), int(shape[-1])

    def noise_to_latents(self, noise: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        """[B, *init_noise_shape] -> [B, *latent_shape] (e.g. 2x2 packing); default identity."""
        return noise

    def initial_latents(self, sample_ids: Sequence[str], geometry: Geometry, *, seed: int,
                        dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> torch.Tensor:
        """x_T [B, *latent_shape]: row b a pure function of (seed, sample_ids[b]).

        Drawn in ``init_noise_shape`` (the unpacked [C, h, w] grid, as the diffusers pipelines
        draw it) with the recipe of ``trainer.models.noise``, then packed, then cast.
        """
        draws = noise.gaussian(sample_ids, noise.initial_stream(), self.init_noise_shape(geometry),
                               seed=seed)
        return self.noise_to_latents(draws, geometry).to(device=device, dtype=dtype)

    def step_noise(self, sample_ids: Sequence[str], step_index: int, shape: Sequence[int], *,
                   seed: int, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> torch.Tensor:
        """The noise of step ``step_index`` [B, *shape]: a pure function of (seed, id, step)."""
        return noise.gaussian(sample_ids, noise.step_stream(step_index), shape, seed=seed,
                              dtype=dtype, device=device)

    # ---- rollout request / response (trainer.models.wire draws the schema) ---------------
    def build_rollout_request(self, prompts: Sequence[str], sample_ids: Sequence[str],
                              sampling: Mapping[str, Any], *, rollout_id: int | None, seed: int,
                              sde_indices: Sequence[int] | None = None,
                              group_index: Sequence[int] | None = None,
                              images: Sequence[Sequence[Any]] | None = None) -> dict[str, Any]:
        """A request in SGLang's diffusion rollout schema for B candidates.

        ``sampling`` is the rollout.sampling config (a ``SamplingConfig``, or its table). The
        trained SDE steps are the driver's resolved ``sde_indices`` (keyword) or else the
        config's; they are sorted and deduplicated. ``group_index`` defaults to one group per
        distinct prompt, numbered in order of first appearance. ``images``: per candidate, its
        reference images (``trainer.media.ImageRef``; None: none). Raises one ValueError listing
        every problem (guidance_scale != 1.0, an SDE step where the SDE type has no density,
        bad geometry, duplicate sample ids...).
        """
        return wire.build_request(self, prompts, sample_ids, sampling, rollout_id=rollout_id,
                                  seed=seed, sde_indices=sde_indices, group_index=group_index,
                                  images=images)

    def validate_rollout_response(self, response: Mapping[str, Any],
                                  request: Mapping[str, Any]) -> None:
        """Raise one ValueError listing every way ``response`` does not answer ``request``."""
        wire.validate_response(self, response, request)

    def pack_trajectory(self, response: Mapping[str, Any], request: Mapping[str, Any]) -> RolloutBatch:
        """Validate ``response`` and lay it out as a RolloutBatch (tensors decoded if JSON)."""
        return wire.pack(self, response, request)

    def replay_velocity(self, transformer: nn.Module, batch: RolloutBatch, step: int) -> torch.Tensor:
        """v at trained step ``step`` (0..S-1) of every candidate: the actor's replay forward.

        Inputs move to the transformer's device (a RolloutBatch may live on the host)."""
        dev = next(transformer.parameters()).device
        cond = {k: v.to(dev, non_blocking=True) for k, v in batch.conditions.items()}
        return self.velocity(transformer, batch.latents[:, step].to(dev, non_blocking=True),
                             batch.sigmas[:, step].to(dev), cond, batch.geometry)
