"""DiffusionNFT in the actor (``train.algorithm = "diffusionnft"``): the policy update of one
rollout batch with ``flowgrpo_kernels.nft.nft_loss`` (docs/algorithms.md).

The rollout samples with the ODE and returns each candidate's final latents ``x0``
(``RolloutBatch.final_latents``). Each micro-batch trains ``K = max(1, int(N *
timestep_fraction))`` noise levels per sample, drawn without replacement from the sampling
schedule's ``N`` sigmas (a fresh permutation per sample, as the reference). At each level
the sample is re-noised, ``x_t = (1 - t) x0 + t eps``, and the current velocity (with grad) and
the old policy's (no grad) are evaluated; ``train.kl_coef`` adds the reference's
``mean((v - v_ref)^2)`` against the base model (the adapter disabled). One optimizer step per
update, the loss averaged over its micro-batches and levels.

The old policy is a copy of the trainable parameters (``OldPolicy``), swapped into the model
for its forward. After each rollout's updates it moves toward the current weights:
``old <- d old + (1 - d) current`` with ``d = old_policy_decay(optimizer steps taken)``
(``train.nft_old_decay_*``: the reference's ``decay_type``). It starts equal to the initial
weights; checkpoints save it (``OldPolicyPart``, the ``nft_old`` part) and a resume restores
it as saved.
The noise and the permutations come from a generator seeded with ``(train.seed, rollout_id)``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from flowgrpo_kernels.nft import nft_loss, old_policy_decay
from trainer.actor.model import ensure_train_mode
from trainer.actor.replay import plan_updates
from trainer.actor.update import ema_after_micro_batch, optimizer_step
from trainer.models.guidance import guided_velocity


class OldPolicy:
    """A copy of ``model``'s trainable parameters: the NFT's old policy."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        with torch.no_grad():
            self.params = {n: p.detach().clone() for n, p in self._trainable()}

    def _trainable(self):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        with torch.no_grad():
            live = {n: p.detach().clone() for n, p in self._trainable()}
            for n, p in self._trainable():
                p.copy_(self.params[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self._trainable():
                    p.copy_(live[n])

    @torch.no_grad()
    def pull(self, decay: float) -> None:
        """``old <- decay * old + (1 - decay) * current``."""
        for n, p in self._trainable():
            self.params[n].mul_(decay).add_(p.detach(), alpha=1.0 - decay)


class OldPolicyPart:
    """The old policy as a checkpoint part (``nft_old``): saved with the actor's shards and
    restored at resume, as the reference keeps it for the whole run as its "old" adapter. The
    copy is made here when the checkpoint asks for it first (a save or a load before the first
    update); a load then overwrites it."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def _old(self) -> OldPolicy:
        if self.actor.nft_old is None:
            self.actor.nft_old = OldPolicy(self.actor.model)
        return self.actor.nft_old

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"params": self._old().params}  # DCP writes and fills these tensors in place

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        params = self._old().params
        missing = sorted(set(params) - set(state["params"]))
        if missing:
            raise KeyError(f"the checkpoint's old policy lacks {missing[:5]}")
        for name, tensor in params.items():
            if state["params"][name] is not tensor:
                tensor.copy_(state["params"][name])


def _velocity(actor, mb, x: torch.Tensor, t: torch.Tensor, conditions) -> torch.Tensor:
    return guided_velocity(actor.adapter, actor.model, x, t, conditions, mb.geometry,
                           mb.guidance_scale)


def micro_batch_loss(actor, mb, adv: torch.Tensor, levels: torch.Tensor,
                     gen: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """NFT loss of one micro-batch at one noise level per sample (``levels`` [b])."""
    t_cfg = actor.train_cfg
    device = next(actor.model.parameters()).device
    x0 = mb.final_latents.to(device, torch.float32)
    t = levels.to(device, torch.float32)
    eps = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(device)
    tcol = t.reshape(-1, *([1] * (x0.dim() - 1)))
    x_t = (1.0 - tcol) * x0 + tcol * eps
    conditions = {k: v.to(device) for k, v in mb.conditions.items()}
    with actor.nft_old.swapped_in(), torch.no_grad():
        v_old = _velocity(actor, mb, x_t, t, conditions)
    v = _velocity(actor, mb, x_t, t, conditions)
    loss, stats = nft_loss(v, v_old, x_t, x0, t, adv.to(device), beta=t_cfg.nft_beta,
                           adv_clip_max=t_cfg.nft_adv_clip_max)
    if t_cfg.kl_coef > 0:
        with torch.no_grad(), actor.model.disable_adapter():
            v_ref = _velocity(actor, mb, x_t, t, conditions)
        kl = ((v.float() - v_ref.float()) ** 2).mean()
        loss = loss + t_cfg.kl_coef * kl
        stats["kl"] = kl.detach()
    return loss, stats


def nft_train_on(actor, batch, advantages: torch.Tensor, rollout_id: int,
                 timestep_fraction: float) -> dict[str, float]:
    """The NFT update of one rollout batch (module docstring), training at
    ``timestep_fraction`` (``rollout.sampling``) of the schedule's noise levels per sample;
    returns its metrics."""
    train = actor.train_cfg
    if batch.final_latents is None or batch.schedule is None:
        raise RuntimeError("diffusionnft needs the rollout's final latents and schedule: the "
                           "embedded engine returns them, this engine did not")
    if actor.nft_old is None:
        actor.nft_old = OldPolicy(actor.model)
    gen = torch.Generator().manual_seed(train.seed * 1_000_003 + rollout_id)
    plan = plan_updates(len(batch), train.num_updates_per_batch,
                        int(train.micro_batch_size), generator=gen)
    sigmas = batch.schedule[:-1].float()
    fraction = float(timestep_fraction)
    levels_per_sample = max(1, int(len(sigmas) * fraction))
    order = torch.stack([torch.randperm(len(sigmas), generator=gen)[:levels_per_sample]
                         for _ in range(len(batch))])  # [B, K] level indices per sample
    ensure_train_mode(actor.model)
    params = [p for group in actor.optimizer.param_groups for p in group["params"]]
    sums: dict[str, list[torch.Tensor]] = {}
    steps = 0
    for micro_batches in plan.updates:
        scale = 1.0 / (len(micro_batches) * levels_per_sample)
        for m, rows in enumerate(micro_batches):
            if m:  # ema.per_micro_batch: after each micro-batch but the update's last
                ema_after_micro_batch(actor)
            mb, adv = batch.select(rows), advantages[rows]
            for k in range(levels_per_sample):
                loss, stats = micro_batch_loss(actor, mb, adv, sigmas[order[rows, k]], gen)
                (loss * scale).backward()
                stats["loss"] = loss.detach()
                for name, value in stats.items():
                    sums.setdefault(name, []).append(value.detach().float())
        gn, lr = optimizer_step(actor, params)
        ema_after_micro_batch(actor)
        steps += lr is not None
        sums.setdefault("grad_norm", []).append(gn.detach().float())
    decay = old_policy_decay(actor.lr_steps, delay=train.nft_old_decay_delay,
                             ramp=train.nft_old_decay_ramp, cap=train.nft_old_decay_cap)
    actor.nft_old.pull(decay)
    out = {f"train/{k}": float(torch.stack(v).mean()) for k, v in sums.items()}
    out.update({"train/optimizer_steps": float(steps),
                "train/optimizer_skips": float(len(plan.updates) - steps),
                "train/num_microbatches": float(plan.num_micro_batches),
                "train/nft_old_decay": float(decay),
                "train/nft_levels_per_sample": float(levels_per_sample)})
    return out
