"""SDE step / replay log-prob: Triton and torch backends against the float64 reference.

On a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1 (set below, before the
kernels are first imported); with CUDA they run compiled on the GPU.
"""
import itertools
import math
import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import flowgrpo_kernels as kernels  # noqa: E402
from flowgrpo_kernels import sde_reference as ref  # noqa: E402
from flowgrpo_kernels.sde_types import TABLE  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPES = ("sde", "dance", "cps")
DTYPES = (torch.float32, torch.bfloat16)
EPS32 = torch.finfo(torch.float32).eps
SHAPE = (3, 5, 7, 11)  # N = 385: odd, not a power of two, smaller than one tile
ETA = 0.7


def _sigmas(batch=3):
    # per-sample steps, one of them the last step (sigma_next == 0) for sde/dance
    s = torch.tensor([0.93, 0.61, 0.27, 0.8, 0.4][:batch], device=DEVICE)
    sn = torch.tensor([0.81, 0.55, 0.0, 0.3, 0.05][:batch], device=DEVICE)
    return s, sn


def _sigmas_for(sde_type, batch=3):
    s, sn = _sigmas(batch)
    if sde_type == "cps":  # cps has no density at sigma_next == 0
        sn = torch.where(sn == 0, torch.full_like(sn, 0.02), sn)
    return s, sn


def _inputs(shape, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    v = torch.randn(shape, generator=g).to(DEVICE, dtype)
    noise = torch.randn(shape, generator=g).to(DEVICE)
    return x, v, noise


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _three_way(kernel, torch32, oracle, what):
    """flash-attention's check: the kernel's error against float64 is within twice the error of
    the same-precision torch reference, plus a few fp32 ulps of the result's scale."""
    err_kernel, err_torch = _max_err(kernel, oracle), _max_err(torch32, oracle)
    floor = 4 * EPS32 * oracle.double().abs().max().item()
    assert err_kernel <= 2 * err_torch + floor, (what, err_kernel, err_torch, floor)


# ------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize("sde_type", TYPES + ("ode",))
def test_coefficient_form_equals_literal_formulas(sde_type):
    x, v, _ = _inputs(SHAPE, torch.float64)
    s, sn = _sigmas_for(sde_type)
    mean, std = ref.sde_transition_ref(x, v, s, sn, eta=ETA, sde_type=sde_type)
    a, b, var = ref.transition_coefficients_ref(s, sn, eta=ETA, sde_type=sde_type, batch=3,
                                                dtype=torch.float64, device=DEVICE)
    col = (3, 1, 1, 1)
    torch.testing.assert_close(a.view(col) * x + b.view(col) * v, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, std ** 2, rtol=1e-12, atol=1e-15)


def test_sde_transition_is_flow_grpo_formula():
    """Spot check against Flow-GRPO's sd3_sde_with_logprob formula written out by hand."""
    x, v, _ = _inputs((2, 9), torch.float64)
    s, sn = 0.6, 0.45
    std_dev_t = math.sqrt(s / (1 - s)) * ETA
    dt = sn - s
    expect = x * (1 + std_dev_t ** 2 / (2 * s) * dt) + v * (1 + std_dev_t ** 2 * (1 - s) / (2 * s)) * dt
    mean, std = ref.sde_transition_ref(x, v, s, sn, eta=ETA, sde_type="sde")
    torch.testing.assert_close(mean, expect, rtol=1e-14, atol=1e-14)
    assert std.tolist() == pytest.approx([std_dev_t * math.sqrt(-dt)] * 2, rel=1e-14)


def test_log_density_is_the_full_gaussian():
    x, v, noise = _inputs(SHAPE, torch.float64)
    mean, std = ref.sde_transition_ref(x, v, 0.5, 0.3, eta=ETA, sde_type="sde")
    sample = mean + std.view(-1, 1, 1, 1) * noise.double()
    normal = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1).expand_as(mean))
    expect = normal.log_prob(sample).flatten(1).mean(1)
    torch.testing.assert_close(ref.gaussian_log_prob_ref(sample, mean, std), expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sde_type", TYPES)
def test_reference_gradient_gradcheck(sde_type):
    x, v, noise = _inputs((2, 3, 5), torch.float64)
    s, sn = _sigmas_for(sde_type, 2)
    prev = kernels.sde_step(x, v, s, sn, eta=ETA, sde_type=sde_type, noise=noise, backend="torch").prev_sample
    v = v.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda vv: kernels.sde_log_prob(x, vv, prev, s, sn, eta=ETA, sde_type=sde_type, backend="torch"), (v,))


# ------------------------------------------------------------- Triton (and torch) vs float64


def _replay_case(sde_type, dtype, shape=SHAPE, seed=0):
    x, v, noise = _inputs(shape, dtype, seed)
    s, sn = _sigmas_for(sde_type, shape[0])
    mean64, std64 = ref.sde_transition_ref(x.double(), v.double(), s.double(), sn.double(),
                                           eta=ETA, sde_type=sde_type)
    col = (-1,) + (1,) * (len(shape) - 1)
    prev = (mean64 + std64.view(col) * noise.double()).to(dtype)
    return x, v, prev, s, sn


def _log_prob_and_grad(backend, x, v, prev, s, sn, sde_type, config=None):
    v = v.clone().requires_grad_()
    if backend == "config":  # the Triton kernels with a non-default tiling
        from flowgrpo_kernels import sde_triton
        b = x.shape[0]
        lp = sde_triton.sde_log_prob(x.reshape(b, -1), v.reshape(b, -1), prev.reshape(b, -1), s, sn,
                                     sde_triton.StepParams(sde_type, ETA), config)
    else:
        lp = kernels.sde_log_prob(x, v, prev, s, sn, eta=ETA, sde_type=sde_type, backend=backend)
    weights = torch.linspace(0.5, 1.5, x.shape[0], device=x.device)  # a non-uniform upstream grad
    (lp * weights).sum().backward()
    return lp.detach(), v.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sde_type", TYPES)
def test_triton_log_prob_and_grad_vs_float64(sde_type, dtype):
    x, v, prev, s, sn = _replay_case(sde_type, dtype)
    lp_tri, dv_tri = _log_prob_and_grad("triton", x, v, prev, s, sn, sde_type)
    lp_32, dv_32 = _log_prob_and_grad("torch", x, v, prev, s, sn, sde_type)
    lp_64, dv_64 = _log_prob_and_grad("torch", x.double(), v.double(), prev.double(), s.double(),
                                      sn.double(), sde_type)
    assert lp_tri.dtype == torch.float32 and lp_tri.shape == (3,)
    assert dv_tri.dtype == dtype and dv_tri.shape == SHAPE
    _three_way(lp_tri, lp_32, lp_64, "log_prob")
    _three_way(dv_tri, dv_32, dv_64, "dv")


@pytest.mark.parametrize("sde_type", TYPES)
def test_triton_multi_chunk_reduction(sde_type):
    """Many chunks per sample and a looped final sum: block 32 x 3 tiles over N = 1,001 gives 11
    partials per sample, summed 4 at a time."""
    from flowgrpo_kernels.sde_triton import ReductionConfig
    x, v, prev, s, sn = _replay_case(sde_type, torch.float32, shape=(3, 7, 11, 13), seed=3)
    config = ReductionConfig(block=32, tiles=3, num_warps=1, block_partials=4)
    assert config.num_chunks(1001) == 11
    lp_tri, dv_tri = _log_prob_and_grad("config", x, v, prev, s, sn, sde_type, config)
    lp_32, dv_32 = _log_prob_and_grad("torch", x, v, prev, s, sn, sde_type)
    lp_64, dv_64 = _log_prob_and_grad("torch", x.double(), v.double(), prev.double(), s.double(),
                                      sn.double(), sde_type)
    _three_way(lp_tri, lp_32, lp_64, "log_prob")
    _three_way(dv_tri, dv_32, dv_64, "dv")


@pytest.mark.slow
def test_triton_default_tiling_over_several_tiles():
    """N = 9,190 > 8,192 (the bf16 tile): two chunks of the default tiling, python-float sigmas."""
    x, v, noise = _inputs((2, 5, 1838), torch.bfloat16, seed=5)
    prev = kernels.sde_step(x, v, 0.7, 0.6, eta=ETA, noise=noise, backend="torch").prev_sample
    args = (x, v, prev, 0.7, 0.6)
    lp_tri, dv_tri = _log_prob_and_grad("triton", *args, "sde")
    lp_32, dv_32 = _log_prob_and_grad("torch", *args, "sde")
    lp_64, dv_64 = _log_prob_and_grad("torch", x.double(), v.double(), prev.double(), 0.7, 0.6, "sde")
    _three_way(lp_tri, lp_32, lp_64, "log_prob")
    _three_way(dv_tri, dv_32, dv_64, "dv")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sde_type", TYPES)
def test_triton_sde_step_vs_float64(sde_type, dtype):
    x, v, noise = _inputs(SHAPE, dtype, seed=1)
    s, sn = _sigmas_for(sde_type)
    out = kernels.sde_step(x, v, s, sn, eta=ETA, sde_type=sde_type, noise=noise, backend="triton")
    out32 = kernels.sde_step(x, v, s, sn, eta=ETA, sde_type=sde_type, noise=noise, backend="torch")
    mean64, std64 = ref.sde_transition_ref(x.double(), v.double(), s.double(), sn.double(),
                                           eta=ETA, sde_type=sde_type)
    prev64 = mean64 + std64.view(-1, 1, 1, 1) * noise.double()
    assert out.prev_sample.dtype == dtype and out.prev_sample.shape == SHAPE
    assert out.mean.dtype == torch.float32 and out.std.shape == (3,)
    _three_way(out.mean, out32.mean, mean64, "mean")
    _three_way(out.std, out32.std, std64, "std")
    # prev_sample: within one rounding of the storage dtype (plus the fp32 error of the mean)
    ulp = torch.finfo(dtype).eps * prev64.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((out.prev_sample.double() - prev64).abs() <= ulp + 8 * EPS32 * prev64.abs().max()).all()
    # the recorded log-prob is the density of the stored prev_sample
    lp64 = ref.gaussian_log_prob_ref(out.prev_sample.double(), mean64, std64)
    lp32 = kernels.sde_log_prob(x, v, out.prev_sample, s, sn, eta=ETA, sde_type=sde_type, backend="torch")
    _three_way(out.log_prob, lp32, lp64, "log_prob")


# ------------------------------------------------------ the engine/actor contract: ratio == 1


@pytest.mark.parametrize("backend", ("triton", "torch"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sde_type", TYPES)
def test_step_and_replay_bitwise_equal(sde_type, dtype, backend):
    x, v, noise = _inputs(SHAPE, dtype, seed=2)
    s, sn = _sigmas_for(sde_type)
    step = kernels.sde_step(x, v, s, sn, eta=ETA, sde_type=sde_type, noise=noise, backend=backend)
    v_train = v.clone().requires_grad_()
    replay = kernels.sde_log_prob(x, v_train, step.prev_sample, s, sn, eta=ETA, sde_type=sde_type,
                                  backend=backend)
    assert torch.equal(replay.detach(), step.log_prob)
    loss, stats = kernels.grpo_clip_loss(replay[:, None], step.log_prob[:, None],
                                         torch.tensor([1.0, -0.5, 0.25], device=DEVICE), eps=1e-4)
    assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0


def test_triton_log_prob_does_not_depend_on_the_batch():
    """A sample's log-prob is the same bits whatever it is batched with (the engine's wave and the
    actor's micro-batch differ). Residuals of mixed magnitudes make the sum order-sensitive."""
    g = torch.Generator().manual_seed(11)
    shape = (6, 2, 1001)
    x, v = (torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    scale = 10 ** (torch.rand(shape, generator=g) * 5 - 3)
    prev = (x.float().cpu() + scale * torch.randn(shape, generator=g)).to(DEVICE, torch.bfloat16)
    s = torch.linspace(0.95, 0.2, 6, device=DEVICE)
    sn = s - 0.1
    full = kernels.sde_log_prob(x, v, prev, s, sn, eta=ETA, backend="triton")
    for rows in ([2], [1, 3], [5, 0, 2], [4, 3, 2, 1, 0]):
        idx = torch.tensor(rows, device=DEVICE)
        part = kernels.sde_log_prob(x[idx], v[idx], prev[idx], s[idx], sn[idx], eta=ETA, backend="triton")
        assert torch.equal(part, full[idx])


def test_triton_misaligned_and_strided_views_give_the_same_bits():
    x, v, prev, s, sn = _replay_case("dance", torch.bfloat16, shape=(3, 2, 257))
    base = kernels.sde_log_prob(x, v, prev, s, sn, eta=ETA, sde_type="dance", backend="triton")
    # x as a view starting 2 bytes into a buffer, prev as a strided slice of a trajectory
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=DEVICE)
    x_shifted = buf[1:].view(x.shape)
    x_shifted.copy_(x)
    traj = torch.stack([prev, prev * 2], dim=1)
    out = kernels.sde_log_prob(x_shifted, v, traj[:, 0], s, sn, eta=ETA, sde_type="dance", backend="triton")
    assert torch.equal(out, base)


@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_generator_draws_reproducible_noise(backend):
    x, v, _ = _inputs(SHAPE, torch.float32)

    def seeded():
        return torch.Generator(device=DEVICE).manual_seed(7)

    first = kernels.sde_step(x, v, 0.8, 0.7, eta=ETA, backend=backend, generator=seeded())
    again = kernels.sde_step(x, v, 0.8, 0.7, eta=ETA, backend=backend, generator=seeded())
    noise = torch.randn(SHAPE, generator=seeded(), device=DEVICE)  # fp32 standard normal
    explicit = kernels.sde_step(x, v, 0.8, 0.7, eta=ETA, backend=backend, noise=noise)
    assert torch.equal(first.prev_sample, again.prev_sample)
    assert torch.equal(first.prev_sample, explicit.prev_sample)
    other = kernels.sde_step(x, v, 0.8, 0.7, eta=ETA, backend=backend,
                             generator=torch.Generator(device=DEVICE).manual_seed(8))
    assert not torch.equal(first.prev_sample, other.prev_sample)


# --------------------------------------------------------------------- ODE and singular steps


@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_ode_step_matches_diffusers_scheduler(backend):
    # diffusers is a dependency (always there in CI); the bare GPU box may lack it
    scheduling = pytest.importorskip("diffusers.schedulers.scheduling_flow_match_euler_discrete")
    FlowMatchEulerDiscreteScheduler = scheduling.FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    x = torch.randn(2, 4, 6, 5)
    sample = x.clone()
    for i, t in enumerate(scheduler.timesteps):
        v = torch.randn_like(x)
        expect = scheduler.step(v, t, sample).prev_sample
        sigma, sigma_next = float(scheduler.sigmas[i]), float(scheduler.sigmas[i + 1])
        for sde_type, eta in (("ode", 0.7), ("sde", 0.0), ("cps", 0.0)):
            out = kernels.sde_step(sample.to(DEVICE), v.to(DEVICE), sigma, sigma_next, eta=eta,
                                   sde_type=sde_type, backend=backend)
            assert out.log_prob is None and not out.std.any()
            assert _max_err(out.prev_sample.cpu(), expect) <= 1e-6, (i, sde_type)
        sample = expect


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computes the NaN with numpy
@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_sde_at_sigma_one_samples_the_euler_step_and_refuses_replay(backend):
    x, v, noise = _inputs((2, 3, 17), torch.float32)
    s = torch.tensor([1.0, 0.6], device=DEVICE)
    sn = torch.tensor([0.9, 0.5], device=DEVICE)
    out = kernels.sde_step(x, v, s, sn, eta=ETA, noise=noise, backend=backend)
    torch.testing.assert_close(out.prev_sample[0], x[0] + v[0] * (0.9 - 1.0), rtol=4 * EPS32, atol=4 * EPS32)
    assert out.std[0].item() == 0.0 and out.std[1].item() > 0
    assert math.isnan(out.log_prob[0].item()) and math.isfinite(out.log_prob[1].item())
    with pytest.raises(ValueError, match=r"singular at sigma == 1.*sample 0 \(1\)"):
        kernels.sde_log_prob(x, v, out.prev_sample, s, sn, eta=ETA, backend=backend)
    unchecked = kernels.sde_log_prob(x, v, out.prev_sample, s, sn, eta=ETA, backend=backend, validate=False)
    assert math.isnan(unchecked[0].item()) and unchecked[1].item() == out.log_prob[1].item()
    # dance has no singularity at sigma == 1
    dance = kernels.sde_log_prob(x, v, out.prev_sample, s, sn, eta=ETA, sde_type="dance", backend=backend)
    assert torch.isfinite(dance).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computes the NaN with numpy
@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_cps_last_step_is_deterministic(backend):
    x, v, noise = _inputs((2, 19), torch.float32)
    s, sn = torch.tensor([0.2, 0.5], device=DEVICE), torch.tensor([0.0, 0.3], device=DEVICE)
    out = kernels.sde_step(x, v, s, sn, eta=ETA, sde_type="cps", noise=noise, backend=backend)
    torch.testing.assert_close(out.prev_sample[0], x[0] - 0.2 * v[0], rtol=4 * EPS32, atol=4 * EPS32)
    assert math.isnan(out.log_prob[0].item()) and math.isfinite(out.log_prob[1].item())
    with pytest.raises(ValueError, match="cps.*sigma_next == 0"):
        kernels.sde_log_prob(x, v, out.prev_sample, s, sn, eta=ETA, sde_type="cps", backend=backend)


# ------------------------------------------------------------------------------ bad inputs


def test_every_problem_is_reported_in_one_error():
    x, v, _ = _inputs((3, 4, 5), torch.float32)
    with pytest.raises(ValueError) as info:
        kernels.sde_log_prob(x, v[:, :3], x.double(), torch.tensor([0.5, 1.5, 0.0], device=DEVICE), 0.6,
                             eta=-1.0, sde_type="sdee", backend="cuda")
    msg = str(info.value)
    for needle in ("sde_type must be one of", "backend must be one of", "eta must be",
                   "v has shape (3, 3, 5), expected (3, 4, 5)"):
        assert needle in msg, (needle, msg)
    with pytest.raises(ValueError) as info:
        kernels.sde_step(x, v, torch.tensor([0.5, 1.5, 0.0], device=DEVICE),
                         torch.tensor([0.6, 0.2, 0.0], device=DEVICE), eta=ETA)
    msg = str(info.value)
    assert "sigma must be finite and in (0, 1]; bad at samples 1 (1.5), 2 (0)" in msg, msg
    assert "0 <= sigma_next < sigma; bad at samples 0 (0.6), 2 (0)" in msg, msg


@pytest.mark.parametrize("sigma, sigma_next, needle", [
    (0.0, 0.0, "sigma must be finite and in (0, 1]"),
    (1.2, 0.5, "sigma must be finite and in (0, 1]"),
    (float("nan"), 0.5, "sigma must be finite and in (0, 1]"),
    (0.5, 0.5, "sigma_next must be finite with 0 <= sigma_next < sigma"),
    (0.5, 0.7, "sigma_next must be finite with 0 <= sigma_next < sigma"),
    (0.5, -0.1, "sigma_next must be finite with 0 <= sigma_next < sigma"),
])
def test_bad_sigmas(sigma, sigma_next, needle):
    x, v, _ = _inputs((2, 8), torch.float32)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
            kernels.sde_step(x, v, sigma, sigma_next, eta=ETA, backend=backend)


def test_other_bad_inputs():
    x, v, _ = _inputs((2, 8), torch.float32)
    cases = [
        (lambda: kernels.sde_log_prob(x, v, x, 0.5, 0.4, eta=0.0), "undefined for the deterministic ODE step"),
        (lambda: kernels.sde_log_prob(x, v, x, 0.5, 0.4, eta=ETA, sde_type="ode"), "deterministic ODE step"),
        (lambda: kernels.sde_step(x.double(), v.double(), 0.5, 0.4, eta=ETA, backend="triton"),
         "use backend='torch' for float64"),
        (lambda: kernels.sde_step(x, v, 0.5, 0.4, eta=1.5, sde_type="cps"),
             re.escape(TABLE["cps"].eta_problem(1.5, noise_required=False))),
        (lambda: kernels.sde_step(x, v, torch.ones(3, device=DEVICE) * 0.5, 0.4, eta=ETA),
         "sigma must be a float or a floating tensor of shape \\[B\\]=2"),
        (lambda: kernels.sde_step(x, v.int(), 0.5, 0.4, eta=ETA), "v must be float32, bfloat16"),
        (lambda: kernels.sde_step(x[0, :0], v[0, :0], 0.5, 0.4, eta=ETA), "non-empty tensor"),
        (lambda: kernels.sde_step(x, v, 0.5, 0.4, eta=ETA, noise=x[:, :4]), "noise has shape"),
        (lambda: kernels.sde_kl(v, v[:1], 0.5, 0.4, eta=ETA), "v_ref has shape"),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError, match=needle):
            call()


# ---------------------------------------------------------------------------------------- KL


@pytest.mark.parametrize("sde_type", TYPES)
def test_kl_closed_form(sde_type):
    x, v, _ = _inputs(SHAPE, torch.float64)
    v_ref = v + 0.1 * torch.randn_like(v)
    s, sn = _sigmas_for(sde_type)
    s, sn = s.double(), sn.double()
    kl = kernels.sde_kl(v, v_ref, s, sn, eta=ETA, sde_type=sde_type)
    mean, std = ref.sde_transition_ref(x, v, s, sn, eta=ETA, sde_type=sde_type)
    mean_ref, _ = ref.sde_transition_ref(x, v_ref, s, sn, eta=ETA, sde_type=sde_type)
    expect = ((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * std ** 2)
    torch.testing.assert_close(kl, expect, rtol=1e-10, atol=0)
    if sde_type == "sde":  # the paper's form: (dt/2) (std_dev_t (1-s) / (2s) + 1/std_dev_t)^2 |dv|^2
        std_dev_t = ETA * torch.sqrt(s / (1 - s))
        paper = (s - sn) / 2 * (std_dev_t * (1 - s) / (2 * s) + 1 / std_dev_t) ** 2 \
            * ((v - v_ref) ** 2).flatten(1).mean(1)
        torch.testing.assert_close(kl, paper, rtol=1e-10, atol=0)
    v_train = v.clone().requires_grad_()
    kernels.sde_kl(v_train, v_ref, s, sn, eta=ETA, sde_type=sde_type).sum().backward()
    assert torch.isfinite(v_train.grad).all() and v_train.grad.abs().sum() > 0


@pytest.mark.parametrize("shape", [(5,), (1, 1), (1, 3, 3)], ids=str)
def test_degenerate_shapes(shape):
    """One element per sample, or a single sample: the same contract holds."""
    x, v, noise = _inputs(shape, torch.float32, seed=4)
    s = torch.linspace(0.9, 0.5, shape[0], device=DEVICE)
    out = kernels.sde_step(x, v, s, s - 0.1, eta=ETA, noise=noise, backend="triton")
    assert out.prev_sample.shape == shape and out.log_prob.shape == (shape[0],)
    lp32 = kernels.sde_log_prob(x, v, out.prev_sample, s, s - 0.1, eta=ETA, backend="torch")
    lp64 = kernels.sde_log_prob(x.double(), v.double(), out.prev_sample.double(), s.double(),
                                s.double() - 0.1, eta=ETA, backend="torch")
    _three_way(out.log_prob, lp32, lp64, "log_prob")
    replay = kernels.sde_log_prob(x, v, out.prev_sample, s, s - 0.1, eta=ETA, backend="triton")
    assert torch.equal(replay, out.log_prob)


def test_sigma_forms_give_the_same_bits():
    """Per-sample sigmas as a strided column of a [B, S] schedule (what the actor slices), as a
    contiguous [B] tensor, and a shared sigma as a 0-dim tensor or a python float."""
    x, v, prev, _, _ = _replay_case("sde", torch.bfloat16, shape=(3, 4, 33))
    schedule = torch.tensor([[0.9, 0.7], [0.8, 0.6], [0.7, 0.5]], device=DEVICE)
    strided = kernels.sde_log_prob(x, v, prev, schedule[:, 0], schedule[:, 1], eta=ETA, backend="triton")
    contiguous = kernels.sde_log_prob(x, v, prev, schedule[:, 0].clone(), schedule[:, 1].clone(), eta=ETA,
                                      backend="triton")
    assert torch.equal(strided, contiguous)
    shared = [kernels.sde_log_prob(x, v, prev, s, sn, eta=ETA, backend="triton")
              for s, sn in ((0.7, 0.5), (torch.tensor(0.7, device=DEVICE), torch.tensor(0.5, device=DEVICE)),
                            (torch.full((3,), 0.7, device=DEVICE), torch.full((3,), 0.5, device=DEVICE)))]
    assert torch.equal(shared[1], shared[2])  # a 0-dim tensor is read with stride 0
    # a python float takes another kernel specialisation (sigma as an argument): same math
    torch.testing.assert_close(shared[0], shared[2], rtol=4 * EPS32, atol=4 * EPS32)
    assert torch.equal(strided[2], shared[2][2])


# ------------------------------------------------------------- the validation fast path


def test_fast_validation_accepts_exactly_what_the_full_check_accepts():
    """kernels.sde._fast_resolve (the hot path) must never accept an input the full check
    refuses, and must agree on the backend whenever it accepts."""
    from flowgrpo_kernels import sde as sde_mod
    x, v, _ = _inputs((3, 4, 5), torch.float32)
    s, sn = torch.tensor([0.9, 0.6, 0.3], device=DEVICE), torch.tensor([0.8, 0.5, 0.0], device=DEVICE)
    nan = float("nan")
    cases = [  # (named, sigma, sigma_next, eta, sde_type, backend, replay)
        ([("x", x), ("v", v)], s, sn, ETA, "sde", "triton", False),
        ([("x", x), ("v", v), ("p", x)], s, sn, ETA, "sde", "auto", True),
        ([("x", x), ("v", v), ("p", x)], 0.7, 0.5, ETA, "dance", "torch", True),
        ([("x", x), ("v", v), ("p", x)], s[0], 0.5, ETA, "sde", "triton", True),
        ([("x", x), ("v", v), ("p", x)], s, sn, ETA, "cps", "triton", True),  # sigma_next == 0
        ([("x", x), ("v", v), ("p", x)], torch.tensor([1.0, 0.6, 0.3], device=DEVICE), sn, ETA, "sde",
         "triton", True),  # singular at sigma == 1
        ([("x", x), ("v", v)], torch.tensor([1.0, 0.6, 0.3], device=DEVICE), sn, ETA, "sde", "triton", False),
        ([("x", x), ("v", v)], 0.5, nan, ETA, "sde", "triton", False),
        ([("x", x), ("v", v)], 0.5, 0.5, ETA, "sde", "triton", False),
        ([("x", x), ("v", v)], s, sn.flip(0), ETA, "sde", "triton", False),
        ([("x", x), ("v", v)], s[:2], sn, ETA, "sde", "triton", False),
        ([("x", x), ("v", v)], s, sn, 1.5, "cps", "triton", False),
        ([("x", x), ("v", v)], s, sn, True, "sde", "triton", False),
        ([("x", x), ("v", v)], s, sn, ETA, "ode", "triton", True),
        ([("x", x), ("v", v.double())], s, sn, ETA, "sde", "triton", False),
        ([("x", x), ("v", v[:, :2])], s, sn, ETA, "sde", "torch", False),
        ([("x", x), ("v", v.int())], s, sn, ETA, "sde", "torch", False),
        ([("x", x), ("v", v)], s.int(), sn, ETA, "sde", "torch", False),
    ]
    options = ({}, {"sigma_one": "clamp_to_next"}, {"log_prob_form": "squared_residual"},
               {"sigma_one": "clip"}, {"log_prob_form": "l2"})
    for i, (named, sig, sig_next, eta, sde_type, backend, replay) in enumerate(cases):
        for validate, opts in itertools.product((True, False), options):
            kw = dict(eta=eta, sde_type=sde_type, backend=backend, replay=replay, validate=validate,
                      **opts)
            fast = sde_mod._fast_resolve(named, sig, sig_next, **kw)
            try:
                full = sde_mod.check_step_inputs("op", named, sig, sig_next, **kw)
            except ValueError:
                full = None
            assert fast is None or fast == full, (i, validate, fast, full)
    # the valid cases do take the fast path (otherwise it would be dead code)
    assert sde_mod._fast_resolve(cases[0][0], s, sn, eta=ETA, sde_type="sde", backend="triton",
                                 replay=False, validate=True) == "triton"
    assert sde_mod._fast_resolve(cases[2][0], 0.7, 0.5, eta=ETA, sde_type="dance", backend="torch",
                                 replay=True, validate=True) == "torch"


def test_no_grad_replay_gives_the_autograd_path_bits():
    """Without a gradient to v the Triton replay skips the autograd.Function: same kernel, same bits."""
    x, v, prev, s, sn = _replay_case("sde", torch.bfloat16, shape=(3, 2, 129))
    with_grad = kernels.sde_log_prob(x, v.clone().requires_grad_(), prev, s, sn, eta=ETA, backend="triton")
    with torch.no_grad():
        plain = kernels.sde_log_prob(x, v, prev, s, sn, eta=ETA, backend="triton")
    assert with_grad.requires_grad and not plain.requires_grad
    assert torch.equal(with_grad.detach(), plain)


def test_reduction_tile_is_sixteen_kib_per_input():
    """bf16 samples get twice the elements per program of fp32 (same bytes in flight)."""
    from flowgrpo_kernels.sde_triton import reduction_config
    assert reduction_config(1 << 20, elem_size=4).block == 4096
    assert reduction_config(1 << 20, elem_size=2).block == 8192
    assert reduction_config(385, elem_size=2).block == 512  # never more than the sample
