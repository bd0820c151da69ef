"""Clipped GRPO loss and grouped advantage normalisation."""
import pytest
import torch

import flowgrpo_kernels as kernels


def _loss_by_hand(logp, old, adv, eps, eps_high):
    """Elementwise PPO surrogate written out with python floats (float64)."""
    out = []
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            a = float(adv[i] if adv.dim() == 1 else adv[i, j])
            r = float(torch.exp(logp[i, j] - old[i, j]))
            out.append(max(-a * r, -a * min(max(r, 1 - eps), 1 + eps_high)))
    return sum(out) / len(out)


# ----------------------------------------------------------------------------------- GRPO loss


@pytest.mark.parametrize("adv_shape", ["per_sample", "per_step"])
def test_ratio_one_gives_minus_mean_advantage(adv_shape):
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(5, 3, generator=g)
    adv = torch.randn(5, generator=g) if adv_shape == "per_sample" else torch.randn(5, 3, generator=g)
    logp_train = logp.clone().requires_grad_()
    loss, stats = kernels.grpo_clip_loss(logp_train, logp, adv, eps=1e-4)
    full_adv = adv[:, None].expand(5, 3) if adv.dim() == 1 else adv
    assert loss.item() == pytest.approx(-full_adv.mean().item(), rel=1e-6, abs=1e-7)
    for key, value in (("ratio_mean", 1.0), ("ratio_std", 0.0), ("ratio_min", 1.0), ("ratio_max", 1.0),
                       ("clip_fraction", 0.0), ("approx_kl", 0.0)):
        assert stats[key].dim() == 0 and not stats[key].requires_grad
        assert stats[key].item() == value, key
    loss.backward()  # at ratio 1 the gradient is the plain policy gradient -A / (B * S)
    torch.testing.assert_close(logp_train.grad, -full_adv / 15)


def test_clipping_engages_exactly_outside_the_interval():
    eps, eps_high = 0.1, 0.2
    ratios = torch.tensor([0.85, 0.95, 1.15, 1.25], dtype=torch.float64)
    old = torch.zeros(2, 4, dtype=torch.float64)
    logp = torch.log(ratios).repeat(2, 1).requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = kernels.grpo_clip_loss(logp, old, adv, eps=eps, eps_high=eps_high)
    assert loss.item() == pytest.approx(_loss_by_hand(logp.detach(), old, adv, eps, eps_high), abs=1e-15)
    assert stats["clip_fraction"].item() == 0.5  # 0.85 and 1.25, in both rows
    loss.backward()
    r = ratios.tolist()
    # A > 0: the upper clip zeroes the gradient of r > 1 + eps_high; below 1 - eps it still flows
    # A < 0: the lower clip zeroes the gradient of r < 1 - eps; above 1 + eps_high it still flows
    expect = torch.tensor([[-r[0], -r[1], -r[2], 0.0], [0.0, r[1], r[2], r[3]]], dtype=torch.float64) / 8
    torch.testing.assert_close(logp.grad, expect, rtol=1e-12, atol=0)
    # just inside the bounds nothing is clipped
    inside = torch.log(torch.tensor([[1 - eps + 1e-6, 1 + eps_high - 1e-6]], dtype=torch.float64))
    _, stats = kernels.grpo_clip_loss(inside, torch.zeros_like(inside), torch.ones(1, dtype=torch.float64),
                                      eps=eps, eps_high=eps_high)
    assert stats["clip_fraction"].item() == 0.0


def test_loss_and_stats_match_a_direct_computation():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(7, 3, generator=g, dtype=torch.float64) * 0.01
    old = logp + torch.randn(7, 3, generator=g, dtype=torch.float64) * 0.05
    adv = torch.randn(7, 3, generator=g, dtype=torch.float64)
    loss, stats = kernels.grpo_clip_loss(logp, old, adv, eps=0.03, eps_high=0.05)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(_loss_by_hand(logp, old, adv, 0.03, 0.05), rel=1e-12)
    r = torch.exp(logp - old)
    assert stats["ratio_mean"].item() == pytest.approx(r.mean().item(), rel=1e-12)
    assert stats["ratio_std"].item() == pytest.approx(r.std(correction=0).item(), rel=1e-12)
    assert stats["ratio_min"].item() == r.min().item() and stats["ratio_max"].item() == r.max().item()
    assert stats["clip_fraction"].item() == ((r < 0.97) | (r > 1.05)).double().mean().item()
    assert stats["approx_kl"].item() == pytest.approx(0.5 * ((logp - old) ** 2).mean().item(), rel=1e-12)


def test_bf16_inputs_are_computed_in_fp32():
    logp = torch.randn(4, 2).bfloat16()
    loss, stats = kernels.grpo_clip_loss(logp, logp, torch.ones(4), eps=0.2)
    assert loss.dtype == torch.float32 and stats["ratio_mean"].dtype == torch.float32
    assert loss.item() == -1.0


def test_grpo_bad_inputs_one_error():
    with pytest.raises(ValueError) as info:
        kernels.grpo_clip_loss(torch.zeros(4, 3), torch.zeros(4, 2), torch.zeros(3), eps=1.5, eps_high=-1.0)
    msg = str(info.value)
    for needle in ("eps must be in (0, 1), got 1.5", "eps_high must be > 0, got -1.0", "old_log_prob has shape (4, 2), expected (4, 3)",
                   "advantages must have shape [B]=(4,)"):
        assert needle in msg, (needle, msg)
    with pytest.raises(ValueError, match=r"log_prob must be a non-empty \[B, S\] matrix"):
        kernels.grpo_clip_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), eps=0.2)
    with pytest.raises(ValueError, match="log_prob must be a floating tensor"):
        kernels.grpo_clip_loss(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2), torch.zeros(2), eps=0.2)


# ----------------------------------------------------------------------- advantage normalisation


def _groups_by_hand(values, ids):
    groups = {}
    for val, gid in zip(values.tolist(), ids.tolist()):
        groups.setdefault(gid, []).append(val)
    stats = {}
    for gid, vals in groups.items():
        mean = sum(vals) / len(vals)
        var = sum((x - mean) ** 2 for x in vals) / len(vals)
        stats[gid] = (mean, var ** 0.5)
    return stats


@pytest.mark.parametrize("std_mode", ["group", "batch", "none"])
def test_normalize_grouped_modes(std_mode):
    values = torch.tensor([1.0, 3.0, 2.0, 10.0, 14.0, 0.5, 0.5, 0.5, 7.0], dtype=torch.float64)
    ids = torch.tensor([7, 7, 7, 3, 3, 9, 9, 9, 4])  # arbitrary ids; group 9 tied, group 4 a singleton
    out, info = kernels.normalize_grouped(values, ids, std_mode=std_mode, eps=1e-6)
    by_hand = _groups_by_hand(values, ids)
    batch_std = values.std(correction=0).item()
    assert info["group_ids"].tolist() == [3, 4, 7, 9]
    assert info["degenerate"].tolist() == [False, True, False, True]
    assert info["group_size"].tolist() == [2, 1, 3, 3]
    for k, gid in enumerate([3, 4, 7, 9]):
        assert info["group_mean"][k].item() == pytest.approx(by_hand[gid][0], rel=1e-12)
        assert info["group_std"][k].item() == pytest.approx(by_hand[gid][1], abs=1e-12)
    for val, gid, got in zip(values.tolist(), ids.tolist(), out.tolist()):
        mean, std = by_hand[gid]
        if gid in (4, 9):
            assert got == 0.0  # degenerate groups carry no signal
            continue
        denom = {"group": std + 1e-6, "batch": batch_std + 1e-6, "none": 1.0}[std_mode]
        assert got == pytest.approx((val - mean) / denom, rel=1e-12)


def test_normalize_grouped_degenerate_threshold_is_on_the_variance():
    values = torch.tensor([0.0, 2e-3, 5.0, 5.0 + 1.9e-3])  # variances 1e-6 and 0.9025e-6
    out, info = kernels.normalize_grouped(values, torch.tensor([0, 0, 1, 1]))
    assert info["degenerate"].tolist() == [False, True]
    assert out[:2].abs().tolist() == pytest.approx([1.0, 1.0], rel=1e-3) and out[2:].tolist() == [0.0, 0.0]
    half, _ = kernels.normalize_grouped(values.half(), torch.tensor([0, 0, 1, 1]))
    assert half.dtype == torch.float32


def test_normalize_grouped_bad_inputs_one_error():
    with pytest.raises(ValueError) as info:
        kernels.normalize_grouped(torch.zeros(4), torch.zeros(3, dtype=torch.int64), std_mode="global", eps=0.0)
    msg = str(info.value)
    for needle in ("group_index has shape (3,), expected (4,)", "std_mode must be one of", "eps must be"):
        assert needle in msg, (needle, msg)
    with pytest.raises(ValueError, match="group_index must be a 1-D int64 tensor"):
        kernels.normalize_grouped(torch.zeros(4), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN or inf"):
        kernels.normalize_grouped(torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.int64))
