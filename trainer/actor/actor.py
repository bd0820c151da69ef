"""``Actor``: the policy being trained, as one handle: the adapter, the (FSDP2) model, its
optimizer, the optional EMA, the compute meters, the ``[train]`` and ``[fsdp]`` config
sections, and the counters the update moves (the LR schedule's position, the resolved
``micro_batch_size=auto``, the host copy while offloaded).

The update (``trainer.actor.update``) takes an ``Actor`` and nothing else of the run; so do
the micro-batch sizing and the micro-step. For checkpoints the actor is a ``Stateful`` part
(``state_dict`` / ``load_state_dict``): its DCP state is the model (a LoRA run: the adapter
only) and the optimizer, under the keys ``trainer.checkpoint.shards`` writes.

Design choice: ``lr_steps`` lives here, not with the loop's counters, because the optimizer
step advances it; the loop reads it when it writes ``trainer_state.json``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from trainer.actor.model import offload_actor, onload_actor, strip_wrapper_names
from trainer.checkpoint.layout import CheckpointError
from trainer.checkpoint.shards import state_dicts
from trainer.config import FSDPConfig, TrainConfig
from trainer.models.base import GenerativeModelAdapter
from trainer.profiling import ComputeMeter


class Actor:
    """The trained policy and everything its update reads or moves (module docstring)."""

    def __init__(self, adapter: GenerativeModelAdapter, model: nn.Module,
                 optimizer: torch.optim.Optimizer, *, train: TrainConfig, fsdp: FSDPConfig,
                 device: torch.device | str, ema: Any = None, trainable_only: bool = False,
                 meter: ComputeMeter | None = None, outside: ComputeMeter | None = None) -> None:
        self.adapter, self.model, self.optimizer, self.ema = adapter, model, optimizer, ema
        self.train_cfg, self.fsdp_cfg = train, fsdp
        self.device = torch.device(device)
        self.trainable_only = trainable_only  # LoRA: checkpoints hold the adapter only
        self.meter = meter if meter is not None else ComputeMeter()  # model compute
        # named parts of what lies outside it: grad clip + optimizer steps
        self.outside = outside if outside is not None else ComputeMeter()
        self.lr_steps = 0              # optimizer steps taken: the LR schedule's position
        self.auto_micro_batch: int | None = None  # train.micro_batch_size=auto, once resolved
        self.offloaded = None          # the host copy while offloaded (OffloadState)
        self.nft_old = None            # diffusionnft: the old-policy copy (algorithms.nft_step)

    def coll_device(self) -> torch.device:
        """Where this rank's small all-reduces run (NCCL needs the GPU, gloo the host)."""
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    # ---- Stateful (checkpoints) ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{"model", "optim"} as DCP writes them (``trainer.checkpoint.shards.state_dicts``);
        the actor must be on its device (``onloaded``)."""
        return state_dicts(self.model, self.optimizer, self.trainable_only)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set the model and optimizer from ``state`` (``state_dict``'s layout, filled by DCP).
        A LoRA run's frozen base is absent on purpose, so loading is strict only in full mode;
        every trainable tensor must have been loaded."""
        lora = self.trainable_only
        result = set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                                optim_state_dict=state["optim"],
                                options=StateDictOptions(ignore_frozen_params=lora,
                                                         strict=not lora))
        trainable = {strip_wrapper_names(n) for n, p in self.model.named_parameters()
                     if p.requires_grad}
        bad = [k for k in getattr(result, "missing_keys", []) if k in trainable]
        bad += list(getattr(result, "unexpected_keys", []))
        if bad:
            raise CheckpointError(f"the checkpoint left trainable tensors unloaded: {bad[:5]}")

    def onloaded(self):
        """A block in which the model and optimizer are on the device (DCP reads the device
        shards, whose storage is freed while offloaded); offloaded again after it."""
        return _Onloaded(self)


class _Onloaded:
    def __init__(self, actor: Actor) -> None:
        self.actor = actor
        self.was_offloaded = actor.offloaded is not None

    def __enter__(self) -> Actor:
        if self.was_offloaded:
            onload_actor(self.actor.model, self.actor.optimizer, self.actor.offloaded)
            self.actor.offloaded = None
        return self.actor

    def __exit__(self, *exc) -> None:
        if self.was_offloaded:
            self.actor.offloaded = offload_actor(self.actor.model, self.actor.optimizer)
