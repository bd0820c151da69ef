"""The algorithms' maths against their float64 oracles: DiffusionNFT's loss, GRPO-Guard's
clipped loss, MixGRPO-Flash's DPM-Solver++(2M) tail, and the Fast / MixGRPO step windows."""
from __future__ import annotations

import math
import random

import pytest
import torch

from flowgrpo_kernels.guard import guard_clip_loss, guard_clip_loss_reference, mean_shift_sq
from flowgrpo_kernels.nft import nft_loss, nft_loss_reference, old_policy_decay, reward_weight
from flowgrpo_kernels.ode_solvers import (dpm_pp_2m_step, dpm_pp_2m_step_reference,
                                          flash_tail_sigmas, solve_tail)
from flowgrpo_kernels.windows import (fast_branch_window, mix_window, mix_window_start,
                                      trunk_forwards_saved)
from flowgrpo_kernels import grpo_clip_loss


def _nft_inputs(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b = shape[0]
    x0 = torch.randn(shape, generator=g, dtype=torch.float64)
    t = torch.rand(b, generator=g, dtype=torch.float64) * 0.9 + 0.05
    noise = torch.randn(shape, generator=g, dtype=torch.float64)
    tc = t.reshape(-1, *([1] * (len(shape) - 1)))
    x_t = (1 - tc) * x0 + tc * noise
    v_old = noise - x0 + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    v = v_old + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64) * 3
    return [a.to(dtype) for a in (v, v_old, x_t, x0, t, adv)]


@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 2, 3, 3), (5, 11)])
@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_and_gradient_match_the_float64_oracle(shape, beta):
    v, v_old, x_t, x0, t, adv = _nft_inputs(shape, seed=sum(shape))
    v32 = v.clone().requires_grad_(True)
    loss, stats = nft_loss(v32, v_old, x_t, x0, t, adv, beta=beta, adv_clip_max=5.0)
    loss.backward()
    v64 = v.double().clone().requires_grad_(True)
    ref = nft_loss_reference(v64, v_old, x_t, x0, t, adv, beta=beta, adv_clip_max=5.0)
    ref.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v32.grad.double(), v64.grad, rtol=1e-4, atol=1e-8)
    assert set(stats) == {"positive_loss", "negative_loss", "reward_weight", "old_deviation"}


def test_nft_loss_in_float64_equals_the_oracle_to_rounding():
    v, v_old, x_t, x0, t, adv = _nft_inputs((4, 3, 6), seed=7, dtype=torch.float64)
    loss, _ = nft_loss(v, v_old, x_t, x0, t, adv, beta=0.5, adv_clip_max=2.0)
    assert loss.dtype == torch.float64
    ref = nft_loss_reference(v, v_old, x_t, x0, t, adv, beta=0.5, adv_clip_max=2.0)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)


def test_nft_gradient_pulls_toward_a_rewarded_sample_and_away_from_a_punished_one():
    # one sample, v == v_old: the gradient step must reduce the x0 error for r = 1 and raise it
    # for r = 0 (the negative policy's loss pushes the other way)
    v, v_old, x_t, x0, t, _ = _nft_inputs((1, 16), seed=3)
    v_old = v.clone()
    err_before = (x_t - t[:, None] * v - x0).pow(2).mean()
    for adv, sign in ((torch.tensor([5.0]), -1), (torch.tensor([-5.0]), 1)):
        vv = v.clone().requires_grad_(True)
        loss, _ = nft_loss(vv, v_old, x_t, x0, t, adv, beta=1.0, adv_clip_max=5.0)
        loss.backward()
        stepped = v - 1e-3 * vv.grad
        err_after = (x_t - t[:, None] * stepped - x0).pow(2).mean()
        assert sign * (err_after - err_before) > 0


def test_nft_reward_weight_and_old_policy_decay_follow_the_reference():
    r = reward_weight(torch.tensor([-9.0, -5.0, 0.0, 2.5, 9.0]), 5.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0]))
    assert old_policy_decay(10, delay=0, ramp=0.0, cap=0.0) == 0.0        # decay_type 0
    assert old_policy_decay(100, delay=0, ramp=0.001, cap=0.5) == pytest.approx(0.1)
    assert old_policy_decay(5000, delay=0, ramp=0.001, cap=0.5) == 0.5    # decay_type 1
    assert old_policy_decay(74, delay=75, ramp=0.0075, cap=0.999) == 0.0  # decay_type 2
    assert old_policy_decay(175, delay=75, ramp=0.0075, cap=0.999) == pytest.approx(0.75)


def test_nft_loss_refuses_bad_input_with_every_problem():
    v = torch.zeros(2, 3)
    with pytest.raises(ValueError) as e:
        nft_loss(v, torch.zeros(2, 4), v, v, torch.zeros(3), torch.zeros(2), beta=0.0,
                 adv_clip_max=-1.0)
    msg = str(e.value)
    assert "beta" in msg and "adv_clip_max" in msg and "v_old" in msg and "t must" in msg


def _guard_inputs(b, s, seed, adv_per_step=False):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(b, s, generator=g) * 0.02
    old = logp + torch.randn(b, s, generator=g) * 0.01
    shift = torch.rand(b, s, generator=g) * 1e-4
    std = torch.rand(b, s, generator=g) * 0.2 + 0.05
    dt = torch.rand(b, s, generator=g) * 0.1 + 0.02
    adv = torch.randn(b, s, generator=g) if adv_per_step else torch.randn(b, generator=g)
    return logp, old, adv, shift, std, dt


@pytest.mark.parametrize("b,s", [(3, 1), (5, 3), (7, 2)])
@pytest.mark.parametrize("ratio_norm,reweight", [(True, True), (True, False), (False, True)])
def test_guard_loss_and_gradients_match_the_float64_oracle(b, s, ratio_norm, reweight):
    logp, old, adv, shift, std, dt = _guard_inputs(b, s, seed=b * 10 + s, adv_per_step=(b == 7))
    eps = 2e-3
    lp, sh = logp.clone().requires_grad_(True), shift.clone().requires_grad_(True)
    loss, stats = guard_clip_loss(lp, old, adv, sh, std, dt, eps=eps, ratio_norm=ratio_norm,
                                  reweight=reweight)
    loss.backward()
    lp64, sh64 = logp.double().requires_grad_(True), shift.double().requires_grad_(True)
    ref = guard_clip_loss_reference(lp64, old, adv, sh64, std, dt, eps=eps,
                                    ratio_norm=ratio_norm, reweight=reweight)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(lp.grad.double(), lp64.grad, rtol=1e-5, atol=1e-9)
    if ratio_norm:  # the mean shift enters (with its gradient) only through the normalisation
        torch.testing.assert_close(sh.grad.double(), sh64.grad, rtol=1e-5, atol=1e-7)
    else:
        assert sh.grad is None
    assert "ratio_mean_bias" in stats


def test_guard_without_its_two_fixes_is_the_plain_clipped_grpo_loss():
    logp, old, adv, shift, std, dt = _guard_inputs(4, 3, seed=1)
    plain, _ = grpo_clip_loss(logp, old, adv, eps=1e-3)
    guard, _ = guard_clip_loss(logp, old, adv, shift, std, dt, eps=1e-3, ratio_norm=False,
                               reweight=False)
    torch.testing.assert_close(guard, plain, rtol=0, atol=0)


def test_guard_ratio_normalisation_recentres_the_ratio_on_one():
    # sample x' from the old transition; move the policy mean by delta: the plain log-ratio
    # has mean -|delta|^2/(2 std^2) < 0, the normalised one is centred on 0
    g = torch.Generator().manual_seed(0)
    n, d, std = 4000, 64, 0.1
    mean_old = torch.zeros(n, d, dtype=torch.float64)
    mean_new = mean_old + 0.02
    x = mean_old + std * torch.randn(n, d, generator=g, dtype=torch.float64)

    def logp(mean):
        return (-(x - mean) ** 2 / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(1)

    plain = (logp(mean_new) - logp(mean_old))
    shift = mean_shift_sq(mean_new, mean_old)
    normalised = (plain + shift / (2 * std ** 2)) * std
    assert plain.mean() < -4 * plain.std() / math.sqrt(n)
    assert abs(normalised.mean()) < 4 * normalised.std() / math.sqrt(n)


def test_guard_refuses_a_deterministic_step():
    logp, old, adv, shift, std, dt = _guard_inputs(2, 2, seed=2)
    std[1, 0] = 0.0
    with pytest.raises(ValueError, match="stochastic step"):
        guard_clip_loss(logp, old, adv, shift, std, dt, eps=1e-3)


@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 7)])
def test_dpm_solver_step_matches_its_float64_twin(shape):
    g = torch.Generator().manual_seed(0)
    x, v, prev = (torch.randn(shape, generator=g) for _ in range(3))
    for sigma, sigma_next, p, sp in ((0.8, 0.6, None, None), (0.6, 0.3, prev, 0.8),
                                     (0.3, 0.0, prev, 0.6)):
        out, d = dpm_pp_2m_step(x, v, sigma, sigma_next, p, sp)
        ref, dref = dpm_pp_2m_step_reference(x, v, sigma, sigma_next, p, sp)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d.double(), dref, rtol=1e-6, atol=1e-6)


def _gaussian_velocity(m, s):
    # data x0 ~ N(m, s^2), x = (1 - sigma) x0 + sigma eps: the exact flow-matching velocity
    def velocity(x, sigma):
        a = 1.0 - sigma
        var = a * a * s * s + sigma * sigma
        e_x0 = m + a * s * s / var * (x - a * m)
        e_eps = sigma / var * (x - a * m)
        return e_eps - e_x0
    return velocity


def _exact_ode(x, sigma_from, sigma_to, m, s):
    # the probability-flow ODE keeps the standardised coordinate (x - a m) / sqrt(a^2 s^2 + sigma^2)
    def scale(sigma):
        a = 1.0 - sigma
        return a, math.sqrt(a * a * s * s + sigma * sigma)
    a0, k0 = scale(sigma_from)
    a1, k1 = scale(sigma_to)
    return a1 * m + k1 * (x - a0 * m) / k0


def _euler(x, velocity, sigmas):
    for a, b in zip(sigmas[:-1], sigmas[1:]):
        x = x + (b - a) * velocity(x, a)
    return x


def test_dpm_solver_is_second_order_where_euler_is_first():
    # stop at sigma 0.05 (the last step to 0 is first order by design): halving the step must
    # cut the solver's error about 4x, Euler's about 2x
    m, s = 0.7, 0.3
    velocity = _gaussian_velocity(m, s)
    x = torch.linspace(-2, 2, 9, dtype=torch.float64)[None]
    exact = _exact_ode(x, 0.85, 0.05, m, s)
    errors = {}
    for n in (16, 32, 64):
        sigmas = torch.linspace(0.85, 0.05, n + 1, dtype=torch.float64).tolist()
        solved, calls = solve_tail(x, velocity, sigmas)
        assert calls == n
        errors[n] = ((solved - exact).abs().max().item(),
                     (_euler(x, velocity, sigmas) - exact).abs().max().item())
    assert errors[16][0] < errors[16][1] / 3
    assert errors[32][0] / errors[64][0] > 3.5   # second order: 4x per halving
    assert errors[32][1] / errors[64][1] < 2.5   # Euler: 2x


def test_flash_tail_schedule_follows_mixgrpo():
    tail = flash_tail_sigmas(num_steps=25, last_sde_step=3, ratio=0.4, shift=3.0)
    assert len(tail) == int((25 - 3) * 0.4) and tail[-1] == 0.0
    t0 = 1.0 - 4 / 25
    assert tail[0] == pytest.approx(3 * t0 / (1 + 2 * t0))
    assert all(a > b for a, b in zip(tail, tail[1:]))
    assert len(flash_tail_sigmas(num_steps=10, last_sde_step=8, ratio=0.1, shift=1.0)) == 2


def test_fast_branch_window_draws_every_start_in_the_range_and_nothing_else():
    rng = random.Random(0)
    starts = {fast_branch_window(rng, lo=0, hi=5, size=2)[0] for _ in range(400)}
    assert starts == {0, 1, 2, 3}
    assert fast_branch_window(random.Random(1), lo=2, hi=4, size=2) == [2, 3]
    with pytest.raises(ValueError):
        fast_branch_window(rng, lo=3, hi=4, size=2)
    assert trunk_forwards_saved(group_size=24, branch_step=3) == 69


def test_mix_window_slides_and_caps_as_the_reference():
    # sampling_steps 25, group_size 4, iters_per_group 25, overlap step 1 (the shipped script)
    kw = dict(size=4, shift_interval=25, stride=1, num_steps=25)
    assert mix_window(0, **kw) == [0, 1, 2, 3]
    assert mix_window(24, **kw) == [0, 1, 2, 3]
    assert mix_window(25, **kw) == [1, 2, 3, 4]
    assert mix_window(25 * 21, **kw) == [21, 22]          # clipped at max_start = 23
    assert mix_window(10 ** 6, **kw) == []                # the reference then trains nothing
    assert mix_window_start(10 ** 6, shift_interval=25, stride=1, max_start=23) == 23
    # roll back: 0, 4, 8 ... 20, then 0 again (24 > 23)
    starts = [mix_window_start(i, shift_interval=1, stride=4, max_start=23, roll_back=True)
              for i in range(8)]
    assert starts == [0, 4, 8, 12, 16, 20, 0, 4]


def test_compressed_tail_is_the_flash_schedule_on_a_linear_schedule():
    from flowgrpo_kernels.ode_solvers import compress_tail

    n, k = 25, 8
    linear = [1.0 - i / n for i in range(n + 1)]
    ours = compress_tail(linear[k + 1:], steps_after=n - k, ratio=0.4)
    ref = flash_tail_sigmas(num_steps=n, last_sde_step=k, ratio=0.4, shift=1.0)
    assert ours == pytest.approx(ref, abs=1e-12)
    assert compress_tail([0.5, 0.25, 0.0], steps_after=3, ratio=0.1) == [0.5, 0.0]


@pytest.mark.parametrize("shift", [1.0, 3.0, 0.5])
@pytest.mark.parametrize("last_sde_step", [0, 3, 8])
def test_engine_flash_tail_is_the_reference_schedule_on_a_shifted_one(shift, last_sde_step):
    from flowgrpo_kernels.ode_solvers import engine_flash_tail, time_shift

    n = 25
    schedule = [time_shift(shift, 1.0 - i / n) for i in range(n + 1)]  # MixGRPO's sampler
    ours = engine_flash_tail(schedule, last_sde_step + 1, 0.4)
    ref = flash_tail_sigmas(num_steps=n, last_sde_step=last_sde_step, ratio=0.4, shift=shift)
    assert ours == pytest.approx(ref, abs=1e-12)
    if shift != 1.0 and last_sde_step == 3:  # interpolating the shifted sigmas misses it
        from flowgrpo_kernels.ode_solvers import compress_tail
        ref = flash_tail_sigmas(num_steps=n, last_sde_step=3, ratio=0.5, shift=shift)
        assert engine_flash_tail(schedule, 4, 0.5) == pytest.approx(ref, abs=1e-12)
        interpolated = compress_tail(schedule[4:], steps_after=n - 3, ratio=0.5)
        assert max(abs(a - b) for a, b in zip(interpolated, ref)) > 1e-4


@pytest.mark.parametrize("config, mu, shift", [
    ({"shift": 3.0}, None, 3.0), ({"shift": 1.0}, None, 1.0),
    ({"use_dynamic_shifting": True}, 0.8, math.exp(0.8))])
def test_the_shift_is_recovered_from_diffusers_own_schedules(config, mu, shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from flowgrpo_kernels.ode_solvers import engine_flash_tail, fit_time_shift, time_shift

    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    scheduler.set_timesteps(10, **({} if mu is None else {"mu": mu}))
    sigmas = scheduler.sigmas.tolist()
    fitted, _ = fit_time_shift(sigmas)
    assert fitted == pytest.approx(shift, rel=1e-5)
    tail = engine_flash_tail(sigmas, 4, 0.5)   # k = 3: max(int(7 * 0.5), 2) = 3 points
    assert len(tail) == 3 and tail[0] == pytest.approx(sigmas[4], abs=1e-6) and tail[-1] == 0.0
    start = sigmas[4] / (shift - (shift - 1) * sigmas[4])
    assert tail[1] == pytest.approx(time_shift(shift, start / 2), rel=1e-5)


def test_a_schedule_no_shift_describes_keeps_the_interpolated_tail():
    from flowgrpo_kernels.ode_solvers import compress_tail, engine_flash_tail, fit_time_shift

    n = 12
    cosine = [math.cos(0.5 * math.pi * i / n) for i in range(n + 1)]
    cosine[-1] = 0.0
    assert fit_time_shift(cosine) is None
    assert engine_flash_tail(cosine, 5, 0.4) == compress_tail(cosine[5:], steps_after=n - 4,
                                                              ratio=0.4)
