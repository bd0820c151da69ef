"""DCP shards of the actor (model + optimizer).

Everything works with and without an initialised process group: without one, DCP runs in
``no_dist`` mode.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from trainer.actor.model import strip_wrapper_names
from trainer.checkpoint.layout import CheckpointError
from trainer.utils.collectives import distributed


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns on every single-process save/load; that is our intent here, not a slip."""
    with warnings.catch_warnings():
        if not distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lora: bool
                ) -> dict[str, Any]:
    """{"model", "optim"} as DCP wants them: sharded DTensors under FSDP2, canonical names
    (activation-checkpoint and FSDP wrappers removed). LoRA runs keep the trainable tensors
    only: ``ignore_frozen_params`` drops the frozen base, and the base's buffers are dropped
    too (they are not trained and come back with the base from --model-path), so the model
    part of a LoRA checkpoint is exactly the adapter."""
    msd, osd = get_state_dict(model, optimizer,
                              options=StateDictOptions(ignore_frozen_params=lora))
    if lora:
        trainable = {strip_wrapper_names(n) for n, p in model.named_parameters()
                     if p.requires_grad}
        msd = {k: v for k, v in msd.items() if k in trainable}
    return {"model": msd, "optim": osd}


def write_shards(model, optimizer, lora: bool, directory: Path) -> None:
    with _single_process_ok():
        dcp.save(state_dicts(model, optimizer, lora), checkpoint_id=str(directory),
                 no_dist=not distributed())


def _shape_problems(template: dict[str, Any], directory: Path) -> list[str]:
    """Model tensors the checkpoint lacks, has in excess, or holds with another shape."""
    meta = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: v for k, v in meta.items() if k.startswith("model.")}
    problems = []
    missing = [k for k in template if k not in saved]
    extra = [k for k in saved if k not in template]
    if missing:
        problems.append(f"{len(missing)} model tensors missing from the checkpoint, e.g. "
                        f"{missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} checkpoint tensors the model does not have, e.g. "
                        f"{extra[:3]}")
    for k, t in template.items():
        size = getattr(saved.get(k), "size", None)
        if size is not None and tuple(size) != tuple(t.shape):
            problems.append(f"{k}: checkpoint shape {tuple(size)}, model shape {tuple(t.shape)}")
    return problems


def read_shards(model, optimizer, lora: bool, directory: Path) -> None:
    """Load model + optimizer state in place (resharding to the current world if needed)."""
    sd = state_dicts(model, optimizer, lora)
    problems = _shape_problems(sd["model"], directory)
    if problems:
        raise CheckpointError(f"checkpoint {directory} does not fit the model:\n  - "
                              + "\n  - ".join(problems))
    with _single_process_ok():
        dcp.load(sd, checkpoint_id=str(directory), no_dist=not distributed())
    # LoRA: the frozen base is absent on purpose, so strict loading would reject it.
    result = set_state_dict(model, optimizer, model_state_dict=sd["model"],
                            optim_state_dict=sd["optim"],
                            options=StateDictOptions(ignore_frozen_params=lora, strict=not lora))
    trainable = {strip_wrapper_names(n) for n, p in model.named_parameters() if p.requires_grad}
    bad = [k for k in getattr(result, "missing_keys", []) if k in trainable]
    bad += list(getattr(result, "unexpected_keys", []))
    if bad:
        raise CheckpointError(f"checkpoint {directory} left trainable tensors unloaded: {bad[:5]}")
