"""Which denoising steps get SDE noise (and are trained) in one rollout, per algorithm.

``flowgrpo`` leaves it to the sampling config (``SamplingConfig.noise_steps``). The others own
the choice, as a pure function of the rollout id, so every rank and a resumed run draw the same
steps:

- ``flowgrpo_fast``: a branch window of ``train.fast_branch_steps`` steps starting uniformly in
  ``train.fast_branch_range`` (``flowgrpo_kernels.windows.fast_branch_window``), drawn with
  ``random.Random(generation_seed * 1_000_003 + rollout_id)``.
- ``mixgrpo``: the sliding window at iteration ``rollout_id`` (``windows.mix_window``).
- ``diffusionnft``: none: its training rollouts sample with the ODE table that an ODE
  evaluation uses (``training_sampling``), and the loss needs no trajectory.

Evaluation (``rollout_id=None``) always uses the sampling config's own rule. Preflight imports
this module (``ALGORITHMS``, ``reachable_steps``) before torch may load, so the windows of
``flowgrpo_kernels`` (a torch package) are imported only when a schedule is built.
"""
from __future__ import annotations

import random
from typing import Callable

ALGORITHMS: tuple[str, ...] = ("flowgrpo", "flowgrpo_fast", "mixgrpo", "diffusionnft")
GRPO_FAMILY: tuple[str, ...] = ("flowgrpo", "flowgrpo_fast", "mixgrpo")


def algorithm_noise_steps(train, *, num_inference_steps: int, seed: int
                          ) -> Callable[[int], list[int]] | None:
    """``rollout_id -> noise steps`` for ``train.algorithm``; None: the sampling config decides."""
    algorithm = train.algorithm
    if algorithm == "flowgrpo":
        return None
    from flowgrpo_kernels import windows
    if algorithm == "flowgrpo_fast":
        lo, hi = (int(x) for x in train.fast_branch_range)
        size = int(train.fast_branch_steps)

        def fast(rollout_id: int) -> list[int]:
            rng = random.Random(int(seed) * 1_000_003 + int(rollout_id))
            return windows.fast_branch_window(rng, lo=lo, hi=hi, size=size)
        return fast
    if algorithm == "mixgrpo":
        def mix(rollout_id: int) -> list[int]:
            return windows.mix_window(int(rollout_id), size=train.mix_window_size,
                                      shift_interval=train.mix_shift_interval,
                                      stride=train.mix_window_stride,
                                      num_steps=num_inference_steps, roll_back=train.mix_roll_back)
        return mix
    if algorithm == "diffusionnft":
        return None  # its training table is the ODE one (training_sampling)
    raise ValueError(f"train.algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS)}")


def reachable_steps(train, num_inference_steps: int) -> set[int]:
    """Every step some training rollout of the algorithm may put noise on (preflight)."""
    if train.algorithm == "flowgrpo_fast":
        lo, hi = (int(x) for x in train.fast_branch_range)
        return set(range(lo, hi))
    if train.algorithm == "mixgrpo":
        stop = num_inference_steps - 2
        return set(range(0, stop))
    return set()


def training_sampling(algorithm: str, data, sampling):
    """The sampling config of the training rollouts: the configured one (``sampling``), or for
    ``diffusionnft`` the ODE table of ``trainer.evaluation.eval_sampling`` at the training's
    own step count and guidance (``data``: the ``[data]`` section)."""
    if algorithm != "diffusionnft":
        return sampling
    import dataclasses

    from trainer.evaluation import eval_sampling

    data = dataclasses.replace(data, eval_mode="ode", eval_num_inference_steps=None,
                               eval_guidance_scale=None)
    return eval_sampling(data, sampling)
