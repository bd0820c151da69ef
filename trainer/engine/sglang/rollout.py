"""Our rollout request/response (trainer/models/wire/) <-> SGLang's ``POST /rollout/generate``.

Facts of the released API (sglang 0.5.23, ``multimodal_gen/runtime/entrypoints/post_training``)
this module is written against:

- The request body is one ``RolloutRequest``: a single ``prompt`` string, ``seed``,
  ``width``/``height``, ``num_inference_steps``, ``num_outputs_per_prompt``, ``guidance_scale``,
  ``rollout_sde_type`` (``sde`` | ``cps`` | ``ode``), ``rollout_noise_level``,
  ``rollout_sde_step_indices``, ``rollout_return_dit_trajectory``,
  ``rollout_return_denoising_env``, ``rollout_debug_mode``, ``image_path`` (conditioning images
  as files the server reads: ``write_condition_images``). ``extra_sampling_params`` is merged
  into SGLang's ``SamplingParams``, so any key it does not know is an HTTP 400: stock requests
  carry none of ours.
- Output k of a request is seeded ``seed + k``. We send one output per request (multi-output
  requests are reported to crash on Qwen-Image upstream) with the seed ``sample_seed`` derives
  from the candidate's sample id, so every candidate of every rollout gets its own noise.
- The answer is a msgpack list of per-output responses; tensors are maps
  ``{"__tensor__": True, "data": <safetensors bytes>, "shape", "dtype"}``.
  ``rollout_log_probs`` is [T] (one value per denoising step, the mean over latent elements;
  0 on ODE steps), ``dit_trajectory.latents`` is [T+1, *latent] (x at every step, then the final
  latent), ``timesteps`` [T+1], ``sigmas`` [T+1]; ``denoising_env`` holds ``image_kwargs``,
  ``pos_cond_kwargs``, ``neg_cond_kwargs``, ``guidance``; ``generated_output`` is float in [0, 1].
  A video (``num_frames`` sent: Wan) comes back as float [3, F, H, W].
  ``height``, ``width``, ``sample_ids``, ``sde_indices`` and any weight version are not echoed:
  ``to_schema_response`` copies them from the request, so the adapter's echo checks do not test
  the server; what is checked here instead is the number of outputs and their seeds.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

#: rollout_sde_type values stock SGLang implements (its FlowRolloutController).
STOCK_SDE_TYPES = ("sde", "cps", "ode")


def family_tables(family: str) -> tuple[dict[str, tuple[str, str]], dict[str, str]] | None:
    """(our condition -> (denoising_env section, SGLang's kwarg), our mask -> the embeddings it
    masks) of ``family``, from its adapter's ``sglang_conditions`` / ``sglang_implied_masks``
    (trainer/models/<family>.py); None for a family SGLang does not serve for rollouts."""
    from trainer.models import ADAPTERS, adapter_class

    if family not in ADAPTERS:
        return None
    cls = adapter_class(family)
    conditions = getattr(cls, "sglang_conditions", None)
    if not conditions:
        return None
    return dict(conditions), dict(getattr(cls, "sglang_implied_masks", None) or {})


def sglang_families() -> list[str]:
    """The shipped families whose adapters say where SGLang keeps their conditions."""
    from trainer.models import ADAPTERS

    return sorted(f for f in ADAPTERS if f != "toy" and family_tables(f) is not None)


TENSOR_TAG = "__tensor__"


class SGLangResponseError(ValueError):
    """SGLang's answer cannot be mapped onto our schema; the message lists every problem."""


def sample_seed(seed: int, sample_id: str) -> int:
    """A seed for one candidate: a pure function of (run seed, sample id), < 2**31.

    SGLang seeds its generator with the request's ``seed``; deriving it from the id gives each
    candidate its own x_T and step noise, stable across engines and resumes."""
    digest = hashlib.sha256(f"{int(seed)}\0{sample_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFF_FFFF


def stock_problems(sampling: Mapping[str, Any], *, extension: bool) -> list[str]:
    """Why a --sampling-config cannot run on the SGLang servers ([] when it can): stock SGLang,
    or SGLang with ``trainer.engine.sglang.extension`` loaded (``extension``)."""
    problems = []
    hint = "(load the trainer's SGLang extension, see trainer/engine/README.md, or"
    sde_type = sampling.get("sde_type", "sde")
    driver_xt = sampling.get("driver_xt", True) is not False
    if sde_type not in STOCK_SDE_TYPES and not extension:
        problems.append(f"sampling.sde_type={sde_type!r}: stock SGLang implements "
                        f"{list(STOCK_SDE_TYPES)} only {hint} use 'sde')")
    elif sde_type not in STOCK_SDE_TYPES and not driver_xt:
        problems.append(f"sampling.sde_type={sde_type!r} runs on the extension's sampler, which "
                        "draws the driver's step noise: set sampling.driver_xt=true")
    if not extension and sampling.get("driver_sigmas", True) is not False:
        problems.append(f"sampling.driver_sigmas is on but stock SGLang takes no sigma schedule "
                        f"from a rollout request (its SamplingParams has no sigmas; the server "
                        f"shifts its own grid) {hint} set sampling.driver_sigmas=false: the "
                        f"server's schedule is echoed and replayed)")
    if not extension and driver_xt:
        problems.append(f"sampling.driver_xt is on but stock SGLang draws x_T and the step noise "
                        f"from its own seeded generator {hint} set sampling.driver_xt=false)")
    if not extension and sampling.get("init_same_noise"):
        problems.append("sampling.init_same_noise needs driver_xt, which stock SGLang lacks")
    guidance = sampling.get("guidance_scale", 1.0)
    if guidance not in (None, 1.0, 1):
        problems.append(f"sampling.guidance_scale={guidance!r}: the trainer replays one forward "
                        "per step, SGLang rollouts must run without CFG (1.0)")
    return problems


def extension_block(request: Mapping[str, Any], position: int) -> dict[str, Any]:
    """What ``trainer.engine.sglang.extension`` needs for candidate ``position``: the driver's
    noise keys when the request carries them, its sigmas when it carries them."""
    extra = request["extra_sampling_params"]
    block = {"sample_ids": [extra["sample_ids"][position]], "model_family": extra["model_family"],
             "latent_shape": list(extra["latent_shape"]), "sde_type": request["rollout_sde_type"]}
    if "noise_recipe" in extra:
        block.update(noise_recipe=extra["noise_recipe"],
                     initial_noise_seed=int(extra["initial_noise_seed"]),
                     init_noise_latent_shape=list(extra["init_noise_latent_shape"]))
        if extra.get("initial_noise_ids"):
            block["initial_noise_ids"] = [extra["initial_noise_ids"][position]]
    if "sigmas" in extra:
        block["sigmas"] = [float(x) for x in extra["sigmas"]]
    return block


def write_condition_images(request: Mapping[str, Any], media_dir: str | os.PathLike
                           ) -> list[list[str]] | None:
    """Each candidate's conditioning images (``condition_images`` entries: paths or data URIs)
    written as files under ``media_dir``, which SGLang reads them from (its request takes them
    as ``image_path``); None for a request without images. Every entry is written, a path too:
    the server then reads exactly the bytes the trainer validated, from one place the caller
    removes when the answers are in."""
    from trainer.media import ImageRef
    from trainer.models.wire.request import CONDITION_IMAGES_KEY

    rows = request["extra_sampling_params"].get(CONDITION_IMAGES_KEY)
    if rows is None:
        return None
    paths = []
    for b, refs in enumerate(rows):
        paths.append([])
        for k, entry in enumerate(refs):
            path = Path(media_dir) / f"candidate{b}_image{k}"
            path.write_bytes(ImageRef(entry).read_bytes())  # MediaError names a bad entry
            paths[-1].append(str(path))
    return paths


def to_sglang_requests(request: Mapping[str, Any], *, extension: bool = False,
                       image_paths: list[list[str]] | None = None) -> list[dict[str, Any]]:
    """One SGLang ``RolloutRequest`` body per candidate of our batched ``request``; with
    ``extension`` and the driver's sigmas or x_T on, or conditioning images, each carries the
    extension's block. ``image_paths``: each candidate's conditioning images as files the
    server reads (``write_condition_images``), sent as ``image_path``."""
    extra = request["extra_sampling_params"]
    if image_paths is not None and not extension:
        raise ValueError("conditioning images need the trainer's SGLang extension: stock SGLang "
                         "returns no latents of them, which the replay needs")
    ours = [k for k in ("sigmas", "noise_recipe", "initial_noise_seed") if k in extra]
    if ours and not extension:
        raise ValueError(f"the request carries {ours}, which stock SGLang rejects (HTTP 400): "
                         "build it with sampling.driver_sigmas=false and driver_xt=false, or "
                         "load the trainer's SGLang extension")
    if request["rollout_sde_type"] not in STOCK_SDE_TYPES and "noise_recipe" not in ours:
        raise ValueError(f"rollout_sde_type {request['rollout_sde_type']!r} is not one of "
                         f"SGLang's {list(STOCK_SDE_TYPES)} (the extension adds 'dance', "
                         "with the driver's noise)")
    common = {
        "seed": None, "width": int(request["width"]), "height": int(request["height"]),
        "num_inference_steps": int(request["num_inference_steps"]), "num_outputs_per_prompt": 1,
        # both CFG knobs at 1.0: SGLang's Qwen-Image defaults to guidance 4.0 (CFG on)
        "guidance_scale": float(request.get("guidance_scale", 1.0)), "true_cfg_scale": 1.0,
        "rollout": True,
        "rollout_sde_type": request["rollout_sde_type"],
        "rollout_noise_level": float(request["rollout_noise_level"]),
        "rollout_sde_step_indices": [int(i) for i in request["rollout_sde_step_indices"]],
        "rollout_return_dit_trajectory": True, "rollout_return_denoising_env": True,
        "rollout_debug_mode": False, "suppress_logs": True,
    }
    if request.get("num_frames") is not None:  # video; an image request stays as it was
        common["num_frames"] = int(request["num_frames"])
    seed = int(request["seed"])
    bodies = [dict(common, prompt=prompt, seed=sample_seed(seed, sid))
              for prompt, sid in zip(request["prompt"], extra["sample_ids"])]
    if ours or image_paths is not None:
        for b, body in enumerate(bodies):
            body["extra_sampling_params"] = {"flowgrpo": extension_block(request, b)}
    for body, paths in zip(bodies, image_paths or ()):
        body["image_path"] = list(paths)
    return bodies


def decode_tensors(obj: Any) -> Any:
    """msgpack-decoded SGLang payload -> the same structure with tagged tensors decoded."""
    if isinstance(obj, dict):
        if obj.get(TENSOR_TAG):
            from safetensors.torch import load
            tensors = load(bytes(obj["data"]))
            if len(tensors) != 1:
                raise SGLangResponseError(f"a tagged tensor holds {len(tensors)} tensors")
            return next(iter(tensors.values()))
        return {k: decode_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [decode_tensors(v) for v in obj]
    return obj


def _video_uint8(video: torch.Tensor, height: int, width: int, frames: int) -> torch.Tensor:
    """SGLang's per-output video (float [0, 1], [3, F, H, W]) -> [F, H, W, 3] uint8."""
    if tuple(video.shape) != (3, frames, height, width):
        raise SGLangResponseError(f"generated_output has shape {list(video.shape)}, expected a "
                                  f"video [3, {frames}, {height}, {width}]")
    pixels = (video.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(1, 2, 3, 0).contiguous()  # channels last


def _images_uint8(images: torch.Tensor, height: int, width: int, frames: int | None = None
                  ) -> torch.Tensor:
    """SGLang's per-output image (float [0, 1], channels first, maybe a frame axis) ->
    [H, W, 3] uint8; with ``frames`` (a video request) -> [F, H, W, 3]."""
    if frames is not None:
        return _video_uint8(images, height, width, frames)
    x = images
    if x.dim() == 4 and x.shape[1] == 1:  # [C, F=1, H, W]
        x = x[:, 0]
    if x.dim() == 3 and x.shape[0] == 3 and x.shape[-2:] == (height, width):
        x = x.permute(1, 2, 0)
    if tuple(x.shape) != (height, width, 3):
        raise SGLangResponseError(f"generated_output has shape {list(images.shape)}, expected an "
                                  f"image of {height}x{width} with 3 channels")
    if x.dtype == torch.uint8:
        return x.contiguous()
    return (x.float().clamp(0, 1) * 255).round().to(torch.uint8)


def _one_tensor(value: Any, where: str, problems: list[str]) -> torch.Tensor | None:
    """A condition as SGLang's denoising stage keeps it: a tensor, or a list with one tensor
    per text encoder (``batch.prompt_embeds``); our families have one."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1 or not isinstance(value[0], torch.Tensor):
            kinds = [type(v).__name__ for v in value]
            problems.append(f"{where} holds {kinds}, expected one tensor (one text encoder)")
            return None
        value = value[0]
    if not isinstance(value, torch.Tensor):
        problems.append(f"{where} is missing")
        return None
    return value


def _conditions(env: Any, family: str, where: str, problems: list[str]) -> dict[str, torch.Tensor]:
    tables = family_tables(family)
    if tables is None:
        problems.append(f"no SGLang denoising_env mapping for family {family!r} "
                        f"(known: {sglang_families()})")
        return {}
    mapping, implied = tables
    from trainer.models import adapter_class

    # a condition a variant of the family does not have (Wan 2.2 I2V: no CLIP image embeddings)
    cls = adapter_class(family)
    optional = set(getattr(cls, "sglang_optional_conditions", ()) or ())
    # a condition SGLang keeps as plain data, not a tensor (Qwen-Image-Edit's img_shapes): the
    # adapter's reader turns it into ours
    readers = getattr(cls, "sglang_readers", None) or {}
    out = {}
    for ours, (section, name) in mapping.items():
        value = (env.get(section) or {}).get(name) if isinstance(env, dict) else None
        if value is None and (ours in implied or ours in optional):
            continue
        if ours in readers and value is not None:
            try:
                out[ours] = readers[ours](value)
            except (TypeError, ValueError) as exc:
                problems.append(f"{where}: denoising_env.{section}.{name}: {exc}")
            continue
        value = _one_tensor(value, f"{where}: denoising_env.{section}.{name}", problems)
        if value is not None:
            out[ours] = value.long() if value.dtype == torch.bool else value
    for mask, embeds in implied.items():
        if mask not in out and isinstance(out.get(embeds), torch.Tensor):
            out[mask] = torch.ones(out[embeds].shape[0], dtype=torch.long)
    return out


def _one_output(entry: Mapping[str, Any], sent: Mapping[str, Any], indices: list[int], steps: int,
                family: str, where: str, problems: list[str]) -> dict[str, Any] | None:
    before = len(problems)
    if entry.get("seed") != sent["seed"]:
        problems.append(f"{where}: seed {entry.get('seed')!r}, the request sent {sent['seed']}")
    logp, traj = entry.get("rollout_log_probs"), entry.get("dit_trajectory") or {}
    lat, ts, sig = traj.get("latents"), traj.get("timesteps"), traj.get("sigmas")
    if not isinstance(logp, torch.Tensor) or logp.reshape(-1).numel() != steps:
        problems.append(f"{where}: rollout_log_probs must hold {steps} per-step values")
    if not isinstance(lat, torch.Tensor) or lat.dim() < 2 or lat.shape[0] != steps + 1:
        problems.append(f"{where}: dit_trajectory.latents must be [T+1={steps + 1}, ...]")
    if not isinstance(ts, torch.Tensor) or ts.numel() not in (steps, steps + 1):
        problems.append(f"{where}: dit_trajectory.timesteps must hold {steps + 1} values")
    if not isinstance(sig, torch.Tensor) or sig.numel() != steps + 1:
        problems.append(f"{where}: dit_trajectory.sigmas must hold {steps + 1} values")
    cond = _conditions(entry.get("denoising_env"), family, where, problems)
    image = entry.get("generated_output")
    if not isinstance(image, torch.Tensor):
        problems.append(f"{where}: generated_output is missing")
    if len(problems) > before:
        return None
    try:
        image = _images_uint8(image, sent["height"], sent["width"], sent.get("num_frames"))
    except SGLangResponseError as exc:
        problems.append(f"{where}: {exc}")
        return None
    idx = torch.tensor(indices, dtype=torch.long)
    return {"logp": logp.reshape(-1).float()[idx],
            "pairs": torch.stack([lat[idx], lat[idx + 1]], 1),
            "timesteps": ts.reshape(-1)[:steps].float(), "sigmas": sig.reshape(-1).float(),
            "cond": cond, "image": image}


def _pad_stack(values: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-output conditions whose first dim (text tokens) differs: one request per
    candidate means one prompt length each; padding is zeros, which the mask marks unused."""
    longest = max(v.shape[0] for v in values)
    out = values[0].new_zeros((len(values), longest, *values[0].shape[1:]))
    for b, v in enumerate(values):
        out[b, :v.shape[0]] = v
    return out


def to_schema_response(answers: Sequence[Any], sent: Sequence[Mapping[str, Any]],
                       request: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's answers (one list of outputs per sent request, tensors decoded) -> our batched
    response (trainer/models/wire/). Raises one SGLangResponseError listing every problem."""
    extra = request["extra_sampling_params"]
    family, steps = extra["model_family"], int(request["num_inference_steps"])
    indices = [int(i) for i in request["rollout_sde_step_indices"]]
    problems: list[str] = []
    rows = []
    for b, (answer, body) in enumerate(zip(answers, sent)):
        where = f"candidate {b} ({extra['sample_ids'][b]})"
        if not isinstance(answer, list) or len(answer) != 1:
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            problems.append(f"{where}: expected a list of 1 output, got {got}")
            continue
        rows.append(_one_output(answer[0], body, indices, steps, family, where, problems))
    if problems:
        raise SGLangResponseError(f"SGLang's rollout answer does not fit the request "
                                  f"({len(problems)} problems):\n  - " + "\n  - ".join(problems))
    if any(not torch.equal(r["sigmas"], rows[0]["sigmas"]) for r in rows):
        raise SGLangResponseError("the outputs of one batch used different sigma schedules")
    video = ({"num_frames": int(request["num_frames"])} if request.get("num_frames") is not None
             else {})
    return {
        **video,
        "prompt": list(request["prompt"]), "seed": int(request["seed"]),
        "sample_ids": list(extra["sample_ids"]), "height": int(request["height"]),
        "width": int(request["width"]), "sde_indices": indices,
        "rollout_log_probs": torch.stack([r["logp"] for r in rows]),
        "dit_trajectory": {"latents": torch.stack([r["pairs"] for r in rows]),
                           "timesteps": rows[0]["timesteps"], "sigmas": rows[0]["sigmas"]},
        "denoising_env": {k: _pad_stack([r["cond"][k] for r in rows]) for k in rows[0]["cond"]},
        "images": torch.stack([r["image"] for r in rows]),
    }
