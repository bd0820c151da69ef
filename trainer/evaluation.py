"""How the loop evaluates: which sampling, and which weights.

``data.eval_mode``:

- ``"sde"`` (the project's default): the training's sampling at fixed SDE steps
  (``data.eval_sde_indices``, else the training table's deterministic steps), so eval numbers
  stay comparable across steps and with the training rollouts.
- ``"ode"`` (the Flow-GRPO reference): deterministic sampling (``sde_step_mode="ode"``) with
  its own step count (``data.eval_num_inference_steps``, the reference's 40) and guidance
  (``data.eval_guidance_scale``).

Weights: with ``ema.enabled`` and ``data.eval_use_ema`` the engine samples the EMA weights for
the eval (``eval_weights``: swap them into the actor, sync, evaluate, swap back, sync again;
two extra weight syncs per evaluation), as the reference evaluates its EMA copy.
Torch-free except ``eval_weights``'s caller's objects, so preflight can check the eval table.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

#: Keys of a training table that mean nothing for an evaluation without SDE steps.
_STEP_KEYS_OFF_FOR_ODE = {"sde_indices": None, "sde_pool": None, "num_sde_steps": 0,
                          "sde_resample_per_rollout": False, "sde_timestep_fraction": None,
                          "init_same_noise": False, "timestep_fraction": None}


def eval_sampling(cfg: Any) -> dict[str, Any]:
    """The sampling table of an evaluation rollout (validated by trainer.config.sampling)."""
    data, table = cfg.data, cfg.rollout.sampling.to_dict()
    if data.eval_num_inference_steps is not None:
        table["num_inference_steps"] = data.eval_num_inference_steps
    if data.eval_guidance_scale is not None:
        table["guidance_scale"] = data.eval_guidance_scale
    if data.eval_mode == "ode":
        table.update(_STEP_KEYS_OFF_FOR_ODE, sde_step_mode="ode")
        return table
    table["sde_resample_per_rollout"] = False  # evaluation never resamples
    if data.eval_sde_indices is not None:
        table.update(sde_indices=list(data.eval_sde_indices), sde_step_mode="indices")
    return table


@contextlib.contextmanager
def eval_weights(trainer: Any) -> Iterator[None]:
    """The engine holds the EMA weights inside the block (when asked for), the live ones after."""
    ema = getattr(trainer, "ema", None)
    if ema is None or not trainer.cfg.data.eval_use_ema:
        yield
        return
    try:
        with ema.swapped_in():
            if not trainer.sync_weights():  # {}: this engine has no weight sync from the actor
                raise RuntimeError("data.eval_use_ema needs an engine the actor syncs weights "
                                   "into; this one was not updated, the eval would score the "
                                   "live weights under the EMA's name")
            yield
    finally:
        trainer.sync_weights()  # the live weights are back in the actor: the engine follows
