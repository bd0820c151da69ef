"""The shared trunk of a group (Flow-GRPO-Fast, MixGRPO): computed once per x_T, not per row.

When the candidates of a group share x_T (``init_same_noise``: the driver gives them one
initial-noise id) and a prompt, every deterministic (ODE) step before the first SDE step
computes the same value for each of them. The engine then runs those steps on one row per
(x_T id, prompt), and expands the result to the group's rows at the first SDE step, where the
candidates branch. Per group of G candidates whose first SDE step is k this saves
``(G - 1) * k`` transformer forwards (twice that with CFG, whose forward has two halves);
docs/algorithms.md counts it for the shipped recipes.

The rows after the branch are exactly what the unshared sampler would compute from the same
x_k; x_k itself comes from a forward over fewer rows, which may differ from the full-batch
forward in the last bits on some backends. The replay trains from the recorded (x_i, x_i+1)
pairs, so the log-prob parity is unaffected either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

import flowgrpo_kernels as kernels


@dataclass(frozen=True)
class TrunkPlan:
    """Rows ``unique`` carry the trunk; ``expand[r]`` is row r's position among them."""

    unique: list[int]
    expand: list[int]
    branch_step: int

    def forwards_saved(self, cfg_halves: int = 1) -> int:
        return (len(self.expand) - len(self.unique)) * self.branch_step * cfg_halves


def plan_trunk(initial_noise_ids: Sequence[str] | None, prompts: Sequence[str],
               sde_indices: Sequence[int]) -> TrunkPlan | None:
    """The shared-trunk plan of a request, or None when no row shares its trunk."""
    if not initial_noise_ids or not sde_indices or min(sde_indices) == 0:
        return None
    first: dict[tuple[str, str], int] = {}
    unique, expand = [], []
    for row, key in enumerate(zip(initial_noise_ids, prompts)):
        if key not in first:
            first[key] = len(unique)
            unique.append(row)
        expand.append(first[key])
    if len(unique) == len(expand):
        return None
    return TrunkPlan(unique=unique, expand=expand, branch_step=int(min(sde_indices)))


def select_rows(conditions: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    """Every condition (negative halves included) at ``rows`` of the batch."""
    index = None
    out = {}
    for key, value in conditions.items():
        if index is None or index.device != value.device:
            index = torch.tensor(rows, dtype=torch.long, device=value.device)
        out[key] = value.index_select(0, index)
    return out


def run_trunk(plan: TrunkPlan, velocity_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              x_t: torch.Tensor, sigmas: Sequence[float]) -> torch.Tensor:
    """x at the branch step for every row: the ODE steps ``0 .. branch_step - 1`` on the unique
    rows (``velocity_of(x, sigma)`` is the model on those rows), then expanded."""
    device = x_t.device
    x = x_t.index_select(0, torch.tensor(plan.unique, device=device))
    sig = torch.tensor([float(s) for s in sigmas[:plan.branch_step + 1]], dtype=torch.float32,
                       device=device)
    rows = x.shape[0]
    for i in range(plan.branch_step):
        s, s_next = sig[i].expand(rows), sig[i + 1].expand(rows)
        v = velocity_of(x, s)
        x = kernels.sde_step(x, v, s, s_next, eta=0.0, sde_type="ode", validate=False).prev_sample
    return x.index_select(0, torch.tensor(plan.expand, device=device))
