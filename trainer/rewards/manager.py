"""The reward manager: one cached, configured set of scorers behind a single ``score`` call.

Runtimes:

* ``colocate``: in the rollout process, on its GPU (the actor is offloaded while it scores).
  ``device`` defaults to the current CUDA device; without CUDA this is a configuration error.
* ``cpu``: in the rollout process on the host (CUDA never touched by the scorer).
* ``remote``: POST to ``endpoint`` (see ``remote`` for the wire schema). ``scorer_path`` is
  optional there; when given, only its class attributes are read (the component names), its
  weights are never loaded locally.

A custom reward function (``custom_reward_path``) runs in-process next to the scorer in every
runtime, so a remote PickScore and a local rule-based term can be combined; it may be written
in our form or the Flow-GRPO reference's, and every call into it has a deadline
(``reward.custom_timeout_s``): ``trainer.rewards.function``.

With any component weight given, every component the scorers produce needs one (0 included):
one left out would weigh nothing without a word.

Video: ``score`` takes a video batch uint8 [B, F, H, W, 3] as well as images; each image
scorer scores it frame by frame under its ``frame_aggregation`` (mean by default), scorers
that read videos get it whole, and a one-frame video is scored as the image batch it is
(``trainer.rewards.video``).

Managers are cached per configuration: building one twice with the same arguments returns the
same object, so a model is loaded once per process, not once per rollout.
"""
from __future__ import annotations

import dataclasses
import inspect
import threading
import time
from typing import Any, Sequence

import numpy as np
import torch

from trainer.media import ImageRef, as_arrays
from trainer.rewards.base import (SUPPORTED_TRACKS, RewardError, RewardScorer, check_score_inputs,
                                  load_object, to_component_tensor)
from trainer.rewards.function import FunctionScorer
from trainer.rewards.remote import RemoteScorer
from trainer.rewards.spec import ScorerSpec, frame_rule_problems, option_problems, \
    resolve_weights, scorer_class, scorer_specs, shadowing_problems, unweighed_problem
from trainer.rewards.video import FrameRule, score_batch

RUNTIMES: tuple[str, ...] = ("colocate", "cpu", "remote")

_CACHE: dict[tuple, "RewardManager"] = {}
_CACHE_LOCK = threading.Lock()


class RewardManager:
    """Scores a batch with every configured scorer and times it.

    ``components`` is the union of the scorers' component names (each produced by exactly one
    scorer). ``score`` returns CPU fp32 [B] tensors (B is a few hundred: the copy is nothing,
    and advantage maths and metrics then cost no device syncs) and the timing metrics.
    """

    def __init__(self, scorers: Sequence[RewardScorer], *, runtime: str,
                 device: torch.device | None) -> None:
        self.scorers = list(scorers)
        self.runtime = runtime
        self.device = device
        owner: dict[str, str] = {}
        problems = []
        for scorer in self.scorers:
            name = getattr(scorer, "name", type(scorer).__name__)
            for component in scorer.components:
                if component in owner:
                    problems.append(f"component {component!r} produced by both {owner[component]} "
                                    f"and {name}")
                owner[component] = name
            missing_tracks = sorted(set(scorer.required_tracks) - set(SUPPORTED_TRACKS))
            if missing_tracks:
                problems.append(f"{name} needs media tracks {missing_tracks}; a rollout provides "
                                f"only {list(SUPPORTED_TRACKS)}")
            if "video" in scorer.required_tracks and not getattr(scorer, "takes_video", False):
                problems.append(f"{name} needs the video track but does not set takes_video, "
                                f"so it would be given single frames (RewardScorer)")
        if problems:
            raise ValueError("reward manager: " + "; ".join(problems))
        self.components: tuple[str, ...] = tuple(owner)
        # set by build_reward_manager_from_config; empty weights: every component weighs 1
        self.weights: dict[str, float] = {}
        self.required: list[str] = []

    def to(self, device: str | torch.device) -> "RewardManager":
        """Move local scorers' weights (e.g. to "cpu" while the actor trains, and back)."""
        for scorer in self.scorers:
            if not isinstance(scorer, (RemoteScorer, FunctionScorer)) and hasattr(scorer, "to"):
                scorer.to(device)
        return self

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]],
              sources: Sequence[Sequence[Any]] | None = None
              ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """``images``: uint8 [B, H, W, 3], or a video batch [B, F, H, W, 3] (one with F = 1
        is scored as the image batch it is; image scorers score longer ones frame by frame
        under their ``frame_rule``: ``trainer.rewards.video``).

        ``sources``: per sample, its reference images (``trainer.media.ImageRef`` or uint8
        [H, W, 3] arrays), or None for text-to-image; decoded once here and passed to the
        scorers that set ``wants_sources`` (``RewardScorer``), never to the others."""
        batch = check_score_inputs(images, prompts, metadata, video=True)
        if images.dim() == 5 and images.shape[1] == 1:
            images = images[:, 0]
        prompts, metadata = list(prompts), [dict(m) for m in metadata]
        decoded = decode_sources(sources, batch)
        cuda = images.is_cuda or (self.device is not None and self.device.type == "cuda")
        if cuda:  # host sync: time the scoring, not the rollout kernels still queued
            torch.cuda.synchronize(images.device if images.is_cuda else self.device)
        start = time.perf_counter()
        components: dict[str, torch.Tensor] = {}
        problems: list[str] = []
        for scorer in self.scorers:
            name = getattr(scorer, "name", type(scorer).__name__)
            out = score_batch(scorer, images, prompts, metadata, decoded,
                              getattr(scorer, "frame_rule", None))
            if not isinstance(out, dict):
                raise RewardError(f"{name}.score returned {type(out).__name__}, not a dict")
            for component, values in out.items():
                if component not in scorer.components:
                    problems.append(f"{name} returned undeclared component {component!r}")
                    continue
                # .cpu() inside: the host sync that ends the timed region on CUDA.
                tensor = to_component_tensor(component, values, batch, problems)
                if tensor is not None:
                    components[component] = tensor
        if problems:
            raise RewardError("reward scorers: " + "; ".join(problems))
        elapsed = time.perf_counter() - start
        metrics = {"reward/score_time": elapsed,
                   "reward/score_samples_per_s": batch / elapsed if elapsed > 0 else float("inf")}
        return components, metrics


def decode_sources(sources: Sequence[Sequence[Any]] | None, batch: int
                   ) -> list[tuple[np.ndarray, ...]] | None:
    """Per-sample sources as uint8 arrays, each distinct ImageRef decoded once (a group's
    candidates share their prompt's sources); None stays None."""
    if sources is None:
        return None
    if len(sources) != batch:
        raise ValueError(f"reward scoring input: {len(sources)} source lists for {batch} images")
    cache: dict[ImageRef, np.ndarray] = {}

    def one(source: Any) -> np.ndarray:
        if isinstance(source, ImageRef):
            if source not in cache:
                cache[source] = as_arrays([source])[0]
            return cache[source]
        return as_arrays([source])[0]
    return [tuple(one(s) for s in sample) for sample in sources]


def _instantiate(cls: type, *, model_path: str | None, device: torch.device | None,
                 kwargs: dict[str, Any], dotpath: str,
                 model_key: str = "--reward-model-path") -> RewardScorer:
    problems = option_problems(cls, kwargs, model_path, dotpath, model_key)
    if problems:
        raise ValueError("reward scorer: " + "; ".join(problems))
    params = inspect.signature(cls).parameters
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    call = dict(kwargs)
    if model_path is not None:
        call["model_path"] = model_path
    if "device" in params or accepts_any:
        call["device"] = device
    return cls(**call)


def _cache_key(args: dict[str, Any]) -> tuple:
    def freeze(value: Any) -> Any:
        if isinstance(value, dict):
            return tuple(sorted((k, freeze(v)) for k, v in value.items()))
        if isinstance(value, (list, tuple)):
            return tuple(freeze(v) for v in value)
        if isinstance(value, torch.device):
            return str(value)
        return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return freeze(args)


def build_reward_manager(*, scorer_path: str | None, model_path: str | None, runtime: str,
                         endpoint: str | None = None, device: str | torch.device | None = None,
                         custom_reward_path: str | None = None, timeout_s: float = 60.0,
                         max_retries: int = 3, custom_timeout_s: float = 600.0,
                         **scorer_kwargs: Any) -> RewardManager:
    """Build (or return the cached) single-scorer manager for this configuration.

    ``scorer_kwargs`` go to the scorer's constructor (e.g. ``dtype``, ``batch_size``); for the
    remote runtime they go to RemoteScorer (``backoff_s``, ``components``).
    """
    specs = [ScorerSpec("scorer", scorer_path, None, model_path,
                        options={} if runtime == "remote" else dict(scorer_kwargs))] \
        if scorer_path else []
    remote_kwargs = dict(scorer_kwargs) if runtime == "remote" else {}
    problems = []
    if scorer_path is None and scorer_kwargs and runtime != "remote":
        problems.append(f"scorer options {sorted(scorer_kwargs)} but no scorer path")
    if runtime == "remote" and model_path is not None:
        problems.append("runtime 'remote' loads no local model; drop --reward-model-path")
    return _cached(specs, runtime=runtime, endpoint=endpoint, device=device,
                   custom_reward_path=custom_reward_path, timeout_s=timeout_s,
                   max_retries=max_retries, remote_kwargs=remote_kwargs,
                   custom_timeout_s=custom_timeout_s, problems=tuple(problems))


def build_reward_manager_from_config(reward, device: str | torch.device | None = None,
                                     max_retries: int = 3) -> RewardManager:
    """The manager of a ``[reward]`` config section: every scorer of ``reward.scorers`` (or
    the single ``scorer_path``), the custom function, and the resolved component weights and
    required components on ``manager.weights`` / ``manager.required``."""
    specs, problems = scorer_specs(reward)
    if problems:
        raise ValueError("reward configuration: " + "; ".join(problems))
    by_spec = {spec.name: scorer_class(spec.path).components for spec in specs}
    weights, required, problems = resolve_weights(reward, by_spec, specs)
    problems += [p for spec in specs for p in shadowing_problems(spec, scorer_class(spec.path))]
    problems += [p for spec in specs
                 for p in frame_rule_problems(spec, scorer_class(spec.path), reward.runtime)]
    if problems:
        raise ValueError("reward configuration: " + "; ".join(problems))
    # weights are part of the cache key: two configs never share (and rewrite) one manager's
    manager = _cached(specs, runtime=reward.runtime, endpoint=reward.endpoint, device=device,
                      custom_reward_path=reward.custom_reward_path, timeout_s=reward.timeout_s,
                      max_retries=max_retries, remote_kwargs={}, weights=weights,
                      required=tuple(required), custom_timeout_s=reward.custom_timeout_s)
    unweighed = unweighed_problem(manager.components, manager.weights)
    if unweighed:
        raise ValueError("reward configuration: " + unweighed)
    return manager


def _cached(specs: list[ScorerSpec], **kwargs: Any) -> RewardManager:
    key = _cache_key(dict(specs=[dataclasses.asdict(s) for s in specs], **kwargs))
    with _CACHE_LOCK:
        if key not in _CACHE:
            _CACHE[key] = _build(specs, **kwargs)
        return _CACHE[key]


def clear_reward_manager_cache() -> None:
    """Forget every cached manager (their models are freed once no one else holds them)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def _resolve_device(runtime: str, device, problems: list[str]) -> torch.device | None:
    if runtime == "cpu":
        if device is not None and torch.device(device).type != "cpu":
            problems.append(f"runtime 'cpu' with device={device!r}")
        return torch.device("cpu")
    if runtime == "colocate":
        if not torch.cuda.is_available():
            problems.append("runtime 'colocate' scores on the rollout GPU but CUDA is not "
                            "available; use runtime 'cpu'")
            return None
        resolved = torch.device(device) if device is not None else \
            torch.device("cuda", torch.cuda.current_device())
        if resolved.type != "cuda":
            problems.append(f"runtime 'colocate' with non-CUDA device={device!r}")
        return resolved
    return None


def _build(specs: list[ScorerSpec], *, runtime, endpoint, device, custom_reward_path, timeout_s,
           max_retries, remote_kwargs, problems=(), weights=None, required=(),
           custom_timeout_s=600.0) -> RewardManager:
    problems = list(problems)
    if runtime not in RUNTIMES:
        problems.append(f"runtime {runtime!r} is not one of {list(RUNTIMES)}")
    if runtime == "remote":
        if not endpoint:
            problems.append("runtime 'remote' needs an endpoint (--reward-endpoint)")
    else:
        if endpoint:
            problems.append(f"an endpoint is set but runtime is {runtime!r}, not 'remote'")
        if not specs and custom_reward_path is None:
            problems.append(f"runtime {runtime!r} needs --reward-scorer-path, [reward.scorers] "
                            "or --custom-reward-path")
    resolved = _resolve_device(runtime, device, problems)
    if problems:
        raise ValueError("reward configuration: " + "; ".join(problems))

    scorers: list[RewardScorer] = []
    if runtime == "remote":
        remote_kwargs = dict(remote_kwargs)
        components = remote_kwargs.pop("components", None)
        if specs:
            components = tuple(c for s in specs for c in scorer_class(s.path).components)
        scorers.append(RemoteScorer(endpoint, components=components, timeout_s=timeout_s,
                                    max_retries=max_retries, **remote_kwargs))
    for spec in specs if runtime != "remote" else ():
        model_key = f"{spec.where}.model_path" if spec.weight is not None else \
            "--reward-model-path"
        scorer = _instantiate(scorer_class(spec.path), model_path=spec.model_path,
                              device=resolved, kwargs=spec.options, dotpath=spec.path,
                              model_key=model_key)
        if spec.weight is not None:
            scorer.name = spec.where
        if spec.frame_aggregation is not None:  # else the video default (mean) applies
            scorer.frame_rule = FrameRule(spec.frame_aggregation, spec.frames)
        scorers.append(scorer)
    if custom_reward_path is not None:
        scorers.append(FunctionScorer.from_dotpath(custom_reward_path,
                                                   device=resolved or torch.device("cpu"),
                                                   timeout_s=custom_timeout_s))
    manager = RewardManager(scorers, runtime=runtime, device=resolved)
    manager.weights, manager.required = dict(weights or {}), list(required)
    return manager
