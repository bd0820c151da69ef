"""The response half of the rollout wire: decoding, every check against its request (one
ValueError naming every problem), and packing into the RolloutBatch the reward and the actor
take. The schema is drawn in ``trainer.models.wire``."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from trainer.media import ImageRef
from trainer.models.batch import RolloutBatch
from trainer.models.geometry import Geometry
from trainer.models.guidance import NEGATIVE_PREFIX
from trainer.models.wire.codec import TENSOR_TAG, decode_tensor
from trainer.models.wire.model import WireModel
from trainer.models.wire.request import CONDITION_IMAGES_KEY
from trainer.utils.values import is_int

ROLLOUT_RESPONSE_FIELDS = ("rollout_log_probs", "dit_trajectory", "denoising_env", "sde_indices",
                           "height", "width", "sample_ids", "images", "policy_version")


def _as_tensor(value: Any, where: str, problems: list[str], dtype: torch.dtype | None = None):
    """A response field as a tensor (tagged blob or nested list accepted), or None + a problem."""
    try:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, Mapping) and TENSOR_TAG in value:
            return decode_tensor(value)
        if isinstance(value, (list, tuple)):
            t = torch.tensor(value, dtype=dtype)
            return t.float() if dtype is None and t.is_floating_point() else t
        problems.append(f"{where} must be a tensor (or a tagged/nested-list JSON tensor), "
                        f"got {type(value).__name__}")
    except Exception as exc:  # ragged lists, bad base64, bad safetensors header
        problems.append(f"{where} could not be decoded as a tensor: {exc}")
    return None


def coerce_response(response: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The response with every tensor field as a torch.Tensor, plus the decoding problems."""
    problems: list[str] = []
    out = dict(response)
    if "rollout_log_probs" in out:
        out["rollout_log_probs"] = _as_tensor(out["rollout_log_probs"], "rollout_log_probs", problems)
    traj = out.get("dit_trajectory")
    if isinstance(traj, Mapping):
        traj = dict(traj)
        for key in ("latents", "timesteps", "sigmas", "final"):  # final: x_0, optional
            if key in traj:
                traj[key] = _as_tensor(traj[key], f"dit_trajectory.{key}", problems)
        out["dit_trajectory"] = traj
    env = out.get("denoising_env")
    if isinstance(env, Mapping):
        out["denoising_env"] = {k: _as_tensor(v, f"denoising_env.{k}", problems) for k, v in env.items()}
    if out.get("images") is not None:
        out["images"] = _as_tensor(out["images"], "images", problems, dtype=torch.uint8)
    return out, problems


# ---- response ---------------------------------------------------------------------------
_REQUEST_KEYS = ("prompt", "height", "width", "num_inference_steps", "rollout_sde_type",
                 "rollout_noise_level", "rollout_sde_step_indices", "extra_sampling_params")


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _echo_problems(resp: dict[str, Any], request: Mapping[str, Any]) -> list[str]:
    """The echoes of the request: height, width and the SDE steps."""
    problems: list[str] = []
    echoed = request.get("num_frames") is not None
    indices = list(request["rollout_sde_step_indices"])
    for key in ("height", "width", *(("num_frames",) if echoed else ())):
        want = request[key]
        if key not in resp:
            problems.append(f"missing '{key}': the engine must echo it (the latent grid comes from it)")
        elif not is_int(resp[key]) or resp[key] != want:
            problems.append(f"'{key}' is {resp[key]!r}, the request asked for {want}")
    if "sde_indices" not in resp:
        problems.append("missing 'sde_indices'")
    elif not isinstance(resp["sde_indices"], (list, tuple)) or list(resp["sde_indices"]) != indices:
        problems.append(f"'sde_indices' is {resp['sde_indices']!r}, the request asked for {indices}")
    return problems


def _log_prob_problems(resp: dict[str, Any], batch: int, n_sde: int) -> list[str]:
    problems: list[str] = []
    logp = resp.get("rollout_log_probs")
    if "rollout_log_probs" not in resp:
        problems.append("missing 'rollout_log_probs'")
    elif isinstance(logp, torch.Tensor):
        if _shape(logp) != [batch, n_sde]:
            problems.append(f"'rollout_log_probs' has shape {_shape(logp)}, expected [{batch}, {n_sde}] "
                            "(candidates x SDE steps)")
        elif not logp.is_floating_point() or not bool(torch.isfinite(logp).all()):
            problems.append("'rollout_log_probs' must be finite floats")
    return problems


def _trajectory_problems(adapter: WireModel, traj: Mapping[str, Any],
                         request: Mapping[str, Any]) -> list[str]:
    """Latents [B, S, 2, *latent], sigmas [N+1] (the request's when it sent them) and the
    family's timesteps of those sigmas."""
    problems: list[str] = []
    extra = request["extra_sampling_params"]
    batch, steps = len(request["prompt"]), request["num_inference_steps"]
    n_sde = len(request["rollout_sde_step_indices"])
    lat = traj.get("latents")
    want_lat = [batch, n_sde, 2, *adapter.latent_shape(Geometry.from_request(request))]
    if "latents" not in traj:
        problems.append("missing 'dit_trajectory.latents'")
    elif isinstance(lat, torch.Tensor):
        if _shape(lat) != want_lat:
            problems.append(f"'dit_trajectory.latents' has shape {_shape(lat)}, expected {want_lat} "
                            "([B, S, (x_i, x_i+1), *latent] at the requested height/width)")
        elif not lat.is_floating_point() or not bool(torch.isfinite(lat).all()):
            problems.append("'dit_trajectory.latents' must be finite floats")
    sig = traj.get("sigmas")
    if "sigmas" not in traj:
        problems.append("missing 'dit_trajectory.sigmas'")
    elif isinstance(sig, torch.Tensor):
        sig = sig.to(torch.float32).cpu()  # compared with the request's host values
        if _shape(sig) != [steps + 1]:
            problems.append(f"'dit_trajectory.sigmas' has shape {_shape(sig)}, expected [{steps + 1}]")
        elif "sigmas" in extra:
            sent = torch.tensor(extra["sigmas"], dtype=torch.float32)
            if not torch.allclose(sig, sent, rtol=0, atol=1e-6):
                problems.append("'dit_trajectory.sigmas' differ from the sigmas the request sent "
                                "(the engine must use driver sigmas as given, without shifting)")
        elif not (bool((sig[1:] < sig[:-1]).all()) and float(sig[-1]) == 0.0 and float(sig[0]) <= 1.0):
            problems.append("'dit_trajectory.sigmas' must decrease from <= 1.0 to 0.0")
    ts = traj.get("timesteps")
    if "timesteps" not in traj:
        problems.append("missing 'dit_trajectory.timesteps'")
    elif isinstance(ts, torch.Tensor):
        if _shape(ts) != [steps]:
            problems.append(f"'dit_trajectory.timesteps' has shape {_shape(ts)}, expected [{steps}]")
        elif isinstance(sig, torch.Tensor) and _shape(sig) == [steps + 1]:
            want_ts = adapter.timesteps_from_sigmas(sig)
            if not torch.allclose(ts.to(torch.float32).cpu(), want_ts, rtol=1e-5, atol=1e-5):
                problems.append("'dit_trajectory.timesteps' are not the family's timesteps of "
                                "'dit_trajectory.sigmas'")
    return problems


def _denoising_env_problems(adapter: WireModel, resp: dict[str, Any],
                            request: Mapping[str, Any]) -> list[str]:
    """The frozen conditions: every condition key (and its negative half under CFG), batch-first."""
    problems: list[str] = []
    batch = len(request["prompt"])
    env = resp.get("denoising_env")
    if request.get("rollout_return_denoising_env"):
        if not isinstance(env, Mapping):
            problems.append("missing 'denoising_env' (the frozen conditions the actor replays with)"
                            if env is None else f"'denoising_env' must be a dict, got {type(env).__name__}")
        else:
            wanted = list(adapter.condition_keys)
            if float(request.get("guidance_scale", 1.0)) != 1.0:  # CFG: the empty-prompt halves
                wanted += [NEGATIVE_PREFIX + k for k in adapter.condition_keys]
            missing = [k for k in wanted if k not in env]
            if missing:
                problems.append(f"'denoising_env' lacks {missing} (needs {wanted})")
            for key, value in env.items():
                if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] != batch):
                    problems.append(f"'denoising_env.{key}' has shape {_shape(value)}, expected batch-first "
                                    f"[{batch}, ...]")
    return problems


def _optional_field_problems(resp: dict[str, Any], request: Mapping[str, Any]) -> list[str]:
    """sample_ids (echo), images and policy_version, when the response carries them."""
    problems: list[str] = []
    extra = request["extra_sampling_params"]
    batch, geometry = len(request["prompt"]), Geometry.from_request(request)
    echoed = resp.get("sample_ids", extra["sample_ids"])
    if not isinstance(echoed, (list, tuple)) or list(echoed) != list(extra["sample_ids"]):
        problems.append("'sample_ids' do not echo the request's sample ids in order")
    images = resp.get("images")
    if isinstance(images, torch.Tensor):
        frames = [geometry.frames] if geometry.is_video else []
        want_img = [batch, *frames, geometry.height, geometry.width, 3]
        if _shape(images) != want_img or images.dtype != torch.uint8:
            problems.append(f"'images' is {images.dtype} {_shape(images)}, expected uint8 {want_img}")
    if "policy_version" in resp and not is_int(resp["policy_version"]):
        problems.append(f"'policy_version' must be an integer, got {resp['policy_version']!r}")
    return problems


def response_problems(adapter: WireModel, response: Any,
                      request: Mapping[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    """Every way ``response`` fails ``request``; also returns the response with tensors decoded.

    NOTE: the finiteness checks are host syncs (one per checked tensor, once per response).
    """
    if not isinstance(response, Mapping):
        return None, [f"response must be a dict, got {type(response).__name__}"]
    missing_req = [k for k in _REQUEST_KEYS if k not in request]
    if missing_req:
        raise ValueError(f"the request lacks {missing_req}: build it with build_rollout_request")
    resp, problems = coerce_response(response)
    extra = request["extra_sampling_params"]
    if extra.get("model_family") != adapter.family:
        problems.append(f"request was built for family {extra.get('model_family')!r}, "
                        f"this adapter is {adapter.family!r}")
    problems += _echo_problems(resp, request)
    problems += _log_prob_problems(resp, len(request["prompt"]),
                                   len(request["rollout_sde_step_indices"]))
    traj = resp.get("dit_trajectory")
    if not isinstance(traj, Mapping):
        problems.append("missing 'dit_trajectory' (dict with latents, timesteps, sigmas)"
                        if traj is None else f"'dit_trajectory' must be a dict, got {type(traj).__name__}")
    else:
        problems += _trajectory_problems(adapter, traj, request)
    problems += _denoising_env_problems(adapter, resp, request)
    problems += _optional_field_problems(resp, request)
    return resp, problems


def validate_response(adapter: WireModel, response: Any,
                      request: Mapping[str, Any]) -> dict[str, Any]:
    """Raise one ValueError listing every problem; return the response with tensors decoded."""
    resp, problems = response_problems(adapter, response, request)
    if problems:
        raise ValueError(f"invalid rollout response for {adapter.family!r} "
                         f"({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n  - "
                         + "\n  - ".join(problems))
    return resp


def _sources(extra: Mapping[str, Any]) -> list[tuple[ImageRef, ...]] | None:
    """The request's per-candidate reference images (None: text-to-image)."""
    entries = extra.get(CONDITION_IMAGES_KEY)
    if entries is None:
        return None
    return [tuple(ImageRef(entry) for entry in refs) for refs in entries]


def pack(adapter: WireModel, response: Any, request: Mapping[str, Any]) -> "RolloutBatch":
    """Validate, then lay the response out as the RolloutBatch the reward and the actor take."""
    resp = validate_response(adapter, response, request)
    extra = request["extra_sampling_params"]
    traj = resp["dit_trajectory"]
    batch = len(request["prompt"])
    noise_steps = [int(i) for i in resp["sde_indices"]]
    trained = [int(i) for i in extra.get("train_step_indices", noise_steps)]
    # every_step sampling records every noisy step; the actor trains the first fraction only
    cols = torch.tensor([noise_steps.index(i) for i in trained], dtype=torch.long)
    idx = torch.tensor(trained, dtype=torch.long)
    sigmas = traj["sigmas"].to(torch.float32).cpu()
    latents = traj["latents"]
    logp = resp["rollout_log_probs"].to(torch.float32)
    if trained != noise_steps:
        latents = latents.index_select(1, cols.to(latents.device))
        logp = logp.index_select(1, cols.to(logp.device))
    return RolloutBatch(
        prompts=list(request["prompt"]),
        sample_ids=list(extra["sample_ids"]),
        group_index=torch.tensor(extra["group_index"], dtype=torch.long),
        sde_indices=trained,
        latents=latents[:, :, 0].contiguous(),
        next_latents=latents[:, :, 1].contiguous(),
        sigmas=sigmas[idx].expand(batch, -1).contiguous(),
        sigmas_next=sigmas[idx + 1].expand(batch, -1).contiguous(),
        log_probs=logp,
        conditions=dict(resp.get("denoising_env") or {}),
        height=int(resp["height"]),
        width=int(resp["width"]),
        frames=int(request.get("num_frames", 1)),
        sources=_sources(extra),
        eta=float(request["rollout_noise_level"]),
        sde_type=str(request["rollout_sde_type"]),
        images=resp.get("images"),
        policy_version=int(resp.get("policy_version", 0)),
        rollout_id=extra.get("rollout_id"),
        guidance_scale=float(request.get("guidance_scale", 1.0)),
        sde_options={"sigma_one": extra.get("sigma_one", "refuse"),
                     "log_prob_form": extra.get("log_prob_form", "gaussian")},
        final_latents=traj.get("final"),
        schedule=sigmas,
    )
