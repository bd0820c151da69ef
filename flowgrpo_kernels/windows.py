"""Which steps are stochastic and trained: Flow-GRPO-Fast's branch window and MixGRPO's sliding
window. Plain Python (no torch): the engine, the actor and the tests call these with ints.

Flow-GRPO-Fast (yifan123/flow_grpo ``scripts/train_sd3_fast.py`` and its pipeline
``sd3_pipeline_with_logprob_fast``): the group shares x_T and the deterministic (ODE) trunk;
a window of ``size`` steps starts at ``start``, drawn uniformly from
``lo, lo + 1, ..., hi - size`` (both ends included, the reference's ``random.randint``); the
steps ``start .. start + size - 1`` are SDE (the candidates branch at ``start``), every other
step ODE, and only the window's steps are trained.

MixGRPO (Tencent-Hunyuan/MixGRPO ``fastvideo/utils/grpo_states.py``, strategy "progressive";
arXiv 2507.21802 section 3.2): the window of ``size`` steps starts at 0 and moves ``stride``
steps every ``shift_interval`` training iterations, its start capped at ``max_start`` (the
reference: ``num_steps - 2``), the window clipped to ``[start, min(start + size, max_start))``.
With ``roll_back`` the start returns to 0 instead of stopping at the cap.
"""
from __future__ import annotations

import random


def fast_branch_window(rng: random.Random, *, lo: int, hi: int, size: int) -> list[int]:
    """The SDE (branch and trained) steps of one Flow-GRPO-Fast rollout."""
    if size < 1 or lo < 0 or hi - size < lo:
        raise ValueError(f"fast_branch_window: need size >= 1 and 0 <= lo <= hi - size, got "
                         f"lo={lo}, hi={hi}, size={size}")
    start = rng.randint(lo, hi - size)
    return list(range(start, start + size))


def mix_window_start(iteration: int, *, shift_interval: int, stride: int, max_start: int,
                     roll_back: bool = False) -> int:
    """MixGRPO's window start after ``iteration`` training iterations (0-based).

    The reference's counter is stepped once per iteration: after every ``shift_interval`` of
    them the start moves by ``stride``; past ``max_start`` it is clipped to it or, with
    ``roll_back``, reset to 0 (that reset happens on the step that passes the cap).
    """
    if shift_interval < 1 or stride < 1 or max_start < 0 or iteration < 0:
        raise ValueError(f"mix_window_start: bad arguments shift_interval={shift_interval}, "
                         f"stride={stride}, max_start={max_start}, iteration={iteration}")
    moves = iteration // shift_interval
    if not roll_back:
        return min(moves * stride, max_start)
    # each cycle climbs while start <= max_start; the move that passes the cap resets to 0
    per_cycle = max_start // stride + 1
    return (moves % per_cycle) * stride


def mix_window(iteration: int, *, size: int, shift_interval: int, stride: int, num_steps: int,
               roll_back: bool = False) -> list[int]:
    """MixGRPO's SDE (and trained) steps at ``iteration`` for a ``num_steps`` sampler."""
    max_start = num_steps - 2
    if size < 1 or max_start < 1:
        raise ValueError(f"mix_window: need size >= 1 and num_steps >= 3, got size={size}, "
                         f"num_steps={num_steps}")
    start = mix_window_start(iteration, shift_interval=shift_interval, stride=stride,
                             max_start=max_start, roll_back=roll_back)
    return list(range(start, min(start + size, max_start)))


def trunk_forwards_saved(*, group_size: int, branch_step: int) -> int:
    """Transformer forwards a shared trunk saves per group (without CFG): the trunk's
    ``branch_step`` steps run once instead of once per candidate."""
    return (group_size - 1) * branch_step
