"""The SDE types, once: each type's kernel code, eta range, undefined points and log-prob forms.

Every rule about an SDE type lives in this table and is asked here: the sampling config
(``trainer.config.sampling``), preflight, the engine's request parser and request builder, and
the kernels' own validation (``flowgrpo_kernels.sde``, ``sde_triton``). The formulas themselves
are the kernels' (``sde_reference`` is the oracle, ``sde_triton`` the fused branch). A new SDE
type therefore touches three places: a row here, its branch in ``sde_triton``'s kernels, its
formulas in ``sde_reference``.

Standard library only: preflight reads it before torch is imported.

Undefined points (``s = sigma``, ``s' = sigma_next``):

- ``singular_at_sigma_one``: ``std_dev_t`` is infinite at ``s == 1`` (``sde``). ``sigma_one``
  chooses the treatment: ``"refuse"`` (no density there: such a step is neither sampled with
  noise by a rollout nor replayed) or ``"clamp_to_next"`` (the Flow-GRPO reference: ``1 - s``
  replaced by ``1 - s'`` where ``s == 1``, which the kernels run as a code of its own).
- ``no_variance_at_last_step``: zero variance at ``s' == 0`` (``cps``): the Gaussian log-prob
  is undefined there; the squared-residual form is not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SIGMA_ONE_TREATMENTS: tuple[str, ...] = ("refuse", "clamp_to_next")
#: The kernels' ``log_prob_form``: the Gaussian log-density, or the Flow-GRPO reference's cps
#: ``-mean((x' - mean)^2)`` without variance or constants.
LOG_PROB_FORMS: tuple[str, ...] = ("gaussian", "squared_residual")
KL_FORMS: tuple[str, ...] = ("gaussian", "reference")  # kernels.sde_kl's kl_form


@dataclass(frozen=True)
class SDEType:
    """One row of the table (see the module docstring)."""

    name: str
    code: int                     # the Triton kernels' SDE_TYPE constexpr
    std_dev_t: str                # the noise coefficient, as messages quote it
    eta_max: float = math.inf     # eta must lie in [0, eta_max] (0: the ODE step)
    has_log_prob: bool = True     # False: deterministic, nothing to train (the ODE step)
    singular_at_sigma_one: bool = False
    no_variance_at_last_step: bool = False
    reference_log_prob_form: str = "gaussian"  # the Flow-GRPO reference's form for this type
    clamp_to_next_code: int | None = None      # the kernel code of sigma_one='clamp_to_next'

    def kernel_code(self, eta: float, sigma_one: str) -> int:
        """The kernels' SDE_TYPE constexpr: eta == 0 is the ODE step for every type."""
        if eta == 0.0:
            return ODE.code
        if self.singular_at_sigma_one and sigma_one == "clamp_to_next":
            return self.clamp_to_next_code
        return self.code

    def refuses_sigma_one(self, sigma_one: str) -> bool:
        """True when a noisy step at sigma == 1 has no density under this treatment."""
        return self.singular_at_sigma_one and sigma_one == "refuse"

    def refuses_last_step(self, log_prob_form: str) -> bool:
        """True when a noisy step to sigma_next == 0 has no log-prob in this form."""
        return self.no_variance_at_last_step and log_prob_form == "gaussian"

    def eta_problem(self, eta: float, *, noise_required: bool) -> str | None:
        """Why ``eta`` is outside this type's range (None when inside). ``noise_required``:
        a trained configuration, where eta == 0 (the ODE step) has nothing to train."""
        low = "(0" if noise_required else "[0"
        if eta > self.eta_max or (noise_required and eta <= 0.0) or eta < 0.0:
            if self.eta_max == math.inf:
                bound = "> 0" if noise_required else ">= 0"
                return f"eta must be {bound} with sde_type={self.name!r}, got {eta!r}"
            return (f"eta must be in {low}, {self.eta_max:g}] with sde_type={self.name!r}, got "
                    f"{eta!r} (std_dev_t = {self.std_dev_t})")
        return None

    def sigma_one_problem(self) -> str:
        """Why a step at sigma == 1 is refused (only asked where ``refuses_sigma_one``)."""
        others = [t.name for t in TRAINED if not t.singular_at_sigma_one]
        return (f"sde_type={self.name!r} is singular at sigma == 1 (std_dev_t = "
                f"{self.std_dev_t} is infinite there) with sigma_one='refuse': no density, "
                f"nothing to train; use steps after the first, sde_type "
                f"{' or '.join(repr(o) for o in others)}, or sigma_one='clamp_to_next' (the "
                "Flow-GRPO reference's treatment)")

    def last_step_problem(self) -> str:
        """Why a step to sigma_next == 0 is refused (only asked where ``refuses_last_step``)."""
        return (f"sde_type={self.name!r} has zero variance at sigma_next == 0 (std_dev_t = "
                f"{self.std_dev_t}): the Gaussian log-prob is undefined and this step cannot "
                "be trained; use earlier steps or log_prob_form='squared_residual' (the "
                "sampling config's cps_log_prob='reference')")


ODE = SDEType("ode", 0, std_dev_t="0", has_log_prob=False)
SDE = SDEType("sde", 1, std_dev_t="eta * sqrt(sigma / (1 - sigma))",
              singular_at_sigma_one=True, clamp_to_next_code=4)
DANCE = SDEType("dance", 2, std_dev_t="eta")
CPS = SDEType("cps", 3, std_dev_t="sigma_next * sin(eta * pi / 2)", eta_max=1.0,
              no_variance_at_last_step=True, reference_log_prob_form="squared_residual")

#: Types with a log-prob, the ones a rollout trains, in the order messages list them.
TRAINED: tuple[SDEType, ...] = (SDE, DANCE, CPS)
TABLE: dict[str, SDEType] = {t.name: t for t in TRAINED + (ODE,)}
#: Names: the trained types (the sampling config's ``sde_type``) and every kernel type.
SDE_TYPES: tuple[str, ...] = tuple(t.name for t in TRAINED)
KERNEL_SDE_TYPES: tuple[str, ...] = tuple(TABLE)


def is_deterministic(eta: float, sde_type: str) -> bool:
    """The ODE step: no noise and no log-prob (``eta == 0`` or a type without one)."""
    row = TABLE.get(sde_type)
    return eta == 0.0 or (row is not None and not row.has_log_prob)


def undefined_step_problems(sde_type: str, eta: float, steps, sigmas, *, sigma_one: str,
                            log_prob_form: str) -> list[str]:
    """The noisy ``steps`` of a schedule (``sigmas``: N + 1 floats, step i goes from
    ``sigmas[i]`` to ``sigmas[i + 1]``) that fall on an undefined point of the type, one
    message per kind: "steps [0] (sigma == 1): why"."""
    row = TABLE[sde_type]
    if is_deterministic(eta, sde_type):
        return []
    inside = [int(i) for i in steps if 0 <= i < len(sigmas) - 1]
    problems = []
    at_one = [i for i in inside if float(sigmas[i]) >= 1.0]
    if at_one and row.refuses_sigma_one(sigma_one):
        problems.append(f"steps {at_one} (sigma == 1): {row.sigma_one_problem()}")
    at_last = [i for i in inside if float(sigmas[i + 1]) == 0.0]
    if at_last and row.refuses_last_step(log_prob_form):
        problems.append(f"steps {at_last} (sigma_next == 0): {row.last_step_problem()}")
    return problems
