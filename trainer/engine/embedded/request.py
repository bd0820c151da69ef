"""The engine's own reading of a rollout request: every check, one error listing every problem.

The driver's requests are built and checked by the adapter (``trainer.models.wire``), but the
engine also serves HTTP, where anything may arrive, so it validates independently and turns a
request into a ``GenerateSpec``. Two request shapes are accepted, both SGLang's field names:

- batched (``trainer.models.wire``): ``prompt`` is a list, one entry per candidate, with
  ``extra_sampling_params.sample_ids`` of the same length. Answered with one batched response.
- SGLang's single-prompt form: ``prompt`` is a string and ``num_outputs_per_prompt`` (default
  1, or the number of sample ids) candidates share it. Answered over HTTP with SGLang's list of
  per-output responses.

Defaults where the request (or SGLang) leaves a field out, documented here: ``seed`` 0; ``rollout`` true; ``rollout_sde_type`` "sde"; ``rollout_noise_level`` 0.7
(the rollout-side default, docs/design.md#sampling-and-the-sde-step); ``rollout_sde_step_indices`` absent means every step (SGLang's
meaning), which ``sde`` then rejects for step 0; ``sigmas`` absent means the adapter's own
schedule; sample ids absent means ``"seed:<seed>:<k>"``; ``rollout_return_dit_trajectory`` and
``rollout_return_denoising_env`` false (SGLang's defaults; the adapter's requests set both). ``rollout: false`` samples pure ODE and
returns no SDE steps. A sigma list of N values (SGLang's convention, no trailing 0) is completed
with 0.0. ``num_frames`` absent means 1 (an image). ``extra_sampling_params.condition_images``
(one list of image entries per candidate) is checked against the family's
``condition_image_problems``; its images are decoded when the adapter encodes them, where a
missing or broken one fails the request naming it.
"""
from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from flowgrpo_kernels.sde_types import (LOG_PROB_FORMS, SDE_TYPES, SIGMA_ONE_TREATMENTS, TABLE,
                                        undefined_step_problems)
from trainer.media import ImageRef
from trainer.models import noise
from trainer.models.base import GenerativeModelAdapter
from trainer.models.geometry import Geometry
from trainer.models.wire import CONDITION_IMAGES_KEY
from trainer.utils.values import is_int, is_number

DEFAULT_ETA = 0.7


class RequestError(ValueError):
    """A request the engine cannot serve; ``problems`` lists every reason (HTTP 400)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid rollout request:\n  - " + "\n  - ".join(self.problems))

    def __reduce__(self):
        # pickled across the engine process boundary: rebuild from the list, not the message
        # (the default would pass the message string, split into characters by list())
        return (RequestError, (self.problems,))


@dataclass
class GenerateSpec:
    """A validated request: what the sampler needs, in plain Python values."""

    prompts: list[str]
    sample_ids: list[str]
    seed: int
    geometry: Geometry
    condition_images: list[tuple[ImageRef, ...]] | None  # per candidate; None: text only
    sigmas: list[float]              # N + 1 values, 1 >= s_0 > ... > s_N == 0
    sde_indices: list[int]           # sorted, unique, in [0, N)
    sde_type: str
    eta: float
    driver_xt: bool                  # draw x_T and step noise with trainer.models.noise
    noise_seed: int
    initial_noise_ids: list[str] | None = None  # x_T ids (driver's init_same_noise); None = sample_ids
    return_trajectory: bool = False
    return_env: bool = False
    single_prompt: bool = False      # SGLang's prompt-string form (HTTP replies a list)
    guidance_scale: float = 1.0      # > 1: CFG against the empty prompt (trainer.models.guidance)
    sigma_one: str = "refuse"        # a step at sigma == 1 (flowgrpo_kernels.sde_types)
    log_prob_form: str = "gaussian"  # kernels.sde_log_prob's form
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    @property
    def num_steps(self) -> int:
        return len(self.sigmas) - 1

    def sde_options(self) -> dict[str, str]:
        """kernels.sde_step keywords beyond eta and sde_type."""
        return {"sigma_one": self.sigma_one, "log_prob_form": self.log_prob_form}


def _get_bool(req: Mapping[str, Any], key: str, default: bool, problems: list[str]) -> bool:
    value = req.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        problems.append(f"{key} must be true or false, got {value!r}")
        return default
    return value


def _candidates(request: Mapping[str, Any], extra: Mapping[str, Any], problems: list[str]
                ) -> tuple[list[str], list[str], bool, int]:
    """(prompts, sample ids, single-prompt form, seed): one prompt and one id per candidate."""
    prompt = request.get("prompt")
    sample_ids = extra.get("sample_ids")
    single = isinstance(prompt, str)
    if sample_ids is not None and (not isinstance(sample_ids, list) or not all(
            isinstance(s, str) and s for s in sample_ids)):
        problems.append("extra_sampling_params.sample_ids must be a list of non-empty strings")
        sample_ids = None
    n_outputs = request.get("num_outputs_per_prompt")
    if n_outputs is not None and (not is_int(n_outputs) or n_outputs < 1):
        problems.append(f"num_outputs_per_prompt must be a positive integer, got {n_outputs!r}")
        n_outputs = None
    prompts: list[str] = []
    if single:
        count = len(sample_ids) if sample_ids is not None else (n_outputs or 1)
        if sample_ids is not None and n_outputs is not None and n_outputs != len(sample_ids):
            problems.append(f"num_outputs_per_prompt={n_outputs} but {len(sample_ids)} sample ids")
        prompts = [prompt] * count
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
        if n_outputs not in (None, 1):
            problems.append("num_outputs_per_prompt applies to a single prompt string; with a "
                            "prompt list send one entry per candidate")
    else:
        problems.append("prompt must be a string or a non-empty list of strings, got "
                        f"{prompt!r}"[:200])
    seed = request.get("seed", 0)
    if not is_int(seed):
        problems.append(f"seed must be an integer, got {seed!r}")
        seed = 0
    if sample_ids is None:
        sample_ids = [f"seed:{seed}:{k}" for k in range(len(prompts))]
    elif prompts and len(sample_ids) != len(prompts):
        problems.append(f"{len(sample_ids)} sample ids for {len(prompts)} prompts (one per candidate)")
    dupes = sorted(s for s, c in Counter(sample_ids).items() if c > 1)
    if dupes:
        problems.append(f"duplicate sample ids {dupes[:5]}: their candidates would be identical")
    return prompts, sample_ids, single, seed


def _geometry(adapter: GenerativeModelAdapter, request: Mapping[str, Any],
              extra: Mapping[str, Any], problems: list[str]) -> tuple[Geometry | None, Any]:
    """(geometry or None when invalid, num_inference_steps), guidance and the model family
    checked."""
    height, width, steps = request.get("height"), request.get("width"), request.get("num_inference_steps")
    frames = request.get("num_frames", 1)
    geometry_ok = True
    for key, value in (("height", height), ("width", width), ("num_frames", frames),
                       ("num_inference_steps", steps)):
        if not is_int(value) or value <= 0:
            problems.append(f"{key} must be a positive integer, got {value!r}")
            geometry_ok = False
    geometry = Geometry(int(height), int(width), int(frames)) if geometry_ok else None
    if geometry is not None:
        resolution = adapter.resolution_problems(geometry)
        problems += resolution
        geometry_ok = not resolution
    for key in ("guidance_scale", "true_cfg_scale"):
        if request.get(key) is not None:
            try:
                adapter.check_guidance(request[key])
            except ValueError as exc:
                problems.append(f"{key}: {exc}")
    family = extra.get("model_family")
    if family is not None and family != adapter.family:
        problems.append(f"the request was built for model family {family!r}, this engine serves "
                        f"{adapter.family!r}")
    if geometry_ok:
        for key, want in (("latent_shape", adapter.latent_shape(geometry)),
                          ("init_noise_latent_shape", adapter.init_noise_shape(geometry))):
            got = extra.get(key)
            if got is not None and list(got) != list(want):
                problems.append(f"extra_sampling_params.{key} {list(got)} does not match this "
                                f"model's {list(want)} at {geometry}")
    return (geometry if geometry_ok else None), steps


def _condition_images(adapter: GenerativeModelAdapter, extra: Mapping[str, Any], batch: int,
                      problems: list[str]) -> list[tuple[ImageRef, ...]] | None:
    """The candidates' reference images (``condition_images`` entries), None when absent;
    how many the family takes is the adapter's rule. Decoding waits for the encode, where a
    bad image fails the request with the image named."""
    raw = extra.get(CONDITION_IMAGES_KEY)
    images = None
    if raw is not None:
        if not isinstance(raw, list) or len(raw) != batch or not all(
                isinstance(refs, list) and all(isinstance(e, str) and e for e in refs)
                for refs in raw):
            problems.append(f"extra_sampling_params.{CONDITION_IMAGES_KEY} must be {batch} lists "
                            "(one per candidate) of image entries (paths or data URIs)")
            return None
        images = [tuple(ImageRef(entry) for entry in refs) for refs in raw]
    problems += adapter.condition_image_problems(images)
    return images


def _schedule(adapter: GenerativeModelAdapter, extra: Mapping[str, Any], steps: Any,
              geometry: Geometry | None, problems: list[str]) -> list[float]:
    """The driver's sigmas (N, or N + 1 values), else the adapter's schedule."""
    sigmas: list[float] = []
    raw_sigmas = extra.get("sigmas")
    if raw_sigmas is not None:
        if not isinstance(raw_sigmas, list) or not all(is_number(s) for s in raw_sigmas):
            problems.append("extra_sampling_params.sigmas must be a list of finite numbers")
        else:
            sigmas = [float(s) for s in raw_sigmas]
            if is_int(steps) and len(sigmas) == steps and sigmas and sigmas[-1] > 0.0:
                sigmas.append(0.0)  # SGLang's convention: N values, the final 0 implied
            if is_int(steps) and len(sigmas) != steps + 1:
                problems.append(f"extra_sampling_params.sigmas has {len(raw_sigmas)} values, "
                                f"expected num_inference_steps + 1 = {steps + 1}")
                sigmas = []
            elif sigmas and not (sigmas[0] <= 1.0 and sigmas[-1] == 0.0 and all(
                    a > b for a, b in zip(sigmas, sigmas[1:]))):
                problems.append("extra_sampling_params.sigmas must decrease strictly from <= 1.0 "
                                "to 0.0")
                sigmas = []
    elif geometry is not None:
        sigmas = [float(s) for s in adapter.scheduler_sigmas(steps, geometry).tolist()]
    return sigmas


def _sde(request: Mapping[str, Any], extra: Mapping[str, Any], steps: Any, sigmas: list[float],
         problems: list[str]) -> tuple[list[int], Any, Any, Any, Any]:
    """(SDE step indices, sde_type, eta, sigma_one, log_prob_form)."""
    rollout = _get_bool(request, "rollout", True, problems)
    sde_type = request.get("rollout_sde_type", "sde")
    if sde_type not in SDE_TYPES:
        problems.append(f"rollout_sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    eta = request.get("rollout_noise_level", DEFAULT_ETA)
    if not is_number(eta) or eta < 0:
        problems.append(f"rollout_noise_level must be a finite number >= 0, got {eta!r}")
        eta = 0.0
    indices: list[int] = []
    raw_idx = request.get("rollout_sde_step_indices")
    if not rollout:
        indices = []
    elif raw_idx is None:
        indices = list(range(steps)) if is_int(steps) and steps > 0 else []
    elif not isinstance(raw_idx, list) or not all(is_int(i) for i in raw_idx):
        problems.append(f"rollout_sde_step_indices must be a list of integers, got {raw_idx!r}")
    else:
        indices = list(raw_idx)
        if indices != sorted(set(indices)):
            problems.append(f"rollout_sde_step_indices must be sorted and unique, got {indices}")
        if is_int(steps):
            bad = [i for i in indices if not 0 <= i < steps]
            if bad:
                problems.append(f"rollout_sde_step_indices {bad} outside [0, {steps})")
    sigma_one = extra.get("sigma_one", "refuse")
    if sigma_one not in SIGMA_ONE_TREATMENTS:
        problems.append(f"extra_sampling_params.sigma_one must be one of {SIGMA_ONE_TREATMENTS}, "
                        f"got {sigma_one!r}")
    log_prob_form = extra.get("log_prob_form", "gaussian")
    if log_prob_form not in LOG_PROB_FORMS:
        problems.append(f"extra_sampling_params.log_prob_form must be one of {LOG_PROB_FORMS}, "
                        f"got {log_prob_form!r}")
    row = TABLE[sde_type] if sde_type in SDE_TYPES else None
    if row is not None and row.eta_problem(float(eta), noise_required=False):
        problems.append(f"rollout_noise_level: {row.eta_problem(float(eta), noise_required=False)}")
    if row is not None and sigmas and sigma_one in SIGMA_ONE_TREATMENTS and \
            log_prob_form in LOG_PROB_FORMS:
        problems += [f"rollout_sde_step_indices: {p}" for p in undefined_step_problems(
            sde_type, float(eta), indices, sigmas, sigma_one=sigma_one, log_prob_form=log_prob_form)]
    if rollout and indices and float(eta) == 0.0:
        problems.append("rollout_noise_level is 0 but SDE steps were requested: an eta == 0 step "
                        "is deterministic and has no log-prob")
    return indices, sde_type, eta, sigma_one, log_prob_form


def _driver_noise(extra: Mapping[str, Any], seed: int, sample_ids: list[str],
                  problems: list[str]) -> tuple[Any, Any, Any]:
    """(noise recipe, its seed, x_T ids) when the driver draws the noise."""
    recipe = extra.get("noise_recipe")
    if recipe is not None and recipe != noise.RECIPE:
        problems.append(f"extra_sampling_params.noise_recipe {recipe!r} is not this engine's "
                        f"{noise.RECIPE!r}: x_T and step noise would not be reproducible")
    noise_seed = extra.get("initial_noise_seed", seed)
    if not is_int(noise_seed):
        problems.append(f"extra_sampling_params.initial_noise_seed must be an integer, got {noise_seed!r}")
        noise_seed = 0
    init_ids = extra.get("initial_noise_ids")
    if init_ids is not None:
        if recipe is None:
            problems.append("extra_sampling_params.initial_noise_ids needs the driver's noise_recipe")
        if not isinstance(init_ids, list) or len(init_ids) != len(sample_ids) or \
                not all(isinstance(s, str) and s for s in init_ids):
            problems.append(f"extra_sampling_params.initial_noise_ids must be {len(sample_ids)} "
                            f"non-empty strings (one per candidate), got {init_ids!r}"[:300])
    return recipe, noise_seed, init_ids


def parse_generate_request(adapter: GenerativeModelAdapter, request: Any) -> GenerateSpec:
    """Validate ``request`` against this engine's adapter; raise ``RequestError`` listing all."""
    if not isinstance(request, Mapping):
        raise RequestError([f"the request must be a JSON object, got {type(request).__name__}"])
    problems: list[str] = []
    extra = request.get("extra_sampling_params") or {}
    if not isinstance(extra, Mapping):
        problems.append(f"extra_sampling_params must be an object, got {type(extra).__name__}")
        extra = {}
    prompts, sample_ids, single, seed = _candidates(request, extra, problems)
    geometry, steps = _geometry(adapter, request, extra, problems)
    sigmas = _schedule(adapter, extra, steps, geometry, problems)
    images = _condition_images(adapter, extra, len(prompts), problems)
    indices, sde_type, eta, sigma_one, log_prob_form = _sde(request, extra, steps, sigmas,
                                                            problems)
    recipe, noise_seed, init_ids = _driver_noise(extra, seed, sample_ids, problems)
    return_traj = _get_bool(request, "rollout_return_dit_trajectory", False, problems)
    return_env = _get_bool(request, "rollout_return_denoising_env", False, problems)
    if problems:
        raise RequestError(problems)
    return GenerateSpec(
        prompts=prompts, sample_ids=list(sample_ids), seed=int(seed), geometry=geometry,
        condition_images=images, sigmas=sigmas, sde_indices=indices, sde_type=str(sde_type),
        eta=float(eta), driver_xt=recipe is not None, noise_seed=int(noise_seed),
        initial_noise_ids=None if init_ids is None else list(init_ids),
        return_trajectory=return_traj, return_env=return_env, single_prompt=single,
        guidance_scale=float(request.get("guidance_scale") or 1.0), sigma_one=str(sigma_one),
        log_prob_form=str(log_prob_form),
        request_id=str(request.get("request_id") or uuid.uuid4().hex[:16]))
