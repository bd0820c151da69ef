"""The model-adapter contract: everything model-specific that the engine and the actor need.

One adapter class per model family, chosen by dotpath (``--model-adapter-path``). The engine
(rollout side) and the actor (training side) only ever talk to a model through this class, so
adding a family means adding one adapter, never touching the loop.

Invariant the whole trainer rests on: ``velocity()`` is the single transformer forward used
both by the engine's sampler and by the actor's replay, and both then call the same
``kernels`` function, so the first on-policy update sees ratio == 1 exactly.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

import torch
from torch import nn

GENERATION_TASKS: tuple[str, ...] = ("t2i",)


@dataclass
class RolloutBatch:
    """What a rollout hands to the reward and the actor (in memory, no disk round trip).

    B candidates, S trained SDE steps. Latent tensors keep the transformer's input layout
    (e.g. packed [seq, channels] for Qwen-Image / FLUX, [C, h, w] for SD3).
    """

    prompts: list[str]
    sample_ids: list[str]                 # stable candidate ids (fix x_T and every step's noise)
    group_index: torch.Tensor             # [B] int64, which prompt group each candidate is in
    sde_indices: list[int]                # the S trained steps, in schedule order
    latents: torch.Tensor                 # [B, S, *latent]  x at each trained step
    next_latents: torch.Tensor            # [B, S, *latent]  sampled x at the step after it
    sigmas: torch.Tensor                  # [B, S] fp32 sigma at each trained step
    sigmas_next: torch.Tensor             # [B, S] fp32 sigma of the step after it
    log_probs: torch.Tensor               # [B, S] fp32, recorded by the engine (pi_old)
    conditions: dict[str, torch.Tensor]   # batch-first frozen conditions (prompt embeds, masks)
    height: int
    width: int
    eta: float
    sde_type: str
    images: torch.Tensor | None = None    # [B, H, W, 3] uint8 decoded images
    metadata: list[dict[str, Any]] = field(default_factory=list)
    policy_version: int = 0
    rollout_id: int | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)

    def select(self, idx: torch.Tensor | list[int]) -> "RolloutBatch":
        """Rows ``idx`` of every batch-first field (a micro-batch or a rank's slice)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        rows = idx_t.tolist()
        return RolloutBatch(
            prompts=[self.prompts[i] for i in rows],
            sample_ids=[self.sample_ids[i] for i in rows],
            group_index=self.group_index[idx_t],
            sde_indices=list(self.sde_indices),
            latents=self.latents[idx_t],
            next_latents=self.next_latents[idx_t],
            sigmas=self.sigmas[idx_t],
            sigmas_next=self.sigmas_next[idx_t],
            log_probs=self.log_probs[idx_t],
            conditions={k: v[idx_t] for k, v in self.conditions.items()},
            height=self.height,
            width=self.width,
            eta=self.eta,
            sde_type=self.sde_type,
            images=None if self.images is None else self.images[idx_t],
            metadata=[self.metadata[i] for i in rows] if self.metadata else [],
            policy_version=self.policy_version,
            rollout_id=self.rollout_id,
        )


class GenerativeModelAdapter(abc.ABC):
    """Base class of every model family's adapter.

    Subclasses set ``family`` and ``supported_tasks`` and implement the abstract methods.
    Constructor: ``Adapter(model_path, **options)`` where model_path is a diffusers-layout
    directory (``transformer/``, ``vae/``, ``text_encoder*/``, ``tokenizer*/``, ``scheduler/``).
    """

    family: ClassVar[str] = "base"
    supported_tasks: ClassVar[tuple[str, ...]] = ("t2i",)

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

    @abc.abstractmethod
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Per-sample latent shape as the transformer takes it."""

    @abc.abstractmethod
    def velocity(self, transformer: nn.Module, latents: torch.Tensor, sigma: torch.Tensor,
                 conditions: dict[str, torch.Tensor], height: int, width: int) -> torch.Tensor:
        """The one transformer forward: x_t at sigma [B] -> predicted velocity, same shape."""

    @abc.abstractmethod
    def decode(self, frozen: dict[str, Any], latents: torch.Tensor, height: int,
               width: int) -> torch.Tensor:
        """Final latents -> images [B, H, W, 3] uint8."""

    def scheduler_sigmas(self, num_inference_steps: int, height: int, width: int) -> torch.Tensor:
        """The sampling schedule: num_inference_steps + 1 sigmas from 1.0 down to 0.0 (fp32).

        Default: linear spacing as FlowMatchEulerDiscreteScheduler without shift; families
        with a resolution-dependent shift override this.
        """
        return torch.linspace(1.0, 0.0, num_inference_steps + 1, dtype=torch.float32)
