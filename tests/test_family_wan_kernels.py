"""The SDE kernels on video latents [B, C, F, H, W]: the transition's log-prob is the mean over
every element of a sample, frames included, on both backends and against the float64 oracle.

Wan's latents carry a frame axis the image families lack; the kernels flatten every non-batch
axis, and these tests pin that down for 5-D inputs: odd, non-power-of-two frame counts, a
per-frame perturbation that moves the log-prob by exactly its own share, the sampling step and
the replay bit for bit (ratio == 1 on video), and a trajectory's frame-strided view.
On a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import flowgrpo_kernels as kernels  # noqa: E402
from flowgrpo_kernels import sde_reference as ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPES = ("sde", "dance", "cps")
ETA = 0.7
VIDEO = (3, 4, 5, 3, 7)  # B, C, F (odd), h, w: 420 elements per sample, not a power of two
EPS32 = torch.finfo(torch.float32).eps


def _sigmas(sde_type):
    s = torch.tensor([0.93, 0.61, 0.27], device=DEVICE)
    sn = torch.tensor([0.81, 0.55, 0.02 if sde_type == "cps" else 0.0], device=DEVICE)
    return s, sn


def _video_case(sde_type, dtype, shape=VIDEO, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, v, noise = (torch.randn(shape, generator=g) for _ in range(3))
    x, v = x.to(DEVICE, dtype), v.to(DEVICE, dtype)
    s, sn = _sigmas(sde_type)
    prev = kernels.sde_step(x, v, s, sn, eta=ETA, sde_type=sde_type, noise=noise.to(DEVICE),
                            backend="torch").prev_sample
    return x, v, prev, s, sn


def _log_prob(backend, x, v, prev, s, sn, sde_type):
    return kernels.sde_log_prob(x, v, prev, s, sn, eta=ETA, sde_type=sde_type, backend=backend)


@pytest.mark.parametrize("backend", ("triton", "torch"))
@pytest.mark.parametrize("sde_type", TYPES)
def test_video_log_prob_is_the_mean_over_every_element_of_the_float64_oracle(sde_type, backend):
    x, v, prev, s, sn = _video_case(sde_type, torch.float32)
    lp = _log_prob(backend, x, v, prev, s, sn, sde_type)
    # the float64 oracle (the torch reference at float64), and the same data as [B, N]: the
    # reduction runs over C * F * h * w elements, whatever the axes
    oracle = _log_prob("torch", x.double(), v.double(), prev.double(), s.double(), sn.double(), sde_type)
    flat = _log_prob(backend, x.reshape(3, -1), v.reshape(3, -1), prev.reshape(3, -1), s, sn, sde_type)
    assert lp.shape == (3,) and torch.equal(lp, flat)
    lp32 = _log_prob("torch", x, v, prev, s, sn, sde_type)
    err, err32 = (lp.double() - oracle).abs().max().item(), (lp32.double() - oracle).abs().max().item()
    assert err <= 2 * err32 + 4 * EPS32 * oracle.abs().max().item(), (err, err32)


@pytest.mark.parametrize("backend", ("triton", "torch"))
@pytest.mark.parametrize("frame", (0, 2, 4))
def test_a_change_in_one_frame_moves_the_log_prob_by_that_frames_share(frame, backend):
    """Every frame is inside the reduction: moving one element of frame ``frame`` by d changes the
    mean log-density by exactly that element's term / (C F h w)."""
    x, v, prev, s, sn = _video_case("sde", torch.float64)
    base = _log_prob("torch", x, v, prev, s, sn, "sde")
    moved = prev.clone()
    moved[:, 1, frame, 2, 3] += 0.5
    lp = _log_prob("torch", x, v, moved, s, sn, "sde")
    mean, std = ref.sde_transition_ref(x, v, s, sn, eta=ETA, sde_type="sde")
    old_r = prev[:, 1, frame, 2, 3] - mean[:, 1, frame, 2, 3]
    new_r = moved[:, 1, frame, 2, 3] - mean[:, 1, frame, 2, 3]
    expected = -(new_r ** 2 - old_r ** 2) / (2 * std ** 2) / prev[0].numel()
    finite = std > 0
    torch.testing.assert_close((lp - base)[finite], expected[finite], rtol=1e-9, atol=1e-12)
    if backend == "triton":  # the kernel sees the same change, to fp32 accuracy
        lp32 = _log_prob("triton", x.float(), v.float(), moved.float(), s, sn, "sde")
        base32 = _log_prob("triton", x.float(), v.float(), prev.float(), s, sn, "sde")
        diff = (lp32 - base32).double()[finite]
        assert (diff - expected[finite]).abs().max().item() <= 1e-5 * (1 + base[finite].abs().max().item())


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("backend", ("triton", "torch"))
@pytest.mark.parametrize("sde_type", TYPES)
def test_video_step_and_replay_give_the_same_bits(sde_type, backend, dtype):
    g = torch.Generator().manual_seed(2)
    x, v, noise = (torch.randn(VIDEO, generator=g) for _ in range(3))
    x, v = x.to(DEVICE, dtype), v.to(DEVICE, dtype)
    s, sn = _sigmas(sde_type)
    step = kernels.sde_step(x, v, s, sn, eta=ETA, sde_type=sde_type, noise=noise.to(DEVICE), backend=backend)
    assert step.prev_sample.shape == VIDEO and step.prev_sample.dtype == dtype
    replay = kernels.sde_log_prob(x, v.clone().requires_grad_(), step.prev_sample, s, sn, eta=ETA,
                                  sde_type=sde_type, backend=backend)
    assert torch.equal(replay.detach(), step.log_prob)


@pytest.mark.parametrize("sde_type", TYPES)
def test_video_gradient_matches_the_float64_oracle_on_several_chunks(sde_type):
    """A video sample larger than one reduction chunk (block 32 x 3 tiles over 1,980 elements)."""
    from flowgrpo_kernels import sde_triton
    from flowgrpo_kernels.sde_triton import ReductionConfig

    shape = (2, 4, 5, 9, 11)
    x, v, prev, s, sn = _video_case(sde_type, torch.float32, shape=(3,) + shape[1:], seed=3)
    x, v, prev, s, sn = x[:2], v[:2], prev[:2], s[:2], sn[:2]
    config = ReductionConfig(block=32, tiles=3, num_warps=1, block_partials=4)
    assert config.num_chunks(x[0].numel()) > 1

    def lp_grad(fn, *args):
        vv = args[1].clone().requires_grad_()
        lp = fn(args[0], vv, *args[2:])
        (lp * torch.tensor([0.5, 1.5], device=DEVICE, dtype=lp.dtype)).sum().backward()
        return lp.detach().double(), vv.grad.double()

    def triton_fn(x_, v_, prev_, s_, sn_):
        b = x_.shape[0]
        return sde_triton.sde_log_prob(x_.reshape(b, -1), v_.reshape(b, -1), prev_.reshape(b, -1), s_, sn_,
                                       sde_triton.StepParams(sde_type, ETA), config)

    def torch_fn(x_, v_, prev_, s_, sn_):
        return kernels.sde_log_prob(x_, v_, prev_, s_, sn_, eta=ETA, sde_type=sde_type, backend="torch")

    lp_t, dv_t = lp_grad(triton_fn, x, v, prev, s, sn)
    lp_64, dv_64 = lp_grad(torch_fn, x.double(), v.double(), prev.double(), s.double(), sn.double())
    lp_32, dv_32 = lp_grad(torch_fn, x, v, prev, s, sn)
    for got, f32, oracle in ((lp_t, lp_32, lp_64), (dv_t.reshape(shape), dv_32, dv_64)):
        err, err32 = (got - oracle).abs().max().item(), (f32 - oracle).abs().max().item()
        assert err <= 2 * err32 + 4 * EPS32 * oracle.abs().max().item(), (err, err32)


def test_a_frame_strided_view_of_a_trajectory_gives_the_contiguous_bits():
    """The actor replays ``latents[:, step]`` of a [B, S, C, F, h, w] trajectory: a strided view."""
    x, v, prev, s, sn = _video_case("dance", torch.bfloat16)
    base = _log_prob("triton", x, v, prev, s, sn, "dance")
    trajectory = torch.stack([x * 2, x], dim=1)
    assert not trajectory[:, 1].is_contiguous()
    assert torch.equal(_log_prob("triton", trajectory[:, 1], v, prev, s, sn, "dance"), base)
