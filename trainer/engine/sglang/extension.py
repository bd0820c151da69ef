"""An SGLang diffusion plugin: the driver's sigmas, x_T and per-sample step noise, ``dance``,
and ``kernels.sde_step`` as the rollout sampler, in a stock SGLang 0.5.23 server.

Load it through SGLang's plugin entry points (group ``sglang.multimodal_gen.plugins``; this
package declares ``flowgrpo = trainer.engine.sglang.extension:register``). In the SGLang
environment::

    pip install --no-deps -e /path/to/flowgrpo-trainer      # next to sglang, its torch kept
    SGLANG_PLUGINS=flowgrpo sglang serve --model-path Qwen/Qwen-Image --port 30000

and train with ``rollout.sglang_extension = true`` (the client then sends, per candidate, an
``extra_sampling_params["flowgrpo"]`` block this plugin takes out before SGLang validates the
request). What each hook does (SGLang's hook registry, AROUND hooks; every hook is inert for
a request without the block, so ordinary serving is unchanged):

- ``rollout_api._build_sampling_kwargs``: checks the block (HTTP 400 naming every problem),
  removes it (SGLang's ``SamplingParams`` would refuse it) and sends ``dance`` to SGLang as
  ``sde`` (its validator knows no ``dance``); ``rollout_api.prepare_request``: puts the block in
  ``Req.extra``, which travels to the GPU workers, and the driver's sigmas in ``Req.sigmas``
  (so SGLang's own stage-dedup fingerprint tells two schedules apart).
- ``TimestepPreparationStage.forward`` (driver sigmas): after SGLang's stage has bound the
  request's scheduler, its grid is replaced by the driver's N+1 sigmas verbatim (timesteps
  ``sigma * num_train_timesteps``, the scheduler's own convention). SGLang would otherwise shift
  the given sigmas by the resolution-dependent ``mu``. The denoising loop, the rollout
  controller and the echoed ``dit_trajectory.sigmas`` all read this grid.
- ``denoising.prepare_rollout_if_enabled`` (driver x_T): replaces the request's x_T with the
  driver's (``trainer.models.noise`` recipe, packed per family) before the loop reads
  ``batch.latents``.
- ``FlowRolloutController.flow_sde_sampling`` (driver noise): every step is ``kernels.sde_step``
  (SDE at the requested steps with the recipe's noise for (seed, sample id, step), Euler
  elsewhere), so the recorded log-prob is our replay's function.
- ``denoising.finalize_rollout_if_enabled`` (conditioning images): adds the latents SGLang's
  image VAE stage gave the DiT beside the noise (``batch.image_latent``; Wan image-to-video:
  the first frame's, with its mask; Qwen-Image-Edit(-Plus): the references' packed latents,
  in order) to the answer's ``denoising_env.pos_cond_kwargs`` as
  ``flowgrpo_image_latent``; stock SGLang returns no such latents, and the replay needs them.

Weights (trainer/engine/sglang/receiver.py): ``pipelines_core.build_pipeline`` installs our
ipc ``WeightReceiver`` on the native DiT of each worker, with the LoRA adapter channel beside it
(trainer/engine/sglang/lora_receiver.py; ``FLOWGRPO_WEIGHT_RECEIVER=0`` leaves both out),
``http_server.create_app`` adds ``GET /flowgrpo/weight_receivers`` (each worker's socket and
packing rules, for trainer/engine/sglang/transport.py), ``DenoisingStage.forward`` refuses to
denoise while the weights are no policy version (a failed full sync left them dirty, or an
adapter run's base is written without its adapter), and SGLang's release / resume memory
(``MemoryOccupationController._move_modules``) leaves that DiT where it is: its weights live in
the transport memory the trainer writes into, so they stay resident (as the embedded engine's
do); moving them would leave the receiver nothing to write.

The block's noise keys and its sigmas are independent: sigmas alone keep SGLang's sampler
(``sde``/``cps``/``ode`` with its own seeded noise); ``dance`` needs the noise keys (it is our
sampler's). Not covered: sequence parallelism (the noise is drawn for the full latent; run with
``--sp-degree 1``) and disaggregated serving (its denoiser prepares timesteps elsewhere).
"""
from __future__ import annotations

import contextvars
import os
from typing import Any

import torch

import flowgrpo_kernels as kernels
from trainer.engine.sglang import receiver
from trainer.models import noise

EXTRA_KEY = "flowgrpo"
#: where the answer's ``denoising_env.pos_cond_kwargs`` carries ``batch.image_latent``
IMAGE_LATENT_KEY = "flowgrpo_image_latent"
ROLLOUT_API = "sglang.multimodal_gen.runtime.entrypoints.post_training.rollout_api"
TIMESTEP_STAGE = ("sglang.multimodal_gen.runtime.pipelines_core.stages.timestep_preparation."
                  "TimestepPreparationStage")
DENOISING = "sglang.multimodal_gen.runtime.pipelines_core.stages.denoising"
BUILD_PIPELINE = "sglang.multimodal_gen.runtime.pipelines_core.build_pipeline"
CREATE_APP = "sglang.multimodal_gen.runtime.entrypoints.http_server.create_app"
DENOISING_FORWARD = f"{DENOISING}.DenoisingStage.forward"
MOVE_MODULES = ("sglang.multimodal_gen.runtime.managers.memory_managers."
                "memory_occupation_controller.MemoryOccupationController._move_modules")
CONTROLLER = ("sglang.multimodal_gen.runtime.post_training.flow_rollout_controller."
              "FlowRolloutController")
#: Keys of the block (see trainer/engine/sglang/rollout.py ``extension_block``): always sent,
#: sent together for the driver's x_T and step noise, and the driver's schedule.
REQUIRED_KEYS = frozenset({"sample_ids", "model_family", "latent_shape", "sde_type"})
NOISE_KEYS = frozenset({"noise_recipe", "initial_noise_seed", "init_noise_latent_shape"})
BLOCK_KEYS = REQUIRED_KEYS | NOISE_KEYS | {"initial_noise_ids", "sigmas"}

_pending: contextvars.ContextVar[dict | None] = contextvars.ContextVar("flowgrpo_block",
                                                                      default=None)


def register() -> None:
    """The entry point SGLang calls while loading plugins (before it applies hooks)."""
    # sglang: only in SGLang's own environment (this module imports without it)
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry
    from sglang.srt.plugins.hook_registry import HookType

    HookRegistry.register(f"{ROLLOUT_API}._build_sampling_kwargs", take_block, HookType.AROUND)
    HookRegistry.register(f"{ROLLOUT_API}.prepare_request", attach_block, HookType.AROUND)
    HookRegistry.register(f"{TIMESTEP_STAGE}.forward", driver_timesteps, HookType.AROUND)
    HookRegistry.register(f"{DENOISING}.prepare_rollout_if_enabled", driver_initial_latents,
                          HookType.AROUND)
    HookRegistry.register(f"{CONTROLLER}.flow_sde_sampling", sde_step_sampling, HookType.AROUND)
    HookRegistry.register(f"{DENOISING}.finalize_rollout_if_enabled", return_image_latent,
                          HookType.AROUND)
    HookRegistry.register(BUILD_PIPELINE, install_weight_receiver, HookType.AROUND)
    HookRegistry.register(CREATE_APP, add_receiver_route, HookType.AROUND)
    HookRegistry.register(DENOISING_FORWARD, refuse_dirty_weights, HookType.AROUND)
    HookRegistry.register(MOVE_MODULES, keep_dit_resident, HookType.AROUND)


# ---- HTTP process ----------------------------------------------------------------------------
def block_problems(block: Any, num_inference_steps: int | None) -> list[str]:
    """Every problem of a request's block ([] when SGLang can run it with this plugin)."""
    if not isinstance(block, dict):
        return [f"must be a table, got {type(block).__name__}"]
    problems = [f"unknown key {k!r}" for k in block if k not in BLOCK_KEYS]
    problems += [f"missing {k!r}" for k in sorted(REQUIRED_KEYS) if k not in block]
    noise_keys = sorted(NOISE_KEYS & set(block))
    if noise_keys and len(noise_keys) < len(NOISE_KEYS):
        problems += [f"missing {k!r} (the driver's noise keys go together)"
                     for k in sorted(NOISE_KEYS - set(block))]
    if block.get("sde_type") == "dance" and not noise_keys:
        problems.append("sde_type 'dance' is this plugin's sampler, which draws the driver's "
                        "noise: send the noise keys")
    if "sigmas" in block and num_inference_steps is None:
        problems.append("'sigmas' needs the request's num_inference_steps")
    elif "sigmas" in block:
        problems += _sigma_problems(block["sigmas"], int(num_inference_steps))
    return problems


def _sigma_problems(sigmas: Any, steps: int) -> list[str]:
    """The driver's schedule: N+1 numbers from <= 1 down to exactly 0, strictly decreasing."""
    if not isinstance(sigmas, list) or not all(isinstance(x, (int, float)) and
                                               not isinstance(x, bool) for x in sigmas):
        return ["'sigmas' must be a list of numbers"]
    problems = []
    if len(sigmas) != steps + 1:
        problems.append(f"'sigmas' holds {len(sigmas)} values, num_inference_steps={steps} "
                        f"needs {steps + 1}")
    if sigmas and (float(sigmas[0]) > 1.0 or float(sigmas[-1]) != 0.0):
        problems.append("'sigmas' must run from <= 1.0 down to 0.0")
    if any(b >= a for a, b in zip(sigmas, sigmas[1:])):
        problems.append("'sigmas' must decrease strictly")
    return problems


def take_block(original, request, *args, **kwargs):
    extra = request.extra_sampling_params or {}
    block = extra.get(EXTRA_KEY)
    if block is None:
        _pending.set(None)
        return original(request, *args, **kwargs)
    problems = block_problems(block, request.num_inference_steps)
    if problems:
        # SGLang's HTTP layer (only in SGLang's environment): a 400 naming every problem
        from fastapi import HTTPException

        raise HTTPException(status_code=400, detail=f"extra_sampling_params.{EXTRA_KEY}: "
                            + "; ".join(sorted(problems)))
    rest = {k: v for k, v in extra.items() if k != EXTRA_KEY}
    update = {"extra_sampling_params": rest or None}
    if block["sde_type"] == "dance":  # SGLang validates its own names; the sampler is ours
        update["rollout_sde_type"] = "sde"
    _pending.set(dict(block))
    return original(request.model_copy(update=update), *args, **kwargs)


def attach_block(original, *args, **kwargs):
    req = original(*args, **kwargs)
    block = _pending.get()
    if block is not None:
        req.extra[EXTRA_KEY] = block
        if "sigmas" in block:  # the N step sigmas, as SGLang's Req.sigmas holds them
            req.sigmas = [float(x) for x in block["sigmas"][:-1]]
        _pending.set(None)
    return req


def add_receiver_route(original, *args, **kwargs):
    """SGLang's app, plus the route that lists the workers' weight receivers."""
    app = original(*args, **kwargs)
    server_args = kwargs.get("server_args", args[0] if args else None)
    from fastapi import APIRouter

    router = APIRouter()
    port = server_args.port

    @router.get(receiver.ROUTE)
    def weight_receivers() -> dict:
        # "enabled": whether the workers were told to install receivers (the HTTP process
        # shares their environment), so a trainer can tell "turned off" from "none came up"
        return {"receivers": receiver.read_descriptors(port),
                "enabled": os.environ.get(receiver.ENABLE_ENV, "1") != "0"}

    app.include_router(router)
    return app


# ---- GPU workers -----------------------------------------------------------------------------
_installed: receiver.WorkerReceiver | None = None


def install_weight_receiver(original, *args, **kwargs):
    """SGLang's pipeline, its native DiT then served by our receiver (module docstring)."""
    global _installed
    pipeline = original(*args, **kwargs)
    if os.environ.get(receiver.ENABLE_ENV, "1") == "0":
        return pipeline
    server_args = kwargs.get("server_args", args[0] if args else None)
    try:
        # SGLang's worker sets RANK before it builds the pipeline
        _installed = receiver.WorkerReceiver(pipeline.get_module("transformer"),
                                             rank=int(os.environ.get("RANK", "0")),
                                             port=server_args.port)
    except (ValueError, OSError) as exc:
        raise RuntimeError(f"flowgrpo extension: cannot serve the DiT's weights through our "
                           f"transport ({exc}); set {receiver.ENABLE_ENV}=0 to serve without "
                           "it (the trainer then syncs through the stock path)") from exc
    return pipeline


def installed_receiver() -> receiver.WorkerReceiver | None:
    """This worker's receiver (None in the HTTP process, or with the receiver turned off)."""
    return _installed


def keep_dit_resident(original, controller, names, device, *args, **kwargs):
    """SGLang's module move, minus the DiT our receiver serves (module docstring)."""
    if _installed is None:
        return original(controller, names, device, *args, **kwargs)
    from sglang.multimodal_gen.runtime.post_training.weights_updater import (
        get_updatable_modules)

    modules = get_updatable_modules(controller.pipeline)
    rest = [n for n in names if modules.get(n) is not _installed.module]
    if not rest:
        return None
    return original(controller, rest, device, *args, **kwargs)


def refuse_dirty_weights(original, *args, **kwargs):
    if _installed is not None:
        _installed.assert_servable()  # WeightSyncError: the weights are no policy version
    return original(*args, **kwargs)



def _block(batch: Any) -> dict | None:
    extra = getattr(batch, "extra", None)
    return extra.get(EXTRA_KEY) if isinstance(extra, dict) else None


def initial_latents(block: dict) -> torch.Tensor:
    """x_T [B, *latent_shape] of the block's candidates: the recipe's draw, packed per family."""
    if block["noise_recipe"] != noise.RECIPE:
        raise ValueError(f"noise recipe {block['noise_recipe']!r} is not this plugin's "
                         f"{noise.RECIPE!r}: install the trainer's version on the server")
    ids = block.get("initial_noise_ids") or block["sample_ids"]
    draws = noise.gaussian(ids, noise.initial_stream(), block["init_noise_latent_shape"],
                           seed=int(block["initial_noise_seed"]))
    family = block["model_family"]
    packing = {"qwen_image": "QwenImagePipeline", "flux": "FluxPipeline"}.get(family)
    if packing is not None:  # 2x2 packing, as the family's diffusers pipeline packs
        import diffusers  # multi-second import, only for the packed families

        channels, h, w = block["init_noise_latent_shape"]
        return getattr(diffusers, packing)._pack_latents(draws, draws.shape[0], channels, h, w)
    if list(draws.shape[1:]) != list(block["latent_shape"]):
        raise ValueError(f"family {family!r}: x_T {list(draws.shape[1:])} is not the latent "
                         f"shape {block['latent_shape']}")
    return draws


def driver_timesteps(original, stage, batch, *args, **kwargs):
    """SGLang's timestep stage, then the request's scheduler set to the driver's grid."""
    result = original(stage, batch, *args, **kwargs)
    block = _block(result)
    if block is None or "sigmas" not in block or not getattr(result, "rollout", False):
        return result
    scheduler = result.scheduler
    sigmas = torch.tensor([float(x) for x in block["sigmas"]], dtype=torch.float32,
                          device=scheduler.sigmas.device)
    scheduler.sigmas = sigmas
    scheduler.timesteps = sigmas[:-1] * scheduler.config.num_train_timesteps
    scheduler.num_inference_steps = sigmas.numel() - 1
    scheduler._step_index = scheduler._begin_index = None  # as set_timesteps leaves them
    result.timesteps = scheduler.timesteps
    return result


def driver_initial_latents(original, *args, **kwargs):
    batch = kwargs.get("batch", args[0] if args else None)
    block = _block(batch)
    if block is not None and "noise_recipe" in block and getattr(batch, "rollout", False):
        x_t = initial_latents(block)
        if tuple(batch.latents.shape) != tuple(x_t.shape):
            raise ValueError(f"the server's latents are {list(batch.latents.shape)}, the "
                             f"driver's x_T is {list(x_t.shape)}")
        batch.latents = x_t.to(device=batch.latents.device, dtype=batch.latents.dtype)
    return original(*args, **kwargs)


def return_image_latent(original, *args, **kwargs):
    """After SGLang has put the denoising env in the rollout answer, add the latents its image
    VAE stage gave the DiT beside the noise (``batch.image_latent``: Wan image-to-video's first
    frame with its mask, Qwen-Image-Edit's references), which stock SGLang leaves out, as
    ``pos_cond_kwargs``'s
    ``IMAGE_LATENT_KEY``; only for a request that carries our block."""
    out = original(*args, **kwargs)
    batch = kwargs.get("batch", args[0] if args else None)
    data = getattr(batch, "rollout_trajectory_data", None)
    env = getattr(data, "denoising_env", None)
    latent = getattr(batch, "image_latent", None)
    if _block(batch) is not None and env is not None and isinstance(latent, torch.Tensor):
        env.pos_cond_kwargs = dict(env.pos_cond_kwargs or {})
        env.pos_cond_kwargs[IMAGE_LATENT_KEY] = latent.detach().cpu()
    return out


def sde_step_sampling(original, controller, *args, **kwargs):
    batch = kwargs.get("batch")
    block = _block(batch)
    if block is None or "noise_recipe" not in block:  # SGLang's sampler, its own noise
        return original(controller, *args, **kwargs)
    sample, v = kwargs["sample"].float(), kwargs["model_output"].float()
    sigma, sigma_next = float(kwargs["current_sigma"]), float(kwargs["next_sigma"])
    step = int(kwargs["step_index"])
    indices = controller.sde_step_indices
    sde_type = block["sde_type"]
    batch_size = sample.shape[0]
    if sde_type == "ode" or (indices is not None and step not in indices):
        out = kernels.sde_step(sample, v, sigma, sigma_next, eta=0.0, sde_type="ode")
        log_prob = torch.zeros(batch_size, device=sample.device)
    else:
        draws = noise.gaussian(block["sample_ids"], noise.step_stream(step), list(sample.shape[1:]),
                               seed=int(block["initial_noise_seed"]))
        out = kernels.sde_step(sample, v, sigma, sigma_next, eta=controller.noise_level,
                               sde_type=sde_type, noise=draws.to(sample.device))
        log_prob = out.log_prob.float()
    # SGLang reports sum / count per step: count 1 keeps our per-sample mean bit-exact
    controller.append_local_rollout_log_probs(log_prob, torch.ones_like(log_prob))
    return out.prev_sample
