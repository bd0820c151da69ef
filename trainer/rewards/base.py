"""The scorer protocol: what every reward model, rule or remote client implements.

A scorer declares the components it produces and the media tracks it reads, and turns a batch
of decoded images (+ their prompts and metadata) into one fp32 value per sample and component.
Everything else (caching, timing, device placement, validation of what comes back, group
normalisation) lives in the manager and in ``advantages``, so a scorer stays a small class.
"""
from __future__ import annotations

import abc
import math
import numbers
from typing import Any, ClassVar, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from trainer.utils.values import import_dotpath as load_object  # noqa: F401  (scorers' name for it)

# Media a scorer can ask for; a scorer that needs another track (audio) is refused when the
# manager is built, not in the middle of a rollout. A batch of images is a video batch of
# one-frame videos to a scorer that reads videos (``takes_video``).
SUPPORTED_TRACKS: tuple[str, ...] = ("image", "video")


class RewardError(RuntimeError):
    """A scorer produced something the trainer cannot use (wrong length, wrong keys...)."""


class RewardScorer(abc.ABC):
    """Abstract base of every scorer.

    Subclasses set ``components`` (the names of the values ``score`` returns) and
    ``required_tracks`` and implement ``score``. The constructor is the subclass's own:
    the manager calls ``cls(device=..., **scorer_kwargs)`` and adds ``model_path=...`` only
    when a model path is configured, so weight-free scorers need not accept one.

    ``score`` may return a subset of ``components`` (a component it could not compute is simply
    absent) and may use NaN for single samples it could not score; the advantage step turns
    either into a failed group when the component is required.

    Editing: a scorer that judges an edit against its source sets ``wants_sources = True`` and
    takes a keyword argument ``sources`` in ``score``: one tuple per sample of that sample's
    reference images, each uint8 numpy [H, W, 3] (RGB; sizes may differ from the result's and
    from each other; the first is the image being edited), or ``None`` when the batch has no
    conditioning media (text-to-image). Scorers that leave ``wants_sources`` False are called
    exactly as before, with no ``sources`` argument, so every existing scorer is unchanged.

    Video: a scorer that reads whole videos sets ``takes_video = True`` (and lists "video" in
    ``required_tracks``); its ``score`` gets uint8 [B, F, H, W, 3] for a video batch and
    [B, H, W, 3] for an image batch (``frames_of`` reads both as
    videos). Every other scorer is an image scorer: the manager scores a video batch with it
    frame by frame and aggregates (``trainer.rewards.video``), so it never sees a video.
    """

    components: ClassVar[tuple[str, ...]] = ()
    required_tracks: ClassVar[tuple[str, ...]] = ("image",)
    wants_sources: ClassVar[bool] = False
    takes_video: ClassVar[bool] = False

    @abc.abstractmethod
    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """images uint8 [B, H, W, 3] (any device) -> {component: fp32 [B]}; with
        ``wants_sources``, also ``sources=`` (see the class docstring)."""

    def to(self, device: str | torch.device) -> "RewardScorer":
        """Move every ``nn.Module`` attribute (the loaded weights) to ``device``.

        Lets the training loop park a colocated scorer on the CPU while the actor trains, and
        bring it back for the next rollout, without reloading it from disk.
        """
        device = torch.device(device)
        for value in vars(self).values():
            if isinstance(value, nn.Module):
                value.to(device)
        if hasattr(self, "device"):
            self.device = device
        return self


def frames_of(images: torch.Tensor) -> torch.Tensor:
    """An image batch [B, H, W, 3] as one-frame videos [B, 1, H, W, 3]; a video as is."""
    return images.unsqueeze(1) if images.dim() == 4 else images


def check_score_inputs(images: Any, prompts: Sequence[str], metadata: Sequence[Any], *,
                       video: bool = False) -> int:
    """Validate one scoring batch; returns B. Raises one ValueError naming every problem.
    ``video``: a video batch [B, F, H, W, 3] (F >= 1) is accepted besides images."""
    problems: list[str] = []
    batch = None
    ranks = (4, 5) if video else (4,)
    if not isinstance(images, torch.Tensor):
        problems.append(f"images must be a torch.Tensor, got {type(images).__name__}")
    else:
        if images.dtype != torch.uint8:
            problems.append(f"images must be uint8, got {images.dtype}")
        if images.dim() not in ranks or images.shape[-1] != 3 or \
                (images.dim() == 5 and images.shape[1] < 1):
            wanted = "[B, H, W, 3] or a video [B, F, H, W, 3]" if video else "[B, H, W, 3]"
            problems.append(f"images must be {wanted}, got shape {list(images.shape)}")
        else:
            batch = images.shape[0]
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        problems.append("prompts must be a list of str")
    if not all(isinstance(m, Mapping) for m in metadata):
        problems.append("metadata must be a list of dicts (one per sample)")
    if batch is not None:
        if len(prompts) != batch:
            problems.append(f"{len(prompts)} prompts for {batch} images")
        if len(metadata) != batch:
            problems.append(f"{len(metadata)} metadata entries for {batch} images")
    if problems:
        raise ValueError("reward scoring input: " + "; ".join(problems))
    return int(batch)


_FP32_MAX = float(torch.finfo(torch.float32).max)


def _plain_values(name: str, values: Any, problems: list[str]) -> torch.Tensor | None:
    """A list / tuple / numpy array of numbers (None for "not scored") -> fp64 [B].

    Numbers only: a string such as "0.5" or a bool is refused, not coerced (a reward that
    returns text has a bug the trainer must not hide)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "fiu":
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        problems.append(f"component {name!r}: expected one number per sample, got "
                        f"{type(values).__name__}")
        return None
    items = list(values)
    bad = [i for i, v in enumerate(items) if v is not None and
           (isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real))]
    if bad:
        shown = ", ".join(f"[{i}]={items[i]!r} ({type(items[i]).__name__})" for i in bad[:3])
        problems.append(f"component {name!r}: values must be numbers (None or NaN for a sample "
                        f"not scored), got {shown}{' ...' if len(bad) > 3 else ''}")
        return None
    return torch.tensor([math.nan if v is None else float(v) for v in items], dtype=torch.float64)


def to_component_tensor(name: str, values: Any, batch: int,
                        problems: list[str]) -> torch.Tensor | None:
    """One scorer output -> CPU fp32 [B]; appends to ``problems`` instead of raising.

    Refused: non-numbers (strings are not parsed), the wrong length, complex or bool tensors,
    and finite values beyond fp32's range (1e300 would silently become inf)."""
    if isinstance(values, torch.Tensor):
        tensor = values.detach()
    else:
        tensor = _plain_values(name, values, problems)
        if tensor is None:
            return None
    if tensor.dim() != 1 or tensor.shape[0] != batch:
        problems.append(f"component {name!r}: expected shape [{batch}], got {list(tensor.shape)}")
        return None
    if tensor.is_complex() or tensor.dtype == torch.bool:
        problems.append(f"component {name!r}: dtype {tensor.dtype} is not a real number type")
        return None
    wide = tensor.to(device="cpu", dtype=torch.float64)  # the host sync that ends a CUDA score
    overflow = (wide.isfinite() & (wide.abs() > _FP32_MAX)).nonzero().flatten().tolist()
    if overflow:
        shown = ", ".join(f"[{i}]={wide[i].item():.3g}" for i in overflow[:3])
        problems.append(f"component {name!r}: values beyond float32's range ({_FP32_MAX:.3g}) "
                        f"would become inf: {shown}; rescale the reward")
        return None
    return wide.to(torch.float32)
