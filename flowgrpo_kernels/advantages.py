"""Group-relative advantage normalisation (GRPO), plain torch.

Called once per rollout on a vector of rewards, so it may sync with the host (it does: grouping
by arbitrary ids needs the number of groups).
"""
from __future__ import annotations

import math

import torch

STD_MODES = ("group", "batch", "none")
DEGENERATE_VARIANCE = 1e-6


def _describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _input_problems(values, group_index, std_mode, eps) -> list[str]:
    problems = []
    values_ok = isinstance(values, torch.Tensor) and values.is_floating_point() and values.dim() == 1
    if not values_ok:
        problems.append(f"values must be a 1-D floating tensor, got {_describe(values)}")
    if not (isinstance(group_index, torch.Tensor) and group_index.dtype == torch.int64
            and group_index.dim() == 1):
        problems.append(f"group_index must be a 1-D int64 tensor, got {_describe(group_index)}")
    elif values_ok:
        if group_index.shape != values.shape:
            problems.append(f"group_index has shape {tuple(group_index.shape)}, "
                            f"expected {tuple(values.shape)}")
        if group_index.device != values.device:
            problems.append(f"group_index is on {group_index.device}, values on {values.device}")
        if values.numel() == 0:
            problems.append("values is empty")
    if std_mode not in STD_MODES:
        problems.append(f"std_mode must be one of {STD_MODES}, got {std_mode!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        problems.append(f"eps must be a finite float > 0, got {eps!r}")
    if not problems and not bool(torch.isfinite(values).all()):  # NOTE: host sync
        problems.append("values contain NaN or inf (check the reward function)")
    return problems


def normalize_grouped(values: torch.Tensor, group_index: torch.Tensor, *, std_mode: str = "group",
                      eps: float = 1e-6, batch_std: torch.Tensor | None = None,
                      zero_degenerate: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Centre each value on its group's mean, then divide by a std chosen by ``std_mode``.

    - ``"group"``: the group's own std (Relax/text GRPO),
    - ``"batch"``: one std over all values of the batch (Flow-GRPO's ``global_std``),
    - ``"none"``: no division (Dr. GRPO).

    Design choices: stds are population stds (``correction=0``, so a group of
    one has std 0 rather than NaN); the divisor is ``std + eps``; a group whose variance is below
    1e-6 is *degenerate* (its candidates are indistinguishable to the scorer) and gets advantage 0
    in every mode, so that rounding noise divided by a tiny std is never turned into a signal.
    Group ids may be any int64 values; groups are reported in ascending id order.

    ``batch_std`` replaces the std of ``values`` in ``"batch"`` mode (the caller's std over
    every rank: Flow-GRPO's ``global_std``). ``zero_degenerate=False`` keeps the advantages of
    degenerate groups (the reference: a near-constant group divided by the global std is ~0,
    not forced to 0); they are still reported in ``info["degenerate"]``.

    Returns ``(normalized [N] (fp32, float64 for float64 input), info)`` where ``info`` holds
    ``group_ids``, ``group_mean``, ``group_std``, ``group_size`` and ``degenerate`` (all
    ``[num_groups]``), ``inverse`` (``[N]``, each value's group position) and ``batch_std`` (0-dim).
    """
    problems = _input_problems(values, group_index, std_mode, eps)
    if problems:
        raise ValueError("normalize_grouped: invalid input:\n  - " + "\n  - ".join(problems))

    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    vals = values.to(dtype)
    # NOTE: host sync (the number of groups sizes every output)
    group_ids, inverse, counts = torch.unique(group_index, sorted=True, return_inverse=True,
                                              return_counts=True)
    num_groups = group_ids.numel()
    sizes = counts.to(dtype)
    zeros = torch.zeros(num_groups, dtype=dtype, device=vals.device)
    group_mean = zeros.index_add(0, inverse, vals) / sizes
    centered = vals - group_mean[inverse]
    group_var = zeros.index_add(0, inverse, centered * centered) / sizes
    group_std = group_var.sqrt()
    batch_std = vals.std(correction=0) if batch_std is None else batch_std.to(vals)
    if std_mode == "group":
        normalized = centered / (group_std[inverse] + eps)
    elif std_mode == "batch":
        normalized = centered / (batch_std + eps)
    else:
        normalized = centered
    degenerate = group_var < DEGENERATE_VARIANCE
    if zero_degenerate:
        normalized = torch.where(degenerate[inverse], torch.zeros_like(normalized), normalized)
    info = {"group_ids": group_ids, "group_mean": group_mean, "group_std": group_std,
            "group_size": counts, "degenerate": degenerate, "inverse": inverse, "batch_std": batch_std}
    return normalized, info
