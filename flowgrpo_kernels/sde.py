"""The SDE transition as the rollout engine and the actor call it: validation and backend dispatch.

Contract between the two callers (this is what makes the first PPO ratio exactly 1):

- The engine calls ``sde_step(x, v, sigma, sigma_next, eta=..., noise=n)`` and records
  ``prev_sample`` and ``log_prob``. ``prev_sample`` is stored in ``x.dtype``, and ``log_prob`` is
  the density of that stored (rounded) tensor, not of the fp32 value before rounding.
- The actor calls ``sde_log_prob(x, v, prev_sample, sigma, sigma_next, eta=...)`` on the same
  tensors. With the same backend and inputs the result is bitwise equal to the recorded
  ``log_prob``: both run the same code on the same operands (the Triton backend launches the very
  same kernel with a tiling that depends on the per-sample size only, so a sample's log-prob does
  not even depend on the batch it is in; the torch backend uses the same functions, but torch's
  own reductions may change order with the batch size).
- ``backend="auto"`` resolves from the device alone (Triton on CUDA when importable, the torch
  reference elsewhere), so the engine and the actor pick the same implementation on one device.

Validation: every call checks shapes, dtypes and devices (cheap, no device sync). With
``validate=True`` (the default) it also checks the sigma values: plain Python for float sigmas,
a few elementwise ops and one host-device sync for sigma *tensors*; only a failing call builds
the full report. A hot loop whose schedule was validated once may pass ``validate=False``;
undefined samples then yield NaN instead of an error. Either way, all problems found are reported
together in one ``ValueError``.
"""
from __future__ import annotations

import importlib.util
import math
from functools import lru_cache
from typing import NamedTuple

import torch

from .sde_reference import per_sample, sde_kl_ref, sde_log_prob_ref, sde_step_ref
from .sde_types import (KERNEL_SDE_TYPES, KL_FORMS, LOG_PROB_FORMS, SIGMA_ONE_TREATMENTS, TABLE,
                        is_deterministic)

BACKENDS = ("auto", "triton", "torch")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_GRID_Y = 65535  # CUDA grid dimension y: the Triton kernels put the batch there


class SDEStepOutput(NamedTuple):
    """Result of one sampling step.

    prev_sample: ``x'`` in ``x.dtype``, shaped like ``x``.
    log_prob: ``[B]`` log-density of ``prev_sample`` (fp32, float64 for float64 inputs on the torch
        backend); ``None`` for the deterministic ODE step; NaN for samples with no density
        (``sde`` at sigma == 1, ``cps`` at sigma_next == 0).
    mean: transition mean, shaped like ``x``, fp32 (float64 for float64 inputs on torch).
    std: ``[B]`` noise standard deviation of the transition (0 for deterministic samples).
    """
    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    mean: torch.Tensor
    std: torch.Tensor


@lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"triton"`` or ``"torch"``; ``"auto"`` is Triton on CUDA devices, the reference elsewhere."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    return backend


_SDE_TRITON = None


def _triton_module():
    """kernels.sde_triton, imported on first use: decorating its kernels reads TRITON_INTERPRET."""
    global _SDE_TRITON
    if _SDE_TRITON is None:
        from . import sde_triton
        _SDE_TRITON = sde_triton
    return _SDE_TRITON


def _sample_list(mask: torch.Tensor, values: torch.Tensor) -> str:
    idx = mask.nonzero().flatten().tolist()
    shown = ", ".join(f"{i} ({values[i].item():.6g})" for i in idx[:5])
    return f"sample{'s' if len(idx) > 1 else ''} {shown}{' ...' if len(idx) > 5 else ''}"


def _sigma_value_problems(sigma, sigma_next, batch: int, device, *, sde_type: str, eta: float,
                          replay: bool, sigma_one: str = "refuse",
                          log_prob_form: str = "gaussian") -> list[str]:
    """Value checks of the sigmas. One host-device sync when either is a device tensor."""
    on = device if any(isinstance(s, torch.Tensor) for s in (sigma, sigma_next)) else "cpu"
    s = per_sample(sigma, batch, torch.float64, on)
    sn = per_sample(sigma_next, batch, torch.float64, on)
    refuse_sigma_one, refuse_last = _undefined_points(sde_type, eta, replay, sigma_one,
                                                      log_prob_form)
    masks = torch.stack([
        ~torch.isfinite(s) | (s <= 0.0) | (s > 1.0),
        ~torch.isfinite(sn) | (sn < 0.0) | (sn >= s),
        (s >= 1.0) & refuse_sigma_one,
        (sn == 0.0) & refuse_last,
    ])
    # NOTE: the one host sync of validation (one copy holds the flags and the values to report)
    on_host = torch.cat([masks.to(torch.float64), s[None], sn[None]]).cpu()
    masks, s, sn = on_host[:4].bool(), on_host[4], on_host[5]
    if not masks.any():
        return []
    problems = []
    if masks[0].any():
        problems.append(f"sigma must be finite and in (0, 1]; bad at {_sample_list(masks[0], s)}")
    if masks[1].any():
        problems.append("sigma_next must be finite with 0 <= sigma_next < sigma; bad at "
                        f"{_sample_list(masks[1], sn)}")
    if masks[2].any():
        problems.append(f"{TABLE[sde_type].sigma_one_problem()}; at {_sample_list(masks[2], s)}")
    if masks[3].any():
        problems.append(f"{TABLE[sde_type].last_step_problem()}; at {_sample_list(masks[3], sn)}")
    return problems


def _undefined_points(sde_type: str, eta: float, replay: bool, sigma_one: str,
                      log_prob_form: str) -> tuple[bool, bool]:
    """(sigma == 1 refused, sigma_next == 0 refused): the table's undefined points of a
    replayed noisy step (sampling takes the deterministic step there instead)."""
    if not replay or is_deterministic(eta, sde_type):
        return False, False
    row = TABLE[sde_type]
    return row.refuses_sigma_one(sigma_one), row.refuses_last_step(log_prob_form)


def check_step_inputs(op: str, named: list[tuple[str, object]], sigma, sigma_next, *, eta,
                      sde_type, backend: str, replay: bool, validate: bool,
                      sigma_one: str = "refuse", log_prob_form: str = "gaussian") -> str:
    """Raise one ValueError listing every problem; return the resolved backend."""
    problems = _option_problems(eta, sde_type, backend, replay, sigma_one, log_prob_form)
    eta_ok = isinstance(eta, (int, float)) and not isinstance(eta, bool) and math.isfinite(eta)
    ref_name, ref = named[0]
    if not isinstance(ref, torch.Tensor) or ref.dim() < 1 or ref.numel() == 0:
        problems.append(f"{ref_name} must be a non-empty tensor of shape [B, ...], got "
                        f"{tuple(ref.shape) if isinstance(ref, torch.Tensor) else type(ref).__name__}")
        raise ValueError(f"{op}: invalid input:\n  - " + "\n  - ".join(problems))
    batch, device = ref.shape[0], ref.device
    problems += _tensor_problems(named, ref_name, ref)
    sigma_problems = _sigma_type_problems(sigma, sigma_next, batch, device)
    problems += sigma_problems
    resolved = resolve_backend(backend, device) if backend in BACKENDS else backend
    if resolved == "triton":
        problems += _triton_problems(named, batch, device)
    if not problems and not sigma_problems and validate and eta_ok:
        problems += _sigma_value_problems(sigma, sigma_next, batch, device, sde_type=sde_type,
                                          eta=eta, replay=replay, sigma_one=sigma_one,
                                          log_prob_form=log_prob_form)
    if problems:
        raise ValueError(f"{op}: invalid input:\n  - " + "\n  - ".join(problems))
    return resolved


def check_schedule(sigmas, sde_steps, *, eta: float, sde_type: str = "sde",
                   sigma_one: str = "refuse", log_prob_form: str = "gaussian") -> None:
    """Check a whole sampling schedule's options and sigma values on the host, as ``sde_step``
    checks one step given float sigmas: step ``i`` goes ``sigmas[i] -> sigmas[i + 1]``,
    stochastic (``eta``, ``sde_type``) where ``i`` is in ``sde_steps``, the deterministic Euler
    step elsewhere. One ValueError naming every bad step. A loop that checked its schedule
    here passes ``validate=False`` to its steps: with sigma tensors each validated step costs
    a host sync, which mid-loop drains the forwards queued before it."""
    stochastic_steps = {int(i) for i in sde_steps}
    problems = []
    for i in range(len(sigmas) - 1):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        step_eta, step_type = (eta, sde_type) if i in stochastic_steps else (0.0, "ode")
        found = _option_problems(step_eta, step_type, "auto", False, sigma_one, log_prob_form)
        if not found:
            found = _sigma_value_problems(s, s_next, 1, "cpu", sde_type=step_type, eta=step_eta,
                                          replay=False, sigma_one=sigma_one,
                                          log_prob_form=log_prob_form)
        problems += [f"step {i} ({s:.6g} -> {s_next:.6g}): {p}" for p in found]
    if problems:
        raise ValueError("sampling schedule: invalid:\n  - " + "\n  - ".join(problems))


def _option_problems(eta, sde_type, backend, replay, sigma_one, log_prob_form) -> list[str]:
    problems: list[str] = []
    if sde_type not in KERNEL_SDE_TYPES:
        problems.append(f"sde_type must be one of {KERNEL_SDE_TYPES}, got {sde_type!r}")
    if sigma_one not in SIGMA_ONE_TREATMENTS:
        problems.append(f"sigma_one must be one of {SIGMA_ONE_TREATMENTS}, got {sigma_one!r}")
    if log_prob_form not in LOG_PROB_FORMS:
        problems.append(f"log_prob_form must be one of {LOG_PROB_FORMS}, got {log_prob_form!r}")
    if backend not in BACKENDS:
        problems.append(f"backend must be one of {BACKENDS}, got {backend!r}")
    eta_ok = isinstance(eta, (int, float)) and not isinstance(eta, bool) and math.isfinite(eta)
    if not eta_ok or eta < 0:
        problems.append(f"eta must be a finite python float >= 0, got {eta!r}")
    elif sde_type in TABLE and TABLE[sde_type].eta_problem(eta, noise_required=False):
        problems.append(TABLE[sde_type].eta_problem(eta, noise_required=False))
    if replay and eta_ok and sde_type in TABLE and is_deterministic(eta, sde_type):
        problems.append("the log-prob is undefined for the deterministic ODE step (sde_type='ode' or "
                        "eta == 0): there is no noise, hence no density")
    return problems


def _tensor_problems(named, ref_name, ref) -> list[str]:
    """Every input a float tensor shaped and placed like the first one."""
    problems = []
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name} must be a tensor, got {type(t).__name__}")
            continue
        if t.dtype not in _FLOAT_DTYPES:
            problems.append(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
        if t.shape != ref.shape:
            problems.append(f"{name} has shape {tuple(t.shape)}, expected {tuple(ref.shape)} "
                            f"(like {ref_name})")
        if t.device != ref.device:
            problems.append(f"{name} is on {t.device}, expected {ref.device} (like {ref_name})")
    return problems


def _sigma_type_problems(sigma, sigma_next, batch, device) -> list[str]:
    problems = []
    for name, s in (("sigma", sigma), ("sigma_next", sigma_next)):
        if isinstance(s, torch.Tensor):
            if not s.is_floating_point() or s.shape not in ((), (1,), (batch,)):
                problems.append(f"{name} must be a float or a floating tensor of shape [B]={batch} "
                                f"(or 0-dim), got {s.dtype} {tuple(s.shape)}")
            elif s.device != device:
                problems.append(f"{name} is on {s.device}, expected {device}")
        elif isinstance(s, bool) or not isinstance(s, (int, float)):
            problems.append(f"{name} must be a python float or a tensor of shape [B], got {type(s).__name__}")
    return problems


def _triton_problems(named, batch, device) -> list[str]:
    if not triton_available():
        return ["backend='triton' but triton is not installed"]
    problems = []
    if device.type != "cuda" and not _triton_module().INTERPRET:
        problems.append(f"backend='triton' on {device.type} tensors needs TRITON_INTERPRET=1 in "
                        "the environment before the first Triton kernel is used")
    if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for _, t in named):
        problems.append("backend='triton' computes in fp32; use backend='torch' for float64 inputs")
    if batch > _MAX_GRID_Y:
        problems.append(f"backend='triton' supports at most {_MAX_GRID_Y} samples per call, "
                        f"got {batch}")
    return problems


_SIGMA_SHAPES = ((), (1,))


def _sigmas_ok(sigma, sigma_next, *, sde_type: str, eta: float, replay: bool,
               sigma_one: str, log_prob_form: str) -> bool:
    """True when the sigma values pass every check of ``_sigma_value_problems``.

    Python floats: plain Python, no tensor op. Tensors: a handful of elementwise ops and ONE
    host-device sync (the ``bool`` of a single flag), instead of the ~25 ops of the report.
    Only a failure pays for the full report.
    """
    refuse_sigma_one, refuse_last = _undefined_points(sde_type, eta, replay, sigma_one, log_prob_form)
    if not isinstance(sigma, torch.Tensor) and not isinstance(sigma_next, torch.Tensor):
        s, sn = float(sigma), float(sigma_next)  # NaN fails every comparison below
        return (0.0 < s <= 1.0 and 0.0 <= sn < s and not (refuse_sigma_one and s >= 1.0)
                and not (refuse_last and sn == 0.0))
    s = sigma.double() if isinstance(sigma, torch.Tensor) else float(sigma)
    sn = sigma_next.double() if isinstance(sigma_next, torch.Tensor) else float(sigma_next)
    upper = 1.0 if not refuse_sigma_one else math.nextafter(1.0, 0.0)
    ok = (sn >= 0.0) & (sn < s) & (s > 0.0) & (s <= upper)  # inf and NaN fail too
    if not isinstance(ok, torch.Tensor):
        ok = torch.tensor(ok)
    if refuse_last:
        ok = ok & (sn != 0.0)
    # NOTE: host-device sync (validate=True with sigma tensors); validate=False skips it
    return bool(ok.all())


def _fast_resolve(named, sigma, sigma_next, *, eta, sde_type: str, backend: str, replay: bool,
                  validate: bool, sigma_one: str = "refuse",
                  log_prob_form: str = "gaussian") -> str | None:
    """The resolved backend when the call is valid, found with a few attribute reads; None
    sends it to ``check_step_inputs``, which lists every problem.

    NOTE: ``check_step_inputs`` costs a large share of the 8 x 36,864 fwd+bwd time target per
    call, and its sigma-value report a host sync for tensors (figures:
    bench/reports/2026-12-04_cpu-h200_comment-figures.md). This path accepts exactly what the full
    check accepts (tests/test_kernels_sde.py drives both with every bad input) and builds no
    message.
    """
    if sde_type not in TABLE or backend not in BACKENDS or type(eta) not in (float, int):
        return None
    if sigma_one not in SIGMA_ONE_TREATMENTS or log_prob_form not in LOG_PROB_FORMS:
        return None
    if not (0.0 <= eta < math.inf and eta <= TABLE[sde_type].eta_max):  # NaN fails too
        return None
    if replay and is_deterministic(eta, sde_type):
        return None
    ref = named[0][1]
    if type(ref) is not torch.Tensor or ref.dim() < 1 or ref.numel() == 0:
        return None
    shape, device = ref.shape, ref.device
    batch = shape[0]
    float64 = False
    for _, t in named:
        if type(t) is not torch.Tensor or t.shape != shape or t.dtype not in _FLOAT_DTYPES or t.device != device:
            return None
        float64 = float64 or t.dtype == torch.float64
    for s in (sigma, sigma_next):
        if isinstance(s, torch.Tensor):
            if not s.is_floating_point() or s.device != device or (
                    s.dim() > 1 or (s.dim() == 1 and s.shape[0] not in (1, batch))):
                return None
        elif type(s) not in (float, int):
            return None
    resolved = resolve_backend(backend, device)
    if resolved == "triton" and (not triton_available() or float64 or batch > _MAX_GRID_Y or (
            device.type != "cuda" and not _triton_module().INTERPRET)):
        return None
    if validate and not _sigmas_ok(sigma, sigma_next, sde_type=sde_type, eta=eta, replay=replay,
                                   sigma_one=sigma_one, log_prob_form=log_prob_form):
        return None
    return resolved


def _flat(t: torch.Tensor, batch: int) -> torch.Tensor:
    """``[B, N]`` contiguous and 16-byte aligned (see ``sde_triton.py`` on determinism)."""
    if t.dim() != 2 or not t.is_contiguous():
        t = t.reshape(batch, -1).contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def sde_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, *, eta: float, sde_type: str = "sde",
             noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
             backend: str = "auto", validate: bool = True, sigma_one: str = "refuse",
             log_prob_form: str = "gaussian") -> SDEStepOutput:
    """One sampling step ``x (at sigma) -> prev_sample (at sigma_next)`` and its log-prob.

    Args:
        x, v: latent and model velocity, ``[B, ...]``, fp32/bf16/fp16 (float64: torch backend).
        sigma, sigma_next: python floats or ``[B]`` tensors (per-sample steps), ``0 <= sigma_next
            < sigma <= 1``.
        eta: noise level (``cps``: in [0, 1]). ``eta == 0`` or ``sde_type="ode"`` is the
            deterministic Euler step of diffusers' FlowMatchEulerDiscreteScheduler; it draws no
            noise and returns ``log_prob=None``.
        sde_type: ``"sde"`` (Flow-GRPO), ``"dance"`` (DanceGRPO), ``"cps"`` or ``"ode"``.
        noise: standard-normal noise shaped like ``x``; drawn as fp32 from ``generator`` if None.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.
        validate: check the sigma values (one host sync for sigma tensors).
        sigma_one: ``sde`` at sigma == 1: ``"refuse"`` (those samples take the deterministic
            Euler step and get a NaN log-prob) or ``"clamp_to_next"`` (the Flow-GRPO
            reference's ``std_dev_t = eta * sqrt(sigma / (1 - sigma_next))``).
        log_prob_form: ``"gaussian"`` (NaN for ``cps`` at sigma_next == 0) or
            ``"squared_residual"`` (``-mean((x' - mean)^2)``, the reference's ``cps`` form).

    See ``kernels.sde_reference`` for the formulas. Sampling is not differentiable; replay with
    ``sde_log_prob`` to get gradients.
    """
    named = [("x", x), ("v", v)] + ([("noise", noise)] if noise is not None else [])
    opts = {"sigma_one": sigma_one, "log_prob_form": log_prob_form}
    resolved = (_fast_resolve(named, sigma, sigma_next, eta=eta, sde_type=sde_type, backend=backend,
                              replay=False, validate=validate, **opts)
                or check_step_inputs("sde_step", named, sigma, sigma_next, eta=eta, sde_type=sde_type,
                                     backend=backend, replay=False, validate=validate, **opts))
    deterministic = is_deterministic(eta, sde_type)
    if not deterministic and noise is None:
        noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    if resolved == "torch":
        return SDEStepOutput(*sde_step_ref(x, v, sigma, sigma_next, eta=eta, sde_type=sde_type,
                                           noise=noise, **opts))
    tri = _triton_module()
    batch = x.shape[0]
    prev, log_prob, mean, std = tri.sde_step(
        _flat(x, batch), _flat(v, batch), None if deterministic else _flat(noise, batch),
        sigma, sigma_next, tri.step_params(sde_type, float(eta), sigma_one, log_prob_form), x.dtype)
    return SDEStepOutput(prev.view(x.shape), log_prob, mean.view(x.shape), std)


def sde_log_prob(x: torch.Tensor, v: torch.Tensor, prev_sample: torch.Tensor, sigma, sigma_next, *,
                 eta: float, sde_type: str = "sde", backend: str = "auto",
                 validate: bool = True, sigma_one: str = "refuse",
                 log_prob_form: str = "gaussian") -> torch.Tensor:
    """Replay: ``log p(prev_sample | x)`` per sample, ``[B]`` fp32, differentiable w.r.t. ``v`` only.

    Arguments as in ``sde_step``. ``x`` and ``prev_sample`` are data: no gradient reaches them.
    The Triton backward recomputes the mean instead of saving intermediates (it keeps references to
    x, v and prev_sample only). Raises for the ODE step and for samples without a density.
    """
    named = [("x", x), ("v", v), ("prev_sample", prev_sample)]
    opts = {"sigma_one": sigma_one, "log_prob_form": log_prob_form}
    resolved = (_fast_resolve(named, sigma, sigma_next, eta=eta, sde_type=sde_type, backend=backend,
                              replay=True, validate=validate, **opts)
                or check_step_inputs("sde_log_prob", named, sigma, sigma_next, eta=eta, sde_type=sde_type,
                                     backend=backend, replay=True, validate=validate, **opts))
    if resolved == "torch":
        return sde_log_prob_ref(x, v, prev_sample, sigma, sigma_next, eta=eta, sde_type=sde_type,
                                **opts)
    tri = _triton_module()
    batch = x.shape[0]
    # detach only what carries autograd history (a detach is a tensor op on the launch path)
    x = x.detach() if x.requires_grad else x
    prev_sample = prev_sample.detach() if prev_sample.requires_grad else prev_sample
    return tri.sde_log_prob(_flat(x, batch), _flat(v, batch), _flat(prev_sample, batch),
                            sigma, sigma_next, tri.step_params(sde_type, float(eta), sigma_one,
                                                               log_prob_form))


def sde_kl(v: torch.Tensor, v_ref: torch.Tensor, sigma, sigma_next, *, eta: float,
           sde_type: str = "sde", validate: bool = True, sigma_one: str = "refuse",
           log_prob_form: str = "gaussian", kl_form: str = "gaussian") -> torch.Tensor:
    """KL of two transitions from the same ``x``, ``[B]``: the closed-form Gaussian KL
    (``kl_form="gaussian"``) or the Flow-GRPO reference's ``mean((mean - mean_ref)^2) /
    (2 std_dev_t^2)`` (``"reference"``); see ``kernels.sde_reference``.

    Mean over non-batch elements (the log-prob's convention), differentiable w.r.t. ``v`` (and
    ``v_ref`` if it requires grad). Plain torch: it is an optional regulariser.
    ``log_prob_form`` is accepted so that a batch's kernel options pass through unchanged; the
    KL does not depend on it.
    """
    if kl_form not in KL_FORMS:
        raise ValueError(f"sde_kl: kl_form must be one of {KL_FORMS}, got {kl_form!r}")
    # the KL divides by the variance: it needs one even where the log-prob form would not
    check_step_inputs("sde_kl", [("v", v), ("v_ref", v_ref)], sigma, sigma_next, eta=eta,
                      sde_type=sde_type, backend="torch", replay=True, validate=validate,
                      sigma_one=sigma_one, log_prob_form="gaussian")
    return sde_kl_ref(v, v_ref, sigma, sigma_next, eta=eta, sde_type=sde_type, sigma_one=sigma_one,
                      kl_form=kl_form)
