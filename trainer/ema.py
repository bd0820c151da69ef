"""Exponential moving average of the trainable parameters (the Flow-GRPO reference's EMA).

After optimizer step ``n`` (counted from 0) the average moves when ``(n + 1) % interval == 0``:
``ema <- ema + (1 - d_n) * (param - ema)`` with ``d_n = min((1 + n) / (10 + n), decay)``, the
reference's warm-up of the decay (early averages follow the weights closely). The shadow copy
is fp32 and lives where the parameter lives (an FSDP2 parameter's shadow is a DTensor with
the same sharding, so each rank keeps only its shard).

Used by evaluation (``swapped_in``: the EMA weights replace the live ones for the duration,
then the live ones come back bit for bit) and by export; saved and resumed with the
checkpoint (DCP, resharding like the model) together with its step count, so a resumed run
continues the same average.

Departure from the reference: the reference calls its EMA update once per sample micro-batch
with the optimizer-step counter, so with gradient accumulation one optimizer step can update
the average several times; here it moves once per optimizer step, every ``interval`` steps.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.actor.model import strip_wrapper_names
from trainer.config import EMAConfig


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters under their checkpoint names (activation-checkpoint wrappers
    removed), the names ``trainer.checkpoint.export.read_model_tensors`` returns."""
    return [(strip_wrapper_names(n), p) for n, p in model.named_parameters() if p.requires_grad]


class ParameterEMA:
    """EMA of ``model``'s trainable parameters (see the module docstring)."""

    per_micro_batch = False  # step after every micro-batch, not after every optimizer step

    def __init__(self, model: nn.Module, *, decay: float, update_interval: int = 1) -> None:
        problems = []
        if not (isinstance(decay, (int, float)) and 0.0 <= decay < 1.0):
            problems.append(f"decay must be in [0, 1), got {decay!r}")
        if isinstance(update_interval, bool) or not isinstance(update_interval, int) or update_interval < 1:
            problems.append(f"update_interval must be a positive integer, got {update_interval!r}")
        if problems:
            raise ValueError("invalid EMA settings: " + "; ".join(problems))
        self.decay, self.update_interval = float(decay), int(update_interval)
        self.model = model
        with torch.no_grad():
            self.shadow = {n: p.detach().clone().float() for n, p in _trainable(model)}
        self.updates = 0  # how many times the average moved

    def current_decay(self, optimizer_step: int) -> float:
        return min((1 + optimizer_step) / (10 + optimizer_step), self.decay)

    @torch.no_grad()
    def step(self, optimizer_step: int) -> bool:
        """Call after optimizer step ``optimizer_step`` (0-based); True when the average moved."""
        if (optimizer_step + 1) % self.update_interval:
            return False
        weight = 1.0 - self.current_decay(optimizer_step)
        for name, param in _trainable(self.model):
            shadow = self.shadow[name]
            shadow.add_(param.detach().float() - shadow, alpha=weight)
        self.updates += 1
        return True

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA weights in the model for the block, the live ones restored after it."""
        live = {}
        with torch.no_grad():
            for name, param in _trainable(self.model):
                live[name] = param.detach().clone()
                param.copy_(self.shadow[name].to(param.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in _trainable(self.model):
                    param.copy_(live[name])

    # ---- checkpoint -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"shadow": self.shadow, "updates": torch.tensor(self.updates, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        """``state_dict()``'s layout, its shadow already filled in place (DCP's load)."""
        if state["shadow"] is not self.shadow:
            with torch.no_grad():
                for name, tensor in state["shadow"].items():
                    self.shadow[name].copy_(tensor)
        self.updates = int(state["updates"])

    def save(self, directory: Path) -> None:
        """DCP write of the shadow (every rank calls it under torch.distributed)."""
        with _quiet_single_process():
            dcp.save(self.state_dict(), checkpoint_id=str(directory),
                     no_dist=not (dist.is_available() and dist.is_initialized()))

    def load(self, directory: Path) -> None:
        """In-place DCP read; the shadow's names and shapes must match this model's."""
        state = self.state_dict()
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(directory),
                     no_dist=not (dist.is_available() and dist.is_initialized()))
        self.updates = int(state["updates"])


def ema_model_tensors(iter_dir: Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (a checkpoint's model tensors) with the trainable ones replaced by the
    checkpoint's EMA, cast to each tensor's dtype: what export writes with ``--ema``."""
    directory = Path(iter_dir) / "ema"
    if not directory.is_dir():
        raise FileNotFoundError(f"{iter_dir} has no EMA state (the run had ema.enabled off)")
    meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    shadow = {k[len("shadow."):]: torch.empty(tuple(v.size), dtype=v.properties.dtype)
              for k, v in meta.items()
              if k.startswith("shadow.") and isinstance(v, TensorStorageMetadata)}
    unknown = sorted(set(shadow) - set(tensors))
    if unknown:
        raise ValueError(f"EMA tensors absent from the checkpoint's model: {unknown[:3]}")
    with _quiet_single_process():
        dcp.load({"shadow": shadow}, checkpoint_id=str(directory), no_dist=True)
    return {k: shadow[k].to(t.dtype) if k in shadow else t for k, t in tensors.items()}


def build_ema(model: nn.Module, ema: EMAConfig) -> ParameterEMA | None:
    """The run's EMA (the ``[ema]`` section), None when it is off."""
    if not ema.enabled:
        return None
    out = ParameterEMA(model, decay=ema.decay, update_interval=ema.update_interval)
    out.per_micro_batch = bool(ema.per_micro_batch)  # the reference's placement (actor.update)
    return out


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save/load; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield
