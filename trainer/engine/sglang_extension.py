"""An SGLang diffusion plugin: the driver's x_T and per-sample step noise, ``dance``, and
``kernels.sde_step`` as the rollout sampler, in a stock SGLang 0.5.23 server.

Load it through SGLang's plugin entry points (group ``sglang.multimodal_gen.plugins``; this
package declares ``flowgrpo = trainer.engine.sglang_extension:register``). In the SGLang
environment::

    pip install --no-deps -e /path/to/flowgrpo-trainer      # next to sglang, its torch kept
    SGLANG_PLUGINS=flowgrpo sglang serve --model-path Qwen/Qwen-Image --port 30000

and train with ``rollout.sglang_extension = true`` (the client then sends, per candidate, an
``extra_sampling_params["flowgrpo"]`` block this plugin takes out before SGLang validates the
request). What each hook does (SGLang's hook registry, AROUND hooks; every hook is inert for
a request without the block, so ordinary serving is unchanged):

- ``rollout_api._build_sampling_kwargs``: removes the block (SGLang's ``SamplingParams`` would
  refuse it) and sends ``dance`` to SGLang as ``sde`` (its validator knows no ``dance``);
  ``rollout_api.prepare_request``: puts the block in ``Req.extra``, which travels to the GPU
  workers.
- ``denoising.prepare_rollout_if_enabled``: replaces the request's x_T with the driver's
  (``trainer.models.noise`` recipe, packed per family) before the loop reads ``batch.latents``.
- ``FlowRolloutController.flow_sde_sampling``: every step is ``kernels.sde_step`` (SDE at the
  requested steps with the recipe's noise for (seed, sample id, step), Euler elsewhere), so the
  recorded log-prob is our replay's function.

Not covered: driver sigmas (the loop has read its timesteps before any hook can run: the
server's own schedule is used and echoed, as in stock mode) and sequence parallelism (the
noise is drawn for the full latent; run with ``--sp-degree 1``).
"""
from __future__ import annotations

import contextvars
from typing import Any

import torch

EXTRA_KEY = "flowgrpo"
ROLLOUT_API = "sglang.multimodal_gen.runtime.entrypoints.post_training.rollout_api"
DENOISING = "sglang.multimodal_gen.runtime.pipelines_core.stages.denoising"
CONTROLLER = ("sglang.multimodal_gen.runtime.post_training.flow_rollout_controller."
              "FlowRolloutController")
#: Keys of the block (see trainer/engine/sglang_rollout.py ``extension_block``).
BLOCK_KEYS = frozenset({"sample_ids", "initial_noise_ids", "initial_noise_seed", "noise_recipe",
                        "model_family", "latent_shape", "init_noise_latent_shape", "sde_type"})

_pending: contextvars.ContextVar[dict | None] = contextvars.ContextVar("flowgrpo_block",
                                                                      default=None)


def register() -> None:
    """The entry point SGLang calls while loading plugins (before it applies hooks)."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry
    from sglang.srt.plugins.hook_registry import HookType

    HookRegistry.register(f"{ROLLOUT_API}._build_sampling_kwargs", take_block, HookType.AROUND)
    HookRegistry.register(f"{ROLLOUT_API}.prepare_request", attach_block, HookType.AROUND)
    HookRegistry.register(f"{DENOISING}.prepare_rollout_if_enabled", driver_initial_latents,
                          HookType.AROUND)
    HookRegistry.register(f"{CONTROLLER}.flow_sde_sampling", sde_step_sampling, HookType.AROUND)


# ---- HTTP process ----------------------------------------------------------------------------
def take_block(original, request, *args, **kwargs):
    extra = request.extra_sampling_params or {}
    block = extra.get(EXTRA_KEY)
    if block is None:
        _pending.set(None)
        return original(request, *args, **kwargs)
    problems = [f"unknown key {k!r}" for k in block if k not in BLOCK_KEYS]
    problems += [f"missing {k!r}" for k in BLOCK_KEYS - {"initial_noise_ids"} if k not in block]
    if problems:
        from fastapi import HTTPException  # SGLang's HTTP layer: a 400 naming every problem

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
        _pending.set(None)
    return req


# ---- GPU workers -----------------------------------------------------------------------------
def _block(batch: Any) -> dict | None:
    extra = getattr(batch, "extra", None)
    return extra.get(EXTRA_KEY) if isinstance(extra, dict) else None


def initial_latents(block: dict) -> torch.Tensor:
    """x_T [B, *latent_shape] of the block's candidates: the recipe's draw, packed per family."""
    from trainer.models import noise

    if block["noise_recipe"] != noise.RECIPE:
        raise ValueError(f"noise recipe {block['noise_recipe']!r} is not this plugin's "
                         f"{noise.RECIPE!r}: install the trainer's version on the server")
    ids = block.get("initial_noise_ids") or block["sample_ids"]
    draws = noise.gaussian(ids, noise.initial_stream(), block["init_noise_latent_shape"],
                           seed=int(block["initial_noise_seed"]))
    family = block["model_family"]
    packing = {"qwen_image": "QwenImagePipeline", "flux": "FluxPipeline"}.get(family)
    if packing is not None:  # 2x2 packing, as the family's diffusers pipeline packs
        import diffusers

        channels, h, w = block["init_noise_latent_shape"]
        return getattr(diffusers, packing)._pack_latents(draws, draws.shape[0], channels, h, w)
    if list(draws.shape[1:]) != list(block["latent_shape"]):
        raise ValueError(f"family {family!r}: x_T {list(draws.shape[1:])} is not the latent "
                         f"shape {block['latent_shape']}")
    return draws


def driver_initial_latents(original, *args, **kwargs):
    batch = kwargs.get("batch", args[0] if args else None)
    block = _block(batch)
    if block is not None and getattr(batch, "rollout", False):
        x_t = initial_latents(block)
        if tuple(batch.latents.shape) != tuple(x_t.shape):
            raise ValueError(f"the server's latents are {list(batch.latents.shape)}, the "
                             f"driver's x_T is {list(x_t.shape)}")
        batch.latents = x_t.to(device=batch.latents.device, dtype=batch.latents.dtype)
    return original(*args, **kwargs)


def sde_step_sampling(original, controller, *args, **kwargs):
    batch = kwargs.get("batch")
    block = _block(batch)
    if block is None:
        return original(controller, *args, **kwargs)
    import kernels
    from trainer.models import noise

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
