"""``RolloutBatch``, what a rollout hands to the reward and the actor, and joining
per-request batches into the rollout's batch.

Conditions of different requests can differ in padded length (a text encoder pads to the
longest prompt of its call). They are right-padded with zeros to a common shape (a zero mask
entry is a masked token), so the rollout batch stays one tensor per condition. Design note:
with the driver's default of one prompt group per request, each group's conditions were
encoded alone and are unpadded at sampling time; an actor that wants the sampled shapes back
for a group can drop the trailing columns where the group's mask is zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from trainer.models.geometry import Geometry


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
    guidance_scale: float = 1.0           # > 1: CFG; conditions then hold the "neg:" halves
    sde_options: dict[str, str] = field(default_factory=dict)  # sigma_one, log_prob_form
    final_latents: torch.Tensor | None = None  # [B, *latent] x_0, when the engine returned it
    schedule: torch.Tensor | None = None       # [N + 1] fp32 sigmas of the whole schedule
    frames: int = 1                            # 1: images (Geometry.frames)
    # per candidate, its reference images (trainer.media.ImageRef); None: no conditioning
    # media (text-to-image). Their encoding is in ``conditions``; these go to the rewards
    # that want sources and to the pictures.
    sources: list[tuple[Any, ...]] | None = None

    @property
    def geometry(self) -> Geometry:
        """What every candidate of the batch is: height x width pixels, ``frames`` frames."""
        return Geometry(self.height, self.width, self.frames)

    def kernel_options(self) -> dict[str, Any]:
        """Keyword arguments of kernels.sde_log_prob / sde_kl for these transitions."""
        return {"eta": self.eta, "sde_type": self.sde_type, **self.sde_options}

    def __len__(self) -> int:
        return len(self.sample_ids)

    def select(self, idx: torch.Tensor | list[int]) -> "RolloutBatch":
        """Rows ``idx`` of every batch-first field (a micro-batch or a rank's slice)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        rows = idx_t.tolist()
        # the index goes to each device once: indexing a GPU tensor with a host index copies
        # the index (a host-blocking copy) for every tensor indexed
        on_device: dict[torch.device, torch.Tensor] = {}

        def take(t: torch.Tensor) -> torch.Tensor:
            if t.device not in on_device:
                on_device[t.device] = idx_t.to(t.device)
            return t[on_device[t.device]]

        return RolloutBatch(
            prompts=[self.prompts[i] for i in rows],
            sample_ids=[self.sample_ids[i] for i in rows],
            group_index=take(self.group_index),
            sde_indices=list(self.sde_indices),
            latents=take(self.latents),
            next_latents=take(self.next_latents),
            sigmas=take(self.sigmas),
            sigmas_next=take(self.sigmas_next),
            log_probs=take(self.log_probs),
            conditions={k: take(v) for k, v in self.conditions.items()},
            height=self.height,
            width=self.width,
            eta=self.eta,
            sde_type=self.sde_type,
            images=None if self.images is None else take(self.images),
            metadata=[self.metadata[i] for i in rows] if self.metadata else [],
            policy_version=self.policy_version,
            rollout_id=self.rollout_id,
            guidance_scale=self.guidance_scale,
            sde_options=dict(self.sde_options),
            final_latents=None if self.final_latents is None else take(self.final_latents),
            schedule=self.schedule,
            frames=self.frames,
            sources=None if self.sources is None else [self.sources[i] for i in rows],
        )



def _pad_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape[1:]) == shape:
        return t
    pad: list[int] = []
    for have, want in reversed(list(zip(t.shape[1:], shape))):
        pad += [0, want - have]
    return F.pad(t, pad)


def pad_and_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0 after right-padding every other dim to the largest size."""
    ranks = {t.dim() for t in tensors}
    if len(ranks) != 1:
        raise ValueError(f"cannot join condition tensors of different ranks {sorted(ranks)}")
    shape = tuple(max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim()))
    return torch.cat([_pad_to(t, shape) for t in tensors], dim=0)


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """One RolloutBatch from several with the same SDE steps, geometry and sampling."""
    if not batches:
        raise ValueError("no batches to join")
    first = batches[0]
    problems = []
    for b in batches[1:]:
        for field in ("sde_indices", "height", "width", "frames", "eta", "sde_type",
                      "guidance_scale", "sde_options"):
            if getattr(b, field) != getattr(first, field):
                problems.append(f"{field} differs: {getattr(first, field)!r} vs {getattr(b, field)!r}")
        if set(b.conditions) != set(first.conditions):
            problems.append(f"condition keys differ: {sorted(first.conditions)} vs {sorted(b.conditions)}")
    if problems:
        raise ValueError("cannot join rollout batches:\n  - " + "\n  - ".join(sorted(set(problems))))
    if len(batches) == 1:
        return first
    images = None
    if all(b.images is not None for b in batches):
        images = torch.cat([b.images for b in batches])
    return RolloutBatch(
        prompts=[p for b in batches for p in b.prompts],
        sample_ids=[s for b in batches for s in b.sample_ids],
        group_index=torch.cat([b.group_index for b in batches]),
        sde_indices=list(first.sde_indices),
        latents=torch.cat([b.latents for b in batches]),
        next_latents=torch.cat([b.next_latents for b in batches]),
        sigmas=torch.cat([b.sigmas for b in batches]),
        sigmas_next=torch.cat([b.sigmas_next for b in batches]),
        log_probs=torch.cat([b.log_probs for b in batches]),
        conditions={k: pad_and_cat([b.conditions[k] for b in batches]) for k in first.conditions},
        height=first.height,
        width=first.width,
        eta=first.eta,
        sde_type=first.sde_type,
        images=images,
        metadata=[m for b in batches for m in b.metadata],
        policy_version=first.policy_version,
        rollout_id=first.rollout_id,
        guidance_scale=first.guidance_scale,
        sde_options=dict(first.sde_options),
        final_latents=torch.cat([b.final_latents for b in batches])
        if all(b.final_latents is not None for b in batches) else None,
        schedule=first.schedule,
        frames=first.frames,
        sources=_joined_sources(batches),
    )


def _joined_sources(batches: list[RolloutBatch]) -> list[tuple[Any, ...]] | None:
    """The batches' per-candidate sources in order; None when none has any (text-to-image)."""
    if all(b.sources is None for b in batches):
        return None
    return [tuple(s) for b in batches for s in (b.sources or [()] * len(b))]
