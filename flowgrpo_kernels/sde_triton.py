"""Fused Triton kernels for the SDE sampling step and the replayed Gaussian log-prob (fwd + bwd).

Imported lazily by ``kernels.sde`` the first time the Triton backend is used, so that
``TRITON_INTERPRET=1`` (how CI runs these kernels on CPU) can still be set after ``import kernels``.
The math is the ``a, b, var`` form of ``sde_reference.transition_coefficients_ref`` (``sde`` with
``sigma_one="clamp_to_next"`` is its own SDE_TYPE code, the squared-residual log-prob form a
constexpr); all of it is fp32 whatever the storage dtype of x, v, prev_sample and noise.

Layout: the latents are viewed as ``[B, N]``; every kernel runs on a ``(chunks, B)`` grid, each
program loading its sample's sigmas and computing the per-sample coefficients itself (no host
math, no extra launches). Launches per call: log-prob forward 1, backward 1, sampling step 2
(sample, then the log-prob forward on the stored ``prev_sample``).

Design choices:

- Determinism. ``sde_step`` records a log-prob that ``sde_log_prob`` must reproduce bit for bit,
  possibly in another process and in a batch of another size. The forward reduction is therefore
  a two-stage, fixed-order one: every program writes the sum of squared residuals of its chunk to a
  workspace, and the last program of a sample (found with an atomic counter, which it resets)
  adds the partials in index order. No float atomics. The chunking is a function of ``N`` only
  (``reduction_config``), never of the batch size, the device or an autotuner's timing, so a
  sample's log-prob does not depend on what it was batched with. For the same reason every tensor
  reaches the kernels 16-byte aligned (misaligned views are copied): Triton specialises on pointer
  alignment, and another specialisation could sum in another order.
- The elementwise kernels (sampling, backward) are tuned over a few (BLOCK, num_warps) on CUDA the
  first time a shape is seen (their result does not depend on the tiling); under the interpreter a
  single large BLOCK is used.
- The backward saves nothing but the inputs: it recomputes ``mean`` from x, v and prev_sample and
  writes ``dv = g * b * (prev - mean) / (var * N)`` in one pass.
- The workspace (partials + counters) is cached per device and stream. The last program leaves
  the counters at zero, so the workspace is never cleared between calls and the whole forward is
  one launch (and stays valid inside a CUDA graph). Warm each shape up once before capturing.

Latency, not bandwidth, limited the bf16 case, so: every kernel issues its data loads before
the sigma loads (one round trip per program), the forward tile is 16 KiB per input
(``reduction_config``), and the launch path holds no hidden tensor ops (figures:
bench/reports/2026-11-29_h200_code-choices.md).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from .sde_reference import LOG_SQRT_2PI
from .sde_types import TABLE


def _interpreting() -> bool:
    """What triton.jit decides when this module's kernels are decorated (import time)."""
    try:
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except ImportError:  # older triton: the environment variable is all there is
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


INTERPRET = _interpreting()
# The SDE_TYPE constexpr of each branch below is the table's code (flowgrpo_kernels.sde_types).


@dataclass(frozen=True)
class ReductionConfig:
    """Tiling of the log-prob forward. Must depend on N only (see the module docstring)."""
    block: int            # elements per tile
    tiles: int            # tiles per program; a chunk is block * tiles elements
    num_warps: int
    block_partials: int   # tile of the final, fixed-order sum over the chunk partials

    def num_chunks(self, n: int) -> int:
        return triton.cdiv(n, self.block * self.tiles)


@lru_cache(maxsize=256)
def reduction_config(n: int, block: int | None = None, tiles: int = 1,
                     num_warps: int | None = None, elem_size: int = 4) -> ReductionConfig:
    """Default forward tiling for ``N`` elements per sample stored ``elem_size`` bytes each.

    A tile is 16 KiB of each input: 4096 fp32 or 8192 bf16/fp16 elements, 64 bytes per thread
    and tensor at 8 warps. It depends on (N, storage dtype) only, both the same for the engine's
    record and the actor's replay, so the bitwise contract holds.
    NOTE: with a 4096-element tile for every dtype, bf16 reached a far smaller share of the copy
    ceiling than fp32 in the same time: the time was set by the programs' latency chain (sigma
    load, coefficients, data loads, partial store, acq_rel atomic), not by bytes; half the bytes
    per program in bf16 left the memory system idle (figures:
    bench/reports/2026-12-04_cpu-h200_comment-figures.md).
    ``bench/bench_kernels.py --sweep`` times alternatives on the device.
    """
    block = block or min(16384 // elem_size, max(16, triton.next_power_of_2(n)))
    num_warps = num_warps or (8 if block >= 2048 else 4)
    chunks = triton.cdiv(n, block * tiles)
    return ReductionConfig(block, tiles, num_warps, min(1024, triton.next_power_of_2(chunks)))


# Candidate (BLOCK, num_warps) of the elementwise kernels, timed once per key on CUDA for
# samples of at least TUNE_MIN_N elements; smaller ones are launch-bound and take the default
# (which also spares tests on a GPU from compiling every candidate).
ELEMENTWISE_CONFIGS = tuple((block, warps) for block in (1024, 2048, 4096) for warps in (4, 8))
DEFAULT_ELEMENTWISE_CONFIG = (2048, 8)  # one 16-byte load per bf16 tensor and thread
TUNE_MIN_N = 1 << 16
_INTERPRETER_CONFIG = (4096, 4)  # one large block: the interpreter's cost is per program
_TUNED: dict[tuple, tuple[int, int]] = {}


def _launch_elementwise(kernel, key: tuple, n: int, batch: int, args: tuple, constexprs: dict) -> None:
    """Launch on a ``(cdiv(N, BLOCK), B)`` grid with the fastest (BLOCK, num_warps) for ``key``.

    NOTE: this replaces ``triton.autotune``, whose per-call dispatch (argument dicts, dtype
    strings, knob look-ups) costs more than the whole launch budget of the 8 x 36,864 case
    (figures: bench/reports/2026-12-04_cpu-h200_comment-figures.md). Here a cached
    call costs one dict look-up. The first call per key times every candidate (the kernels are
    idempotent), so warm a shape up before capturing it in a CUDA graph.
    """
    config = _TUNED.get(key)
    if config is None:
        if INTERPRET:
            config = _INTERPRETER_CONFIG
        elif n < TUNE_MIN_N:
            config = DEFAULT_ELEMENTWISE_CONFIG
        else:
            config = _fastest(kernel, n, batch, args, constexprs)
        _TUNED[key] = config
    block, warps = config
    kernel[(triton.cdiv(n, block), batch)](*args, BLOCK=block, num_warps=warps, **constexprs)


def _fastest(kernel, n, batch, args, constexprs) -> tuple[int, int]:
    timings = {}
    for block, warps in ELEMENTWISE_CONFIGS:
        grid = (triton.cdiv(n, block), batch)
        timings[block, warps] = do_bench(
            lambda: kernel[grid](*args, BLOCK=block, num_warps=warps, **constexprs),
            warmup=5, rep=20, return_mode="median")
    return min(timings, key=timings.get)


# ---------------------------------------------------------------------------------- device code

@triton.jit
def _load_sigma(ptr, stride, value, b, IS_TENSOR: tl.constexpr):
    if IS_TENSOR:
        sigma = tl.load(ptr + b * stride).to(tl.float32)
    else:
        sigma = value
    return sigma


@triton.jit
def _transition_coefficients(sigma, sigma_next, eta_sq, cps_sin, cps_cos, SDE_TYPE: tl.constexpr):
    """Per-sample (a, b, var): mean = a * x + b * v, noise variance var (0 where undefined)."""
    dt = sigma_next - sigma
    if SDE_TYPE == 0:  # ode
        a = dt * 0.0 + 1.0
        b = dt
        var = dt * 0.0
    elif SDE_TYPE == 1:  # sde; sigma == 1 is singular -> deterministic Euler step, var = 0
        singular = sigma >= 1.0
        one_minus = tl.where(singular, 1.0, 1.0 - sigma)
        a = tl.where(singular, 1.0, 1.0 + eta_sq * dt / (2.0 * one_minus))
        b = tl.where(singular, dt, (1.0 + 0.5 * eta_sq) * dt)
        var = tl.where(singular, 0.0, eta_sq * sigma / one_minus * (-dt))
    elif SDE_TYPE == 2:  # dance
        a = 1.0 + eta_sq * dt / (2.0 * sigma)
        b = (1.0 + eta_sq * (1.0 - sigma) / (2.0 * sigma)) * dt
        var = eta_sq * (-dt)
    elif SDE_TYPE == 4:  # sde, sigma == 1 clamped: 1 - sigma -> 1 - sigma_next there
        one_minus = tl.where(sigma >= 1.0, 1.0 - sigma_next, 1.0 - sigma)
        a = 1.0 + eta_sq * dt / (2.0 * one_minus)
        b = (1.0 + eta_sq * (1.0 - sigma) / (2.0 * one_minus)) * dt
        var = eta_sq * sigma / one_minus * (-dt)
    else:  # cps
        c = sigma_next * cps_cos
        std_dev_t = sigma_next * cps_sin
        a = (1.0 - sigma_next) + c
        b = (1.0 - sigma) * c - sigma * (1.0 - sigma_next)
        var = std_dev_t * std_dev_t
    return a, b, var


@triton.jit
def _transition_mean(x, v, a, b, SDE_TYPE: tl.constexpr):
    if SDE_TYPE == 0:
        mean = x + b * v  # exactly diffusers' FlowMatchEulerDiscreteScheduler.step
    else:
        mean = a * x + b * v
    return mean


@triton.jit
def _cast_for_store(ptr, x):
    """fp32 -> the element type of ``ptr``, rounding to nearest even.

    bf16 is rounded on the bits: the Triton interpreter truncates fp32 -> bf16 casts, so this
    keeps CI (interpreter) and the GPU (where it compiles to a few integer ops) identical.
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        high = tl.where(x != x, 0x7FC0, bits >> 16)  # NaN stays NaN
        out = high.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(ptr.dtype.element_ty)
    return out


@triton.jit
def _sde_log_prob_fwd_kernel(
        x_ptr, v_ptr, prev_ptr,
        sig_ptr, sig_stride, sig_value, sign_ptr, sign_stride, sign_value,
        partial_ptr, count_ptr, out_ptr,
        N, num_chunks, eta_sq, cps_sin, cps_cos,
        SDE_TYPE: tl.constexpr, SIG_TENSOR: tl.constexpr, SIGN_TENSOR: tl.constexpr,
        BLOCK: tl.constexpr, TILES: tl.constexpr, BLOCK_P: tl.constexpr, LOG_SQRT_TWO_PI: tl.constexpr,
        SQ_RESIDUAL: tl.constexpr):
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * N
    start = chunk.to(tl.int64) * (BLOCK * TILES)
    # the first tile's loads go out before the sigma loads and the coefficient math, so a
    # program waits for one memory round trip, not two in a row (see reduction_config)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + row + offs, mask=mask, other=0.0)
    prev = tl.load(prev_ptr + row + offs, mask=mask, other=0.0)
    sigma = _load_sigma(sig_ptr, sig_stride, sig_value, b, SIG_TENSOR)
    sigma_next = _load_sigma(sign_ptr, sign_stride, sign_value, b, SIGN_TENSOR)
    a, coef_v, var = _transition_coefficients(sigma, sigma_next, eta_sq, cps_sin, cps_cos, SDE_TYPE)

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for t in tl.static_range(TILES):
        if t > 0:
            offs = start + t * BLOCK + tl.arange(0, BLOCK)
            mask = offs < N
            x = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
            v = tl.load(v_ptr + row + offs, mask=mask, other=0.0)
            prev = tl.load(prev_ptr + row + offs, mask=mask, other=0.0)
        mean = _transition_mean(x.to(tl.float32), v.to(tl.float32), a, coef_v, SDE_TYPE)
        resid = prev.to(tl.float32) - mean  # 0 where masked
        acc += resid * resid
    tl.store(partial_ptr + b * num_chunks + chunk, tl.sum(acc, axis=0))

    # acq_rel: this program's partial is visible to whichever program arrives last.
    arrived = tl.atomic_add(count_ptr + b, 1)
    if arrived == num_chunks - 1:
        total = tl.zeros([BLOCK_P], dtype=tl.float32)
        for p0 in range(0, num_chunks, BLOCK_P):
            p_offs = p0 + tl.arange(0, BLOCK_P)
            total += tl.load(partial_ptr + b * num_chunks + p_offs, mask=p_offs < num_chunks,
                             other=0.0, volatile=True)
        sq_sum = tl.sum(total, axis=0)
        if SQ_RESIDUAL:  # -mean((prev - mean)^2): no variance, no constants
            log_prob = -sq_sum / N
        else:
            log_prob = -sq_sum / (2.0 * var * N) - 0.5 * tl.log(var) - LOG_SQRT_TWO_PI
            log_prob = tl.where(var > 0.0, log_prob, var * float("nan"))
        tl.store(out_ptr + b, log_prob)
        tl.store(count_ptr + b, 0)  # leave the workspace ready for the next launch


@triton.jit
def _sde_log_prob_bwd_kernel(
        x_ptr, v_ptr, prev_ptr, grad_ptr, grad_stride, dv_ptr,
        sig_ptr, sig_stride, sig_value, sign_ptr, sign_stride, sign_value,
        N, eta_sq, cps_sin, cps_cos,
        SDE_TYPE: tl.constexpr, SIG_TENSOR: tl.constexpr, SIGN_TENSOR: tl.constexpr,
        BLOCK: tl.constexpr, SQ_RESIDUAL: tl.constexpr):
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * N
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    # data loads first, then the per-sample scalars: one memory round trip per program
    x = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + row + offs, mask=mask, other=0.0)
    prev = tl.load(prev_ptr + row + offs, mask=mask, other=0.0)
    grad = tl.load(grad_ptr + b * grad_stride).to(tl.float32)
    sigma = _load_sigma(sig_ptr, sig_stride, sig_value, b, SIG_TENSOR)
    sigma_next = _load_sigma(sign_ptr, sign_stride, sign_value, b, SIGN_TENSOR)
    a, coef_v, var = _transition_coefficients(sigma, sigma_next, eta_sq, cps_sin, cps_cos, SDE_TYPE)
    # d/dv of mean_i(-(prev - mean)^2 / (2 var)) = b * (prev - mean) / (var * N);
    # of mean_i(-(prev - mean)^2) (squared residual form) = 2 b (prev - mean) / N
    if SQ_RESIDUAL:
        scale = grad * coef_v * 2.0 / N
    else:
        scale = grad * coef_v / (var * N)
    resid = prev.to(tl.float32) - _transition_mean(x.to(tl.float32), v.to(tl.float32), a, coef_v, SDE_TYPE)
    tl.store(dv_ptr + row + offs, _cast_for_store(dv_ptr, scale * resid), mask=mask)


@triton.jit
def _sde_sample_kernel(
        x_ptr, v_ptr, noise_ptr, prev_ptr, mean_ptr, std_ptr,
        sig_ptr, sig_stride, sig_value, sign_ptr, sign_stride, sign_value,
        N, eta_sq, cps_sin, cps_cos,
        SDE_TYPE: tl.constexpr, SIG_TENSOR: tl.constexpr, SIGN_TENSOR: tl.constexpr,
        HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * N
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    # data loads first, then the per-sample scalars: one memory round trip per program
    x = tl.load(x_ptr + row + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + row + offs, mask=mask, other=0.0)
    if HAS_NOISE:
        noise = tl.load(noise_ptr + row + offs, mask=mask, other=0.0)
    sigma = _load_sigma(sig_ptr, sig_stride, sig_value, b, SIG_TENSOR)
    sigma_next = _load_sigma(sign_ptr, sign_stride, sign_value, b, SIGN_TENSOR)
    a, coef_v, var = _transition_coefficients(sigma, sigma_next, eta_sq, cps_sin, cps_cos, SDE_TYPE)
    std = tl.sqrt(var)
    if chunk == 0:
        tl.store(std_ptr + b, std)

    mean = _transition_mean(x.to(tl.float32), v.to(tl.float32), a, coef_v, SDE_TYPE)
    if HAS_NOISE:
        prev = mean + std * noise.to(tl.float32)
    else:
        prev = mean
    tl.store(mean_ptr + row + offs, mean, mask=mask)
    tl.store(prev_ptr + row + offs, _cast_for_store(prev_ptr, prev), mask=mask)


# ---------------------------------------------------------------------------------- host code

@dataclass(frozen=True)
class StepParams:
    """Everything about a transition except the tensors: the kernels' scalar arguments."""
    sde_type: str
    eta: float
    sigma_one: str = "refuse"
    log_prob_form: str = "gaussian"
    code: int = field(init=False)  # SDE_TYPE constexpr; eta == 0 is the ODE step for every type
    scalars: tuple[float, float, float] = field(init=False)  # eta^2, sin(eta pi/2), cos(eta pi/2)

    def __post_init__(self):
        half_angle = self.eta * math.pi / 2.0
        object.__setattr__(self, "code", TABLE[self.sde_type].kernel_code(self.eta, self.sigma_one))
        object.__setattr__(self, "scalars", (self.eta * self.eta, math.sin(half_angle), math.cos(half_angle)))

    @property
    def squared_residual(self) -> bool:
        return self.log_prob_form == "squared_residual"


@lru_cache(maxsize=64)
def step_params(sde_type: str, eta: float, sigma_one: str = "refuse",
                log_prob_form: str = "gaussian") -> StepParams:
    return StepParams(sde_type, eta, sigma_one, log_prob_form)


def _sigma_args(sigma, batch: int, dummy: torch.Tensor) -> tuple[tuple, bool]:
    """``(ptr, stride, value), is_tensor`` for a float, a 0-dim / [1] tensor or a [B] tensor.

    No reshape: a 0-dim or one-element tensor is read with stride 0 (one fewer tensor op per
    sigma on the launch path)."""
    if isinstance(sigma, torch.Tensor):
        return (sigma, 0 if sigma.dim() == 0 or sigma.shape[0] == 1 else sigma.stride(0), 0.0), True
    return (dummy, 0, float(sigma)), False


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
# The current stream's handle without building a torch.cuda.Stream object (what inductor's
# generated code calls); the public spelling is the fallback.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def _workspace(device: torch.device, batch: int, num_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached (partials [>= B*chunks] fp32, counters [>= B] int32, all zero between launches)."""
    stream = _raw_stream(device.index) if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    cached = _WORKSPACES.get(key)
    if cached is None or cached[0].numel() < batch * num_chunks or cached[1].numel() < batch:
        size_p = max(batch * num_chunks, 0 if cached is None else cached[0].numel())
        size_c = max(batch, 0 if cached is None else cached[1].numel())
        cached = (torch.empty(size_p, dtype=torch.float32, device=device),
                  torch.zeros(size_c, dtype=torch.int32, device=device))
        _WORKSPACES[key] = cached
    return cached


def log_prob_forward(x: torch.Tensor, v: torch.Tensor, prev: torch.Tensor, sigma, sigma_next,
                     params: StepParams, config: ReductionConfig | None = None) -> torch.Tensor:
    """Launch the forward kernel on ``[B, N]`` contiguous, 16-byte aligned tensors -> ``[B]`` fp32."""
    batch, n = x.shape
    cfg = config or reduction_config(n, elem_size=x.element_size())
    num_chunks = cfg.num_chunks(n)
    partials, counts = _workspace(x.device, batch, num_chunks)
    out = torch.empty(batch, dtype=torch.float32, device=x.device)
    sig, sig_is_tensor = _sigma_args(sigma, batch, x)
    sign, sign_is_tensor = _sigma_args(sigma_next, batch, x)
    _sde_log_prob_fwd_kernel[(num_chunks, batch)](
        x, v, prev, *sig, *sign, partials, counts, out, n, num_chunks, *params.scalars,
        SDE_TYPE=params.code, SIG_TENSOR=sig_is_tensor, SIGN_TENSOR=sign_is_tensor,
        BLOCK=cfg.block, TILES=cfg.tiles, BLOCK_P=cfg.block_partials,
        LOG_SQRT_TWO_PI=LOG_SQRT_2PI, SQ_RESIDUAL=params.squared_residual, num_warps=cfg.num_warps)
    return out


def log_prob_backward(x, v, prev, grad: torch.Tensor, sigma, sigma_next,
                      params: StepParams) -> torch.Tensor:
    batch, n = x.shape
    dv = torch.empty_like(v)
    if grad.dim() != 1:
        grad = grad.reshape(-1)
    sig, sig_is_tensor = _sigma_args(sigma, batch, x)
    sign, sign_is_tensor = _sigma_args(sigma_next, batch, x)
    constexprs = dict(SDE_TYPE=params.code, SIG_TENSOR=sig_is_tensor, SIGN_TENSOR=sign_is_tensor,
                      SQ_RESIDUAL=params.squared_residual)
    args = (x, v, prev, grad, grad.stride(0) if grad.numel() > 1 else 0, dv, *sig, *sign,
            n, *params.scalars)
    key = ("bwd", n, x.dtype, v.dtype, prev.dtype)
    _launch_elementwise(_sde_log_prob_bwd_kernel, key, n, batch, args, constexprs)
    return dv


class _SDELogProb(torch.autograd.Function):
    """log_prob [B] from x, v, prev ([B, N]); the gradient flows into v only."""

    @staticmethod
    def forward(ctx, x, v, prev, sigma, sigma_next, params, config):
        ctx.params = params
        ctx.sigmas = (sigma, sigma_next)
        ctx.save_for_backward(x, v, prev)
        return log_prob_forward(x, v, prev, sigma, sigma_next, params, config)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_log_prob):
        x, v, prev = ctx.saved_tensors
        dv = None
        if ctx.needs_input_grad[1]:
            dv = log_prob_backward(x, v, prev, grad_log_prob, *ctx.sigmas, ctx.params)
        return None, dv, None, None, None, None, None


def sde_log_prob(x, v, prev, sigma, sigma_next, params: StepParams,
                 config: ReductionConfig | None = None) -> torch.Tensor:
    """log_prob [B]; through the autograd.Function only when a gradient can reach ``v``.

    NOTE: ``Function.apply`` alone costs about half the 8 x 36,864 forward's time budget
    (figures: bench/reports/2026-12-04_cpu-h200_comment-figures.md); the engine and no-grad
    replays (old-policy log-probs) skip it."""
    if v.requires_grad and torch.is_grad_enabled():
        return _SDELogProb.apply(x, v, prev, sigma, sigma_next, params, config)
    return log_prob_forward(x, v, prev, sigma, sigma_next, params, config)


@torch.no_grad()
def sde_step(x, v, noise, sigma, sigma_next, params: StepParams, out_dtype: torch.dtype,
             config: ReductionConfig | None = None):
    """(prev_sample [B, N] out_dtype, log_prob [B] or None, mean [B, N] fp32, std [B] fp32).

    The log-prob is taken by the replay kernel on the stored (rounded) ``prev_sample``, so
    ``sde_log_prob`` on the same inputs returns the same bits by construction.
    """
    batch, n = x.shape
    prev = torch.empty((batch, n), dtype=out_dtype, device=x.device)
    mean = torch.empty((batch, n), dtype=torch.float32, device=x.device)
    std = torch.empty(batch, dtype=torch.float32, device=x.device)
    sig, sig_is_tensor = _sigma_args(sigma, batch, x)
    sign, sign_is_tensor = _sigma_args(sigma_next, batch, x)
    has_noise = params.code != 0
    constexprs = dict(SDE_TYPE=params.code, SIG_TENSOR=sig_is_tensor, SIGN_TENSOR=sign_is_tensor,
                      HAS_NOISE=has_noise)
    args = (x, v, noise if has_noise else x, prev, mean, std, *sig, *sign, n, *params.scalars)
    key = ("sample", n, x.dtype, v.dtype, out_dtype, noise.dtype if has_noise else None)
    _launch_elementwise(_sde_sample_kernel, key, n, batch, args, constexprs)
    log_prob = log_prob_forward(x, v, prev, sigma, sigma_next, params, config) if has_noise else None
    return prev, log_prob, mean, std
