"""The request half of the rollout wire: ``build_request`` turns prompts, candidate ids and
the sampling config into the request drawn in ``trainer.models.wire``. Every problem is
collected and raised as ONE ValueError naming them all."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from flowgrpo_kernels.sde_types import undefined_step_problems
from trainer.config.sampling import SamplingConfig
from trainer.models import noise
from trainer.models.geometry import Geometry
from trainer.models.wire.model import WireModel
from trainer.utils.values import is_int

ROLLOUT_PATH = "/rollout/generate"  # where an engine serves the request (SGLang's path)
# extra_sampling_params key of the per-candidate reference images (trainer.models.wire)
CONDITION_IMAGES_KEY = "condition_images"


def sampling_geometry(cfg: SamplingConfig) -> Geometry:
    """The candidates' geometry under a sampling config: frames from its ``num_frames`` where
    it has one (a video family's sampling key), else 1 (images)."""
    return Geometry(cfg.height, cfg.width, getattr(cfg, "num_frames", 1))


def _condition_entries(adapter: WireModel, images: Sequence[Sequence[Any]] | None, batch: int,
                       problems: list[str]) -> list[list[str]] | None:
    """Per-candidate reference images as their ``ImageRef.entry`` strings (paths or data URIs:
    plain JSON, so the HTTP engine carries them as they are); None when no candidate has any,
    so a text-to-image request is exactly what it was. The family's own rule on how many it
    takes is checked here too."""
    if images is not None:
        images = [tuple(refs) for refs in images]
        if len(images) != batch:
            problems.append(f"{len(images)} reference-image lists for {batch} candidates")
            return None
        if not any(images):
            images = None
    problems += adapter.condition_image_problems(images)
    if images is None:
        return None
    entries = []
    for row, refs in enumerate(images):
        names = [getattr(ref, "entry", ref) for ref in refs]
        if not all(isinstance(n, str) and n for n in names):
            problems.append(f"candidate {row}: reference images must be ImageRefs or entry strings")
        entries.append(names)
    return entries


def _candidate_problems(prompts: list, sample_ids: list) -> list[str]:
    """Prompts are strings, one non-empty unique sample id per candidate."""
    problems = []
    batch = len(prompts)
    if batch == 0:
        problems.append("no prompts: a rollout request needs at least one candidate")
    bad_prompts = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad_prompts:
        problems.append(f"prompts at positions {bad_prompts} are not strings")
    if len(sample_ids) != batch:
        problems.append(f"{len(sample_ids)} sample ids for {batch} prompts (one per candidate)")
    bad_ids = [i for i, s in enumerate(sample_ids) if not isinstance(s, str) or not s]
    if bad_ids:
        problems.append(f"sample ids at positions {bad_ids} are not non-empty strings")
    dupes = sorted({s for s in sample_ids if isinstance(s, str) and sample_ids.count(s) > 1})
    if dupes:
        problems.append(f"duplicate sample ids {dupes[:5]}: candidates with one id get identical noise")
    return problems


def _resolve_sde_steps(cfg: SamplingConfig, indices: Any, steps: int,
                       problems: list[str]) -> tuple[list[int], bool]:
    """(sorted unique SDE steps, deterministic); problems appended."""
    resolved: list[int] = []
    deterministic = cfg.sde_step_mode == "ode"  # ODE sampling (evaluation): no SDE step
    if deterministic and indices:
        problems.append(f"sde_step_mode='ode' samples without noise, got SDE steps {list(indices)}")
    elif deterministic:
        pass
    elif indices is None or (isinstance(indices, (list, tuple)) and len(indices) == 0):
        problems.append("no SDE steps: pass the driver's resolved indices (sde_indices=...) or "
                        "set the sampling config's steps; an empty set leaves nothing to train")
    elif not isinstance(indices, (list, tuple)) or not all(is_int(i) for i in indices):
        problems.append(f"sde_indices must be a list of integers, got {indices!r}")
    else:
        resolved = sorted(set(int(i) for i in indices))
        out_of_range = [i for i in resolved if not 0 <= i < steps]
        if out_of_range:
            problems.append(f"sde_indices {out_of_range} are outside [0, {steps}) "
                            f"for num_inference_steps={steps}")
    return resolved, deterministic


def _schedule(adapter: WireModel, cfg: SamplingConfig, resolved: list[int],
              problems: list[str]) -> torch.Tensor:
    """The fp32 sigma schedule; noisy steps where the SDE type has no density are refused
    (flowgrpo_kernels.sde_types)."""
    steps = cfg.num_inference_steps
    sigmas = adapter.scheduler_sigmas(steps, sampling_geometry(cfg)).to(torch.float32)
    problems += [f"sde_indices: {p}" for p in undefined_step_problems(
        cfg.sde_type, cfg.eta, resolved, sigmas.tolist(), sigma_one=cfg.sigma_one,
        log_prob_form=cfg.log_prob_form)]
    return sigmas


def _groups(prompts: list, group_index: Sequence[int] | None, problems: list[str]) -> list:
    """Each candidate's prompt group: given, or one group per distinct prompt in order of
    first appearance."""
    batch = len(prompts)
    if group_index is None:
        if any(not isinstance(p, str) for p in prompts):
            return []  # reported with the prompts
        first_seen: dict[str, int] = {}
        return [first_seen.setdefault(p, len(first_seen)) for p in prompts]
    group = list(group_index)
    if len(group) != batch or not all(is_int(g) and g >= 0 for g in group):
        problems.append(f"group_index must hold {batch} non-negative integers, got {group_index!r}")
    return group


def _latent_shapes(adapter: WireModel, cfg: SamplingConfig,
                   problems: list[str]) -> tuple[list[int], list[int]]:
    """(latent shape, x_T draw shape) at the request's geometry."""
    latent_shape = list(adapter.latent_shape(sampling_geometry(cfg)))
    init_shape = list(adapter.init_noise_shape(sampling_geometry(cfg)))
    override = cfg.init_noise_latent_shape
    if override is not None and (not isinstance(override, (list, tuple)) or list(override) != init_shape):
        problems.append(f"init_noise_latent_shape {override!r} does not match this model's "
                        f"x_T shape {init_shape} at {sampling_geometry(cfg)}")
    return latent_shape, init_shape


def _extra_sampling_params(adapter: WireModel, cfg: SamplingConfig,
                           sample_ids: list[str], group: list, *, rollout_id: int | None,
                           seed: int, resolved: list[int], trained: list[int],
                           sigmas: torch.Tensor, latent_shape: list[int],
                           init_shape: list[int]) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "sample_ids": sample_ids,
        "group_index": [int(g) for g in group],
        "rollout_id": rollout_id,
        "model_family": adapter.family,
        "latent_shape": latent_shape,
        "init_noise_latent_shape": init_shape,
    }
    # Flow-GRPO options the engine applies in sde_step (absent: the defaults, so a request
    # without them means what it meant before they existed)
    extra["sigma_one"] = cfg.sigma_one
    extra["log_prob_form"] = cfg.log_prob_form
    if trained != resolved:
        extra["train_step_indices"] = trained  # noise at every step, train these (pack keeps them)
    if cfg.driver_sigmas:
        extra["sigmas"] = [float(s) for s in sigmas.tolist()]
    if cfg.driver_xt:
        extra["noise_recipe"] = noise.RECIPE
        extra["initial_noise_seed"] = int(seed)
        if cfg.init_same_noise and rollout_id is not None:
            # training rollouts only: eval (rollout_id None) keeps one x_T per candidate, so
            # its numbers do not depend on this training-side choice
            first_of_group: dict[int, str] = {}
            extra["initial_noise_ids"] = [first_of_group.setdefault(int(g), sid)
                                          for g, sid in zip(group, sample_ids)]
    return extra


def build_request(adapter: WireModel, prompts: Sequence[str],
                  sample_ids: Sequence[str], sampling: Mapping[str, Any], *,
                  rollout_id: int | None, seed: int,
                  sde_indices: Sequence[int] | None = None,
                  group_index: Sequence[int] | None = None,
                  images: Sequence[Sequence[Any]] | None = None) -> dict[str, Any]:
    """See ``GenerativeModelAdapter.build_rollout_request`` (``sampling``: a SamplingConfig or
    its table); raises one ValueError listing all problems."""
    cfg, problems = SamplingConfig.check(sampling)
    if cfg is None:  # the SDE steps cannot be resolved: nothing below can be checked
        raise ValueError(f"invalid rollout request for {adapter.family!r}:\n  - " + "\n  - ".join(problems))

    prompts, sample_ids = list(prompts), list(sample_ids)
    problems += _candidate_problems(prompts, sample_ids)
    geometry_ok = not any(p.startswith(("height", "width")) for p in problems)
    if geometry_ok:
        resolution = adapter.resolution_problems(sampling_geometry(cfg))
        problems += resolution
        geometry_ok = not resolution
    try:
        adapter.check_guidance(cfg.guidance_scale)
    except ValueError as exc:
        problems.append(str(exc))
    if rollout_id is not None and not is_int(rollout_id):
        problems.append(f"rollout_id must be an integer or None, got {rollout_id!r}")
    if not is_int(seed):
        problems.append(f"seed must be an integer, got {seed!r}")

    indices = sde_indices if sde_indices is not None else cfg.noise_steps(rollout_id)
    resolved, deterministic = _resolve_sde_steps(cfg, indices, cfg.num_inference_steps, problems)
    trained = cfg.trained_steps(resolved)
    if resolved and not trained:
        problems.append(f"none of the noise steps {resolved} is trained (timestep_fraction="
                        f"{cfg.timestep_fraction})")
    sigmas = _schedule(adapter, cfg, resolved, problems) if geometry_ok else None
    group = _groups(prompts, group_index, problems)
    entries = _condition_entries(adapter, images, len(prompts), problems)
    latent_shape, init_shape = _latent_shapes(adapter, cfg, problems) if geometry_ok \
        else (None, None)
    if problems:
        raise ValueError(f"invalid rollout request for {adapter.family!r}:\n  - " + "\n  - ".join(problems))

    extra = _extra_sampling_params(adapter, cfg, sample_ids, group, rollout_id=rollout_id,
                                   seed=seed, resolved=resolved, trained=trained, sigmas=sigmas,
                                   latent_shape=latent_shape, init_shape=init_shape)
    if entries is not None:
        extra[CONDITION_IMAGES_KEY] = entries
    return {
        "prompt": prompts,
        "seed": int(seed),
        **sampling_geometry(cfg).request_fields(),
        "num_inference_steps": cfg.num_inference_steps,
        "guidance_scale": float(cfg.guidance_scale),
        "rollout": not deterministic,
        "rollout_sde_type": cfg.sde_type,
        "rollout_noise_level": float(cfg.eta),
        "rollout_sde_step_indices": resolved,
        "rollout_return_dit_trajectory": True,
        "rollout_return_denoising_env": True,
        "extra_sampling_params": extra,
    }
