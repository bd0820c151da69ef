"""Which denoising steps are SDE steps (and therefore trained): ``resolve_sde_indices``.

Spec: generative-rl-path, "训练的 SDE step". The resolved set decides both where the engine
injects SDE noise and which transitions the actor replays. Priority, highest first:

1. ``sde_resample_per_rollout`` with a rollout id: draw ``num_sde_steps`` steps without
   replacement from ``sde_pool`` (default: the fraction window) with
   ``numpy.random.default_rng(rollout_id)``. Every engine and rank computes the same draw with
   no communication, and the draw is reproducible across restarts.
2. ``sde_indices``: an explicit list, sorted and de-duplicated. This is the deterministic path
   evaluation takes (``rollout_id=None``), so eval numbers stay comparable across steps.
3. ``num_sde_steps`` > 0: a stride inside the ``sde_timestep_fraction`` window:
   ``window[floor(k * len(window) / num_sde_steps)]`` for k in 0..num_sde_steps-1.
4. Nothing configured: ``[]`` (pure ODE sampling; packing a trajectory for training then fails,
   which is the spec's behaviour; evaluation is fine with it).

Step 0 (sigma == 1) is rejected under ``sde_type == "sde"`` on every path that could train it
(explicit indices, the pool, the derived window), not only on the path chosen this rollout:
a config that trains step 0 at *some* rollout is invalid, exactly as the preflight says.

Design choices where the spec is silent (documented here, tested in
tests/test_rollout_sde_indices.py):
- The fraction window over T steps is ``range(floor(lo * T), floor(hi * T))`` (half-open), so
  ``[0.0, 1.0]`` is every step and ``[0.0, 0.5]`` over 12 steps is steps 0..5. A tiny epsilon
  keeps ``lo = 1/12`` from flooring to 0 through float rounding.
- ``sde_resample_per_rollout`` with ``num_sde_steps <= 0`` is an error, not an empty draw: the
  user asked for a per-rollout subset and got none.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

SDE_TYPES: tuple[str, ...] = ("sde", "dance", "cps")
DEFAULT_NUM_INFERENCE_STEPS = 12
_FLOOR_EPS = 1e-9


def fraction_window(fraction: Any, num_steps: int) -> list[int]:
    """Step indices inside the normalised ``[lo, hi]`` window of a ``num_steps`` schedule."""
    lo, hi = float(fraction[0]), float(fraction[1])
    start = int(math.floor(lo * num_steps + _FLOOR_EPS))
    stop = int(math.floor(hi * num_steps + _FLOOR_EPS))
    return list(range(max(start, 0), min(stop, num_steps)))


def _int_list(value: Any, key: str, problems: list[str]) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        problems.append(f"{key} must be a list of integers, got {value!r}")
        return None
    out: list[int] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
            problems.append(f"{key} must hold integers, got {item!r}")
            return None
        out.append(int(item))
    return out


def resolve_sde_indices(sampling: dict[str, Any], *, rollout_id: int | None) -> list[int]:
    """The sorted SDE step indices for one rollout (``rollout_id=None``: evaluation).

    Raises one ``ValueError`` listing every problem of the SDE keys of ``sampling``.
    """
    problems: list[str] = []
    num_steps = sampling.get("num_inference_steps", DEFAULT_NUM_INFERENCE_STEPS)
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"sampling config: num_inference_steps must be a positive integer, "
                         f"got {num_steps!r}")
    sde_type = sampling.get("sde_type", "sde")
    if sde_type not in SDE_TYPES:
        problems.append(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")

    fraction = sampling.get("sde_timestep_fraction", (0.0, 1.0))
    window: list[int] = []
    try:
        lo, hi = (float(f) for f in fraction)
        if not (0.0 <= lo < hi <= 1.0):
            problems.append(f"sde_timestep_fraction must satisfy 0 <= lo < hi <= 1, got {list(fraction)}")
        else:
            window = fraction_window((lo, hi), num_steps)
    except (TypeError, ValueError):
        problems.append(f"sde_timestep_fraction must be a pair [lo, hi], got {fraction!r}")

    explicit = _int_list(sampling.get("sde_indices"), "sde_indices", problems)
    pool = _int_list(sampling.get("sde_pool"), "sde_pool", problems)
    num_sde = sampling.get("num_sde_steps", 0)
    if isinstance(num_sde, bool) or not isinstance(num_sde, int) or num_sde < 0:
        problems.append(f"num_sde_steps must be a non-negative integer, got {num_sde!r}")
        num_sde = 0
    resample = bool(sampling.get("sde_resample_per_rollout", False))

    for key, values in (("sde_indices", explicit), ("sde_pool", pool)):
        if values is None:
            continue
        bad = sorted({i for i in values if not 0 <= i < num_steps})
        if bad:
            problems.append(f"{key} {bad} outside the schedule's steps 0..{num_steps - 1}")
    if pool is not None and not pool:
        problems.append("sde_pool is empty")
    # The stride-in-window path is reachable whenever no explicit list overrides it: at
    # evaluation (rollout_id=None) and, without sde_pool, as the resampling pool.
    window_reachable = num_sde > 0 and (explicit is None or (resample and pool is None))
    if window_reachable and num_sde > len(window) and not any("fraction" in msg for msg in problems):
        problems.append(f"num_sde_steps={num_sde} exceeds the {len(window)} steps of the "
                        f"sde_timestep_fraction window {window}")
    if resample:
        if num_sde <= 0:
            problems.append("sde_resample_per_rollout is set but num_sde_steps is 0")
        elif pool is not None and num_sde > len(set(pool)):
            problems.append(f"num_sde_steps={num_sde} exceeds the {len(set(pool))} distinct "
                            f"steps of sde_pool {sorted(set(pool))}")

    if sde_type == "sde":
        # Every path that could train step 0 (spec: _validate_sde_schedule).
        reasons = []
        if explicit and 0 in explicit:
            reasons.append("sde_indices contains 0")
        if resample and pool and 0 in pool:
            reasons.append("sde_pool contains 0")
        if window_reachable and window and window[0] == 0:
            reasons.append(f"sde_timestep_fraction {list(fraction)} resolves to a window "
                           f"{window} starting at step 0")
        if reasons:
            problems.append(
                "SDE step 0 cannot be trained with sde_type='sde' (sigma == 1 makes the "
                "coefficient sqrt(sigma / (1 - sigma)) singular): " + "; ".join(reasons)
                + f". Use steps >= 1 (e.g. sde_pool [1, 2, 3, 4, 5]) or a fraction starting "
                f"above 1/{num_steps}")
    if problems:
        raise ValueError("invalid SDE step configuration:\n  - " + "\n  - ".join(problems))

    if resample and rollout_id is not None:
        draw_from = sorted(set(pool)) if pool is not None else window
        rng = np.random.default_rng(int(rollout_id))
        chosen = rng.choice(np.asarray(draw_from, dtype=np.int64), size=num_sde, replace=False)
        return sorted(int(i) for i in chosen)
    if explicit is not None:
        return sorted(set(explicit))
    if num_sde > 0:
        return [window[(k * len(window)) // num_sde] for k in range(num_sde)]
    return []
