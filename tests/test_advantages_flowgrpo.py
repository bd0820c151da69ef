"""Advantages as the Flow-GRPO reference computes them (global std over every rank, eps 1e-4,
clamp 5, near-constant groups kept) and the drop of zero-advantage rows, against float64
formulas written here; the global std over 2 gloo ranks against one rank on the concatenation."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import flowgrpo_kernels as kernels
from trainer.rewards.advantages import compute_advantages, kl_term, micro_batch_scale

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = dict(std_mode="batch", eps=1e-4, clip_max=5.0, zero_degenerate_groups=False)


def _reference_by_hand(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """(r - mean of its group) / (population std of ALL rewards + 1e-4), clamped to [-5, 5]."""
    r = rewards.double()
    out = torch.empty_like(r)
    for g in groups.unique():
        m = groups == g
        out[m] = r[m] - r[m].mean()
    return (out / (r.std(correction=0) + 1e-4)).clamp(-5.0, 5.0)


def _batch(seed=0, groups=6, size=4):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(groups * size, generator=g, dtype=torch.float64)
    rewards[:size] = 0.5 + 1e-5 * torch.arange(size, dtype=torch.float64)  # variance ~1e-10
    return rewards, torch.arange(groups).repeat_interleave(size)


def test_reference_options_match_the_reference_formula():
    rewards, groups = _batch()
    adv, metrics, failed = compute_advantages({"r": rewards}, groups, weights={"r": 1.0},
                                              required=["r"], **REFERENCE)
    torch.testing.assert_close(adv.double(), _reference_by_hand(rewards, groups), rtol=1e-6, atol=1e-7)
    assert failed == [] and adv[:4].abs().max() > 0  # the near-constant group is not zeroed
    default, _, _ = compute_advantages({"r": rewards}, groups, weights={"r": 1.0}, required=["r"],
                                       std_mode="batch")
    assert default[:4].abs().max() == 0  # the project's default still zeroes it


def test_a_rare_success_is_clamped_to_five():
    """One success in 384 (16 groups of 24): unclamped 18.8, the reference trains it at 5."""
    rewards = torch.zeros(384, dtype=torch.float64)
    rewards[7] = 1.0
    groups = torch.arange(16).repeat_interleave(24)
    raw, _, _ = compute_advantages({"r": rewards}, groups, weights={"r": 1.0}, required=["r"],
                                   std_mode="batch", eps=1e-4)
    assert raw[7].item() == pytest.approx((1 - 1 / 24) / ((1 / 384 * (1 - 1 / 384)) ** 0.5 + 1e-4),
                                          rel=1e-5)
    assert raw[7].item() > 18.0
    adv, metrics, _ = compute_advantages({"r": rewards}, groups, weights={"r": 1.0},
                                         required=["r"], **REFERENCE)
    assert adv[7].item() == 5.0 and metrics["reward/advantage_clipped"] == 1.0
    torch.testing.assert_close(adv.double(), _reference_by_hand(rewards, groups), rtol=1e-6, atol=1e-7)


def test_dropping_zero_advantage_rows_averages_over_the_rest():
    """48 rows, 16 with advantage 0, two updates of three micro-batches: the sum of the scaled
    micro-batch losses (clipped surrogate + KL) is the mean over the update's non-zero rows
    (float64 oracle)."""
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(48, generator=g, dtype=torch.float64)
    adv[torch.randperm(48, generator=g)[:16]] = 0.0
    logp = torch.randn(48, 2, generator=g, dtype=torch.float64)
    old = logp + 1e-5 * torch.randn(48, 2, generator=g, dtype=torch.float64)
    kl = torch.rand(48, 2, generator=g, dtype=torch.float64)
    order = torch.randperm(48, generator=g)
    updates = [list(order[:24].split(8)), list(order[24:].split(8))]
    for update in updates:
        rows_all = torch.cat(update)
        for drop in (False, True):
            total = 0.0
            for rows in update:  # what the loop's forward_backward_step adds up
                loss, _ = kernels.grpo_clip_loss(logp[rows], old[rows], adv[rows], eps=1e-4)
                loss = loss + 0.01 * kl_term(kl[rows], adv[rows], drop_zero_advantage=drop)
                total = total + loss * micro_batch_scale(adv, rows, update, drop_zero_advantage=drop)
            per_row, _ = zip(*[kernels.grpo_clip_loss(logp[r:r + 1], old[r:r + 1], adv[r:r + 1],
                                                      eps=1e-4) for r in rows_all.tolist()])
            per_row = torch.stack(per_row) + 0.01 * kl[rows_all].mean(1)
            kept = adv[rows_all] != 0
            want = per_row[kept].mean() if drop else per_row.mean()
            torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-15)
    assert micro_batch_scale(torch.zeros(4), torch.arange(2), [torch.arange(2), torch.arange(2, 4)],
                             drop_zero_advantage=True) == 0.0


# ---- two gloo ranks -------------------------------------------------------------------------
def _rank(rank: int, world: int, port: int, results, errors) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from trainer.rewards.advantages import compute_advantages as compute
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        rewards, groups = _batch(seed=5, groups=6, size=4)
        mine = slice(rank * 12, (rank + 1) * 12)  # each rank owns three whole groups
        adv, metrics, _ = compute({"r": rewards[mine], "aux": rewards[mine] ** 2}, groups[mine],
                                  weights={"r": 1.0, "aux": 0.5}, required=["r"], **REFERENCE)
        results.put((rank, adv.tolist()))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which asserts
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def test_global_std_over_two_gloo_ranks_equals_one_rank_on_the_concatenation():
    from trainer.launch import free_port

    ctx = mp.get_context("spawn")
    results, errors = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results, errors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    problems = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not problems and all(p.exitcode == 0 for p in procs), problems
    by_rank = dict(results.get(timeout=10) for _ in range(2))
    two_ranks = torch.tensor(by_rank[0] + by_rank[1], dtype=torch.float64)
    rewards, groups = _batch(seed=5, groups=6, size=4)
    one_rank, _, _ = compute_advantages({"r": rewards, "aux": rewards ** 2}, groups,
                                        weights={"r": 1.0, "aux": 0.5}, required=["r"], **REFERENCE)
    torch.testing.assert_close(two_ranks, one_rank.double(), rtol=1e-6, atol=1e-7)
    # and it is not what each rank's own std would give
    local, _, _ = compute_advantages({"r": rewards[:12], "aux": rewards[:12] ** 2}, groups[:12],
                                     weights={"r": 1.0, "aux": 0.5}, required=["r"], **REFERENCE)
    assert (local.double() - one_rank[:12].double()).abs().max() > 1e-3
