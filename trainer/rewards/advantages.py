"""GRPO advantages from several reward components.

Each weighted component is normalised within its prompt group by ``kernels.normalize_grouped``
(the one implementation of the maths: population stds, ``std + eps``, groups with variance
under 1e-6 zeroed), then the normalised components are summed with their weights:

    A_i = sum_c w_c * (r_ci - mean_{j in g(i)} r_cj) / (std_c + eps)

std_mode ``group``: std_c is the std of group g(i) (Relax / text GRPO); ``batch``: the std of
the component over the whole batch of every rank (the Flow-GRPO reference's ``global_std``:
with torch.distributed initialised, two all-reduces give the global count, mean and sum of
squared deviations; a rank with no usable value still takes part); ``none``: no division
(Dr. GRPO: mean-centring only).

Flow-GRPO's reference options: ``eps`` 1e-4 (``std + eps``), ``clip_max`` 5 (advantages
clamped to [-5, 5]), ``zero_degenerate_groups=False`` (a near-constant group keeps its tiny
advantages instead of being zeroed). Defaults keep the project's behaviour (eps 1e-6, no
clamp, degenerate groups zeroed).

Design choices:

* A required component that is absent fails every group; a non-finite value fails the group
  it is in. Failed groups get advantage 0, are listed in ``failed_groups``, are logged, and are
  left out of the normalisation (including the batch std) and of the advantage metrics.
* A weighted component that is not required may have gaps: a non-finite value contributes 0
  to that sample's advantage and is left out of its group's statistics; if the component is
  absent altogether it contributes nothing (a warning says so).
* No weights at all means weight 1 for every component given.
* ``reward/advantage_clipped`` counts advantages the clamp changed;
  ``reward/zero_advantage_fraction`` is the share of exactly-zero advantages (the rows
  ``train.drop_zero_advantage`` leaves out of the update).
* ``reward/degenerate_groups`` counts groups in which every weighted component is degenerate
  (no signal to rank the candidates: their advantages are all 0); ``reward/degenerate`` is 1
  when the variance of the advantages over the batch falls under 1e-6 (docs/design.md#grpo-update).
* ``reward/group_std_mean`` is the mean over groups of the std of the weighted raw reward
  ``sum_c w_c r_c`` (the plain reward's group std when there is one component).
* Statistics are computed in float64 on the tensors' device; advantages come back fp32.
"""
from __future__ import annotations

import logging
import math
import warnings

import torch
import torch.distributed as dist

from flowgrpo_kernels import normalize_grouped
from flowgrpo_kernels.advantages import DEGENERATE_VARIANCE, STD_MODES

log = logging.getLogger(__name__)


def _stats(values: torch.Tensor) -> tuple[float, float, float, float]:
    if values.numel() == 0:
        return (math.nan,) * 4
    return (values.mean().item(), values.std(unbiased=False).item(), values.min().item(),
            values.max().item())


def _check(components, group_index, weights, required, std_mode) -> int:
    problems = []
    batch = None
    if not isinstance(group_index, torch.Tensor) or group_index.dim() != 1 or \
            group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
        problems.append("group_index must be a 1-D integer tensor")
    else:
        batch = group_index.shape[0]
        if batch == 0:
            problems.append("empty batch")
    if std_mode not in STD_MODES:
        problems.append(f"std_mode {std_mode!r} is not one of {list(STD_MODES)}")
    for name, values in components.items():
        if not isinstance(values, torch.Tensor) or values.dim() != 1 or \
                (batch is not None and values.shape[0] != batch):
            shape = list(values.shape) if isinstance(values, torch.Tensor) \
                else type(values).__name__
            problems.append(f"component {name!r} must be a [{batch}] tensor, got {shape}")
    for name, weight in weights.items():
        if not isinstance(weight, (int, float)) or not math.isfinite(weight):
            problems.append(f"weight of {name!r} is {weight!r}, not a finite number")
    if weights:
        unweighted = [c for c in required if c not in weights]
        if unweighted:
            problems.append(f"required components {unweighted} have no weight")
    if problems:
        raise ValueError("compute_advantages: " + "; ".join(problems))
    return int(batch)


def global_std(values: torch.Tensor) -> torch.Tensor:
    """Population std of ``values`` over every rank (float64, 0-dim); the local std without
    torch.distributed. Two-pass (mean first), so it matches the std of the concatenation."""
    x = values.to(torch.float64)
    if not (dist.is_available() and dist.is_initialized()):
        return x.std(correction=0) if x.numel() else torch.zeros((), dtype=torch.float64)
    device = torch.device("cpu") if dist.get_backend() == "gloo" else x.device
    totals = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
                          x.sum()]).to(device)
    dist.all_reduce(totals)
    count = totals[0].clamp_min(1.0)
    mean = (totals[1] / count).to(x.device)
    sq = ((x - mean) ** 2).sum().reshape(1).to(device)
    dist.all_reduce(sq)
    return (sq[0] / count).sqrt().to(x.device)


def compute_advantages(components: dict[str, torch.Tensor], group_index: torch.Tensor, *,
                       weights: dict[str, float], required: list[str], std_mode: str = "group",
                       eps: float | None = None, clip_max: float | None = None,
                       zero_degenerate_groups: bool = True
                       ) -> tuple[torch.Tensor, dict[str, float], list[int]]:
    """-> (advantages fp32 [B], metrics, failed group ids). See the module docstring.

    ``eps`` None uses normalize_grouped's own default; ``clip_max`` None clamps nothing. With
    ``std_mode="batch"`` under torch.distributed every rank must call this (a collective).
    """
    _check(components, group_index, weights, required, std_mode)
    if clip_max is not None and not (isinstance(clip_max, (int, float)) and clip_max > 0):
        raise ValueError(f"compute_advantages: clip_max must be a number > 0 or None, got {clip_max!r}")
    device = group_index.device
    groups, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = groups.numel()
    values = {c: v.detach().to(device=device, dtype=torch.float64) for c, v in components.items()}
    weights = dict(weights) if weights else {c: 1.0 for c in components}

    failed, reasons = _failed_groups(values, required, inverse, num_groups)
    valid = ~failed[inverse]
    absent = [c for c in weights if c not in values and c not in required]
    if absent:
        warnings.warn(f"compute_advantages: weighted components {absent} were not produced; "
                      "they contribute nothing this step", RuntimeWarning, stacklevel=2)
    gi = group_index.to(torch.int64)
    options = {"std_mode": std_mode, "zero_degenerate": zero_degenerate_groups}
    if eps is not None:
        options["eps"] = eps
    advantages, combined_raw, low_variance = _weighted_sum(values, weights, valid, gi, groups,
                                                           options)
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages))
    clipped = 0.0
    if clip_max is not None:
        clipped = float((advantages.abs() > clip_max).sum().item())
        advantages = advantages.clamp(-float(clip_max), float(clip_max))

    failed_ids = groups[failed].tolist()
    if failed_ids:
        log.warning("reward: %d of %d groups failed and are not trained on (%s); group ids %s",
                    len(failed_ids), num_groups, "; ".join(reasons), failed_ids[:16])
    metrics = _component_metrics(values)
    metrics.update(_advantage_metrics(advantages, valid, combined_raw, gi, low_variance & ~failed))
    metrics.update({"reward/num_groups": float(num_groups),
                    "reward/failed_groups": float(len(failed_ids)),
                    "reward/advantage_clipped": clipped})
    return advantages.to(torch.float32), metrics, failed_ids


def _failed_groups(values: dict[str, torch.Tensor], required: list[str], inverse: torch.Tensor,
                   num_groups: int) -> tuple[torch.Tensor, list[str]]:
    """Groups with a required component missing or non-finite (bool [G]), and why."""
    failed = torch.zeros(num_groups, dtype=torch.bool, device=inverse.device)
    reasons: list[str] = []
    for name in required:
        if name not in values:
            failed[:] = True
            reasons.append(f"required component {name!r} is missing")
            continue
        bad = ~torch.isfinite(values[name])
        if bad.any():
            failed.index_fill_(0, inverse[bad].unique(), True)
            reasons.append(f"required component {name!r} is non-finite for {int(bad.sum())} "
                           "sample(s)")
    return failed, reasons


def _weighted_sum(values: dict[str, torch.Tensor], weights: dict[str, float], valid: torch.Tensor,
                  gi: torch.Tensor, groups: torch.Tensor, options: dict
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum over components of weight x the component normalized within its groups (float64
    [B]), the weighted raw rewards, and which groups had no signal in any component."""
    device = valid.device
    advantages = torch.zeros(valid.shape[0], dtype=torch.float64, device=device)
    combined_raw = torch.zeros_like(advantages)
    low_variance = torch.ones(groups.numel(), dtype=torch.bool, device=device)
    # sorted: under torch.distributed every rank runs the same collectives in the same order
    for name, weight in sorted(weights.items()):
        x = values.get(name)
        usable = torch.isfinite(x) & valid if x is not None else None
        if options["std_mode"] == "batch":
            local = x[usable] if x is not None else torch.zeros(0, dtype=torch.float64, device=device)
            options["batch_std"] = global_std(local)
        if x is None or not usable.any():
            continue
        normalized, info = normalize_grouped(x[usable], gi[usable], **options)
        advantages[usable] += weight * normalized.to(torch.float64)
        signal = info["group_ids"][~info["degenerate"]]
        low_variance &= ~torch.isin(groups, signal)
        combined_raw += weight * torch.where(usable, x, torch.zeros_like(x))
    return advantages, combined_raw, low_variance


def _component_metrics(values: dict[str, torch.Tensor]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for name, x in values.items():
        finite = x[torch.isfinite(x)]
        mean, std, lo, hi = _stats(finite)
        metrics.update({f"reward/{name}_mean": mean, f"reward/{name}_std": std,
                        f"reward/{name}_min": lo, f"reward/{name}_max": hi,
                        f"reward/{name}_nonfinite": float(x.numel() - finite.numel())})
    return metrics


def _advantage_metrics(advantages: torch.Tensor, valid: torch.Tensor, combined_raw: torch.Tensor,
                       gi: torch.Tensor, degenerate_ok: torch.Tensor) -> dict[str, float]:
    kept = advantages[valid]
    adv_var = kept.var(unbiased=False).item() if kept.numel() else 0.0
    group_std_mean = 0.0
    if valid.any():
        _, raw = normalize_grouped(combined_raw[valid], gi[valid], std_mode="none")
        group_std_mean = raw["group_std"].mean().item()
    return {
        "reward/advantage_mean": kept.mean().item() if kept.numel() else 0.0,
        "reward/advantage_std": math.sqrt(adv_var),
        "reward/group_std_mean": group_std_mean,
        "reward/degenerate": float(adv_var < DEGENERATE_VARIANCE),
        "reward/degenerate_groups": float(degenerate_ok.sum().item()),
        "reward/zero_advantage_fraction": float((advantages == 0).double().mean().item()),
    }


def micro_batch_scale(advantages: torch.Tensor, rows: torch.Tensor, update: list[torch.Tensor], *,
                      drop_zero_advantage: bool) -> float:
    """The weight of one micro-batch's mean loss in its optimizer update.

    Keeping every row: ``len(rows) / rows in the update`` (the update's loss is the mean over
    its rows). Dropping zero-advantage rows (the Flow-GRPO reference filters them out): the
    mean is over the update's non-zero rows only, ``len(rows) / non-zero rows in the update``;
    a zero-advantage row contributes no policy gradient, so only the denominator changes (its
    KL term is left out by ``kl_term``). An update with no non-zero row gets weight 0.
    """
    if not drop_zero_advantage:
        return len(rows) / sum(len(r) for r in update)
    # NOTE: one host sync per micro-batch (a count); negligible next to its forward
    kept = sum(int((advantages[r] != 0).sum()) for r in update)
    return len(rows) / kept if kept else 0.0


def kl_term(kl: torch.Tensor, advantages: torch.Tensor, *, drop_zero_advantage: bool) -> torch.Tensor:
    """The micro-batch's KL term, ``kl`` [b, S] per (row, step), to add to its mean policy loss.

    With ``drop_zero_advantage`` the dropped rows' KL is left out too (mean over the
    micro-batch's rows with a zero for them), so that, scaled by ``micro_batch_scale``, the
    update's KL is the mean over its non-zero-advantage rows, as the reference's filter gives.
    """
    if not drop_zero_advantage:
        return kl.mean()
    kept = (advantages.to(kl.device) != 0).to(kl.dtype)
    return (kl * kept[:, None]).mean()
