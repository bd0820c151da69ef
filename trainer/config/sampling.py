"""The sampling configuration (``rollout.sampling``, ``--sampling-config``) as one typed object.

``SamplingConfig`` owns every sampling key: its default, its validation and the resolution of
which denoising steps get SDE noise and which of them are trained. It is the config section's
own type (``RolloutConfig.sampling``): the loader applies each layer's partial table to it
(``merged``: a recipe, a flag, ``--set``), preflight checks it once (``check``), and the rollout
driver, the rollout request (``trainer.models.wire``) and the actor's replay read its fields;
nothing else declares sampling keys, and the SDE types are the kernels' table. Standard library
only (preflight imports it before anything heavy); the per-rollout draw imports numpy when it
runs.

Why ``merged`` stores values unchecked: a later layer may mend what an earlier one left
inconsistent (a recipe's ``sde_indices = [0]`` with ``--set rollout.sampling.sigma_one=
clamp_to_next``), so the rules run once, on the final config, where preflight reports every
problem together. Unknown keys are refused at once, as for every other section.

Step selection (``sde_step_mode``):

- ``"indices"`` (Relax-style, the default): noise is injected, and trained, only at the resolved
  SDE steps. Priority, highest first: ``sde_resample_per_rollout`` with a rollout id draws
  ``num_sde_steps`` steps without replacement from ``sde_pool`` (default: the fraction window)
  with ``numpy.random.default_rng(rollout_id)``, identical on every rank and restart;
  ``sde_indices`` (sorted, de-duplicated; evaluation's deterministic path); ``num_sde_steps``
  points at stride ``window[floor(k * len(window) / num_sde_steps)]`` in the
  ``sde_timestep_fraction`` window ``range(floor(lo * T), floor(hi * T))``; else nothing.
- ``"every_step"`` (the Flow-GRPO reference): noise at every step, and the first
  ``int(T * timestep_fraction)`` steps are trained (0.99 of 10 steps: steps 0..8).
- ``"ode"``: deterministic sampling, nothing trained: the reference's evaluation
  (``trainer.evaluation``); preflight rejects it for training.

Where the SDE is undefined, the table of SDE types (``flowgrpo_kernels.sde_types``) says, and
this module asks it: a type singular at sigma == 1 (step 0) under ``sigma_one = "refuse"``
rejects every configuration that could put noise there (``"clamp_to_next"`` samples it as the
reference does); a type without variance at the last step (sigma_next == 0) rejects noise there
unless ``cps_log_prob = "reference"`` picks the type's reference log-prob form. The table also
holds each type's eta range.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from flowgrpo_kernels.sde_types import (KL_FORMS, SDE_TYPES,  # noqa: F401 (train.kl_form's)
                                        SIGMA_ONE_TREATMENTS, TABLE)
from trainer.utils.values import is_int, is_number

SDE_STEP_MODES: tuple[str, ...] = ("indices", "every_step", "ode")  # ode: evaluation only
#: "reference": the type's reference log-prob form (the table's ``reference_log_prob_form``).
CPS_LOG_PROB_FORMS: tuple[str, ...] = ("gaussian", "reference")
SAMPLE_ID_MODES: tuple[str, ...] = ("metadata", "positional", "group_index")
_STEP_KEYS = frozenset({"num_inference_steps", "sde_type", "sde_step_mode", "sde_indices",
                        "sde_pool", "num_sde_steps", "sde_timestep_fraction",
                        "sde_resample_per_rollout", "timestep_fraction", "sigma_one",
                        "cps_log_prob"})
_FLOOR_EPS = 1e-9  # keeps lo = 1/12 from flooring to step 0 through float rounding

#: The config's default table (trainer.config): the Relax-style recipe of the project.
RELAX_SAMPLING: dict[str, Any] = {
    "height": 384, "width": 384, "num_inference_steps": 12, "guidance_scale": 1.0, "eta": 0.7,
    "sde_type": "sde", "sde_indices": [3, 4, 5], "sde_resample_per_rollout": True,
    "num_sde_steps": 3, "sde_pool": [1, 2, 3, 4, 5], "driver_xt": True,
    "sample_id_mode": "metadata",
}


class SamplingError(ValueError):
    """Every problem of a sampling table; each message starts with the key it is about."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid sampling config:\n  - " + "\n  - ".join(self.problems))


def _unset(value: Any) -> bool:
    """None, or "none" (TOML has no null: how a recipe unsets a key of the default table)."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null"))


def fraction_window(fraction: Any, num_steps: int) -> list[int]:
    """Steps in the half-open window ``[floor(lo*T), floor(hi*T))`` of a T-step schedule."""
    lo, hi = float(fraction[0]), float(fraction[1])
    start = int(math.floor(lo * num_steps + _FLOOR_EPS))
    stop = int(math.floor(hi * num_steps + _FLOOR_EPS))
    return list(range(max(start, 0), min(stop, num_steps)))


@dataclass(frozen=True)
class SamplingConfig:
    """One field per ``--sampling-config`` key; build it with ``from_dict``."""

    height: int = 384
    width: int = 384
    num_frames: int = 1  # video families (Wan): frames per candidate; 1 is an image
    num_inference_steps: int = 12
    guidance_scale: float = 1.0  # 1.0: no CFG; > 1: cond + uncond forwards (trainer.models.guidance)
    eta: float = 0.7
    sde_type: str = "sde"
    sde_step_mode: str = "indices"
    sde_indices: tuple[int, ...] | None = None
    sde_pool: tuple[int, ...] | None = None
    num_sde_steps: int = 0
    sde_timestep_fraction: tuple[float, float] = (0.0, 1.0)
    sde_resample_per_rollout: bool = False
    timestep_fraction: float = 1.0  # every_step: share of the steps trained (reference 0.99)
    sigma_one: str = "refuse"
    cps_log_prob: str = "gaussian"
    driver_xt: bool = True
    driver_sigmas: bool = True
    init_same_noise: bool = False  # a group shares x_T (training rollouts only)
    init_noise_latent_shape: tuple[int, ...] | None = None  # checked against the model's
    sample_id_mode: str = "metadata"

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def keys(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, raw: "Mapping[str, Any] | SamplingConfig", *,
                  type_rules: bool = True) -> "SamplingConfig":
        """Validate a sampling table (None values take the default) or config; one
        SamplingError. ``type_rules`` False: not the SDE type's undefined points."""
        config, problems = cls.check(raw, type_rules=type_rules)
        if problems:
            raise SamplingError(problems)
        return raw if isinstance(raw, SamplingConfig) else config

    def merged(self, table: Any) -> "tuple[SamplingConfig, list[str]]":
        """This config with a partial table's keys applied over its own, and the problems
        that stop a key from being applied at all (not a table, unknown keys). The values
        are stored as given (None or "none": the field's default), lists as tuples; ``check``
        judges them (see the module docstring)."""
        if not isinstance(table, Mapping):
            return self, [f"expected a table/dict, got {table!r}"]
        unknown = sorted(set(table) - self.keys())
        problems = [f"unknown sampling keys {unknown} (known: {sorted(self.keys())})"] \
            if unknown else []
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        values = {k: defaults[k] if _unset(v) else v for k, v in table.items() if k in defaults}
        _check_types(values, [])  # only its conversions: tuples and floats where values fit
        return dataclasses.replace(self, **values), problems

    @classmethod
    def check(cls, raw: Any, *, type_rules: bool = True) -> "tuple[SamplingConfig | None, list[str]]":
        """``(config, problems)``: every problem of ``raw`` (a table or a config built by
        ``merged``), unknown keys included.

        ``config`` holds the valid keys (a bad key takes its default, so callers can go on
        checking what depends on it); it is None when the SDE steps cannot be resolved.
        Use it only to collect more problems: with any problem the table is invalid.
        """
        if isinstance(raw, SamplingConfig):
            raw = raw.to_dict()
        if not isinstance(raw, Mapping):
            return None, [f"sampling must be a table/dict, got {type(raw).__name__}"]
        problems: list[str] = []
        unknown = sorted(set(raw) - cls.keys())
        if unknown:
            problems.append(f"unknown sampling keys {unknown} (known: {sorted(cls.keys())})")
        # None, or "none" (TOML has no null: how a recipe unsets a key of the default table),
        # takes the field's default
        values = {k: v for k, v in raw.items() if k in cls.keys() and not _unset(v)}
        _check_types(values, problems)
        bad_keys = {p.split()[0].split("=")[0] for p in problems}
        if bad_keys & _STEP_KEYS:  # the step rules would judge a default, not the user's value
            return None, problems
        config = cls(**{k: v for k, v in values.items() if k not in bad_keys})
        step_problems = config._step_problems(type_rules)
        return (None if step_problems else config), problems + step_problems

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (tuples as lists), ``from_dict(to_dict())`` gives it back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    # ---- step resolution --------------------------------------------------------------
    def window(self) -> list[int]:
        return fraction_window(self.sde_timestep_fraction, self.num_inference_steps)

    def static_indices(self) -> list[int]:
        """Noise steps without a rollout id (evaluation, or resampling off)."""
        if self.sde_step_mode == "ode":
            return []
        if self.sde_step_mode == "every_step":
            return list(range(self.num_inference_steps))
        if self.sde_indices is not None:
            return sorted(set(self.sde_indices))
        window = self.window()
        if self.num_sde_steps <= 0 or not window:
            return []
        n = min(self.num_sde_steps, len(window))
        return [window[(k * len(window)) // self.num_sde_steps] for k in range(n)]

    def resample_pool(self) -> list[int]:
        return sorted(set(self.sde_pool)) if self.sde_pool is not None else self.window()

    def reachable_noise_steps(self) -> list[int]:
        """Every step at which some rollout (any id) or evaluation could inject noise."""
        steps = set(self.static_indices())
        if self.sde_step_mode == "indices" and self.sde_resample_per_rollout and self.num_sde_steps > 0:
            steps |= set(self.resample_pool())
        return sorted(steps)

    def noise_steps(self, rollout_id: int | None) -> list[int]:
        """The sorted steps that get SDE noise in this rollout (``None``: evaluation)."""
        if self.sde_step_mode == "indices" and self.sde_resample_per_rollout and rollout_id is not None:
            import numpy as np  # only here: preflight stays free of numpy

            rng = np.random.default_rng(int(rollout_id))
            chosen = rng.choice(np.asarray(self.resample_pool(), dtype=np.int64),
                                size=self.num_sde_steps, replace=False)
            return sorted(int(i) for i in chosen)
        return self.static_indices()

    def num_trained_every_step(self) -> int:
        return int(self.num_inference_steps * self.timestep_fraction)

    def trained_steps(self, noise_steps: list[int]) -> list[int]:
        """The noise steps that are replayed and trained (every_step: the first fraction)."""
        if self.sde_step_mode == "every_step":
            return [i for i in noise_steps if i < self.num_trained_every_step()]
        return list(noise_steps)

    def reachable_trained_steps(self) -> list[int]:
        return self.trained_steps(self.reachable_noise_steps())

    # ---- what the kernels and the adapters take ----------------------------------------
    @property
    def log_prob_form(self) -> str:
        """The kernels' ``log_prob_form``: the type's reference form when asked for."""
        return TABLE[self.sde_type].reference_log_prob_form if self.cps_log_prob == "reference" \
            else "gaussian"

    def kernel_options(self) -> dict[str, Any]:
        """Keyword arguments of ``kernels.sde_step`` / ``sde_log_prob`` / ``sde_kl``."""
        return {"eta": float(self.eta), "sde_type": self.sde_type, "sigma_one": self.sigma_one,
                "log_prob_form": self.log_prob_form}

    def _step_problems(self, type_rules: bool = True) -> list[str]:
        """The rules across keys; ``type_rules`` False leaves out the SDE type's undefined
        points (resolving steps only)."""
        problems: list[str] = []
        if self.sde_step_mode == "ode":
            return problems
        steps = self.num_inference_steps
        window = self.window()
        if self.sde_pool is not None and not self.sde_pool:
            problems.append("sde_pool is empty")
        indices_mode = self.sde_step_mode == "indices"
        if indices_mode and self.num_sde_steps > len(window) and (
                self.sde_indices is None or (self.sde_resample_per_rollout and self.sde_pool is None)):
            problems.append(f"num_sde_steps={self.num_sde_steps} exceeds the {len(window)} steps "
                            f"of the sde_timestep_fraction window {window}")
        if indices_mode and self.sde_resample_per_rollout:
            if self.num_sde_steps <= 0:
                problems.append("sde_resample_per_rollout is set but num_sde_steps is 0")
            elif self.sde_pool is not None and self.num_sde_steps > len(set(self.sde_pool)):
                problems.append(f"num_sde_steps={self.num_sde_steps} exceeds the "
                                f"{len(set(self.sde_pool))} distinct steps of the resampling "
                                f"pool {sorted(set(self.sde_pool))}")
        if self.sde_step_mode == "every_step" and self.num_trained_every_step() < 1:
            problems.append(f"timestep_fraction={self.timestep_fraction} trains no step of "
                            f"{steps} (int({steps} * fraction) must be >= 1)")
        if problems or not type_rules:
            return problems
        row = TABLE[self.sde_type]
        if row.refuses_sigma_one(self.sigma_one):
            reasons = self._step0_reasons()
            if reasons:
                problems.append(f"sde_indices: SDE step 0 cannot be trained (sigma == 1; "
                                f"{'; '.join(reasons)}): {row.sigma_one_problem()} (e.g. sde_pool "
                                f"[1, 2, 3, 4, 5], or a fraction window starting at or above "
                                f"1/{steps})")
        last = steps - 1
        # every noisy step records a log-prob (trained or not), and the response must be finite
        if row.refuses_last_step(self.log_prob_form) and last in self.reachable_noise_steps():
            problems.append(f"sde_type: cannot put noise on the last step {last} with "
                            f"cps_log_prob={self.cps_log_prob!r}: {row.last_step_problem()} "
                            "(with earlier steps: not sde_step_mode='every_step')")
        return problems

    def _step0_reasons(self) -> list[str]:
        reasons = []
        if self.sde_step_mode == "every_step":
            return ["sde_step_mode='every_step' puts noise on step 0"]
        if self.sde_indices is not None and 0 in self.sde_indices:
            reasons.append("sde_indices contains 0")
        if self.sde_resample_per_rollout and self.num_sde_steps > 0:
            if self.sde_pool is not None and 0 in self.sde_pool:
                reasons.append("sde_pool contains 0")
            elif self.sde_pool is None and 0 in self.window():
                reasons.append("the resampling pool (no sde_pool: the fraction window) contains 0")
        static = self.static_indices()
        if self.sde_indices is None and 0 in static:
            reasons.append(f"sde_timestep_fraction {list(self.sde_timestep_fraction)} resolves to "
                           f"{static} (a stride in the window {self.window()} starting at step 0)")
        return reasons


# ---- value checks ---------------------------------------------------------------------------
def _check_types(values: dict[str, Any], problems: list[str]) -> None:
    """Type/range problems; converts lists to tuples in ``values`` in place."""
    for key in ("height", "width", "num_frames", "num_inference_steps"):
        if key in values and (not is_int(values[key]) or values[key] < 1):
            problems.append(f"{key} must be a positive integer, got {values[key]!r}")
    if "num_sde_steps" in values and (not is_int(values["num_sde_steps"]) or values["num_sde_steps"] < 0):
        problems.append(f"num_sde_steps must be a non-negative integer, got {values['num_sde_steps']!r}")
    choices = {"sde_type": SDE_TYPES, "sde_step_mode": SDE_STEP_MODES,
               "sigma_one": SIGMA_ONE_TREATMENTS, "cps_log_prob": CPS_LOG_PROB_FORMS,
               "sample_id_mode": SAMPLE_ID_MODES}
    for key, allowed in choices.items():
        if key in values and values[key] not in allowed:
            problems.append(f"{key} must be one of {', '.join(allowed)}, got {values[key]!r}")
    for key in ("sde_resample_per_rollout", "driver_xt", "driver_sigmas", "init_same_noise"):
        if key in values and not isinstance(values[key], bool):
            problems.append(f"{key} must be true or false, got {values[key]!r}")
    if values.get("init_same_noise") is True and values.get("driver_xt") is False:
        problems.append("init_same_noise needs driver_xt: without the driver's x_T recipe "
                        "the engine draws x_T itself and cannot share it within a group")
    g = values.get("guidance_scale", 1.0)
    if not is_number(g) or g < 1.0:
        problems.append(f"guidance_scale must be a number >= 1.0 (1.0: no CFG), got {g!r}")
    eta = values.get("eta", SamplingConfig.eta)
    sde_type = values.get("sde_type", SamplingConfig.sde_type)
    if not is_number(eta) or not eta > 0:
        problems.append(f"eta must be > 0 with sde_type={sde_type!r}, got {eta!r} (eta 0 is the "
                        "ODE: no noise, no log-prob to train)")
    elif sde_type in TABLE and TABLE[sde_type].eta_problem(eta, noise_required=True):
        problems.append(TABLE[sde_type].eta_problem(eta, noise_required=True))
    tf = values.get("timestep_fraction", 1.0)
    if not is_number(tf) or not 0.0 < tf <= 1.0:
        problems.append(f"timestep_fraction must be in (0, 1], got {tf!r}")
    for key in ("sde_indices", "sde_pool", "init_noise_latent_shape"):
        if key not in values:
            continue
        v = values[key]
        if not isinstance(v, (list, tuple)) or not all(is_int(i) for i in v):
            problems.append(f"{key} must be a list of integers, got {v!r}")
            continue
        values[key] = tuple(int(i) for i in v)
        steps = values.get("num_inference_steps", SamplingConfig.num_inference_steps)
        bad = sorted({i for i in v if not 0 <= i < steps}) if is_int(steps) else []
        if bad and key != "init_noise_latent_shape":
            problems.append(f"{key} {bad} outside the schedule's steps 0..{steps - 1}")
    if "sde_timestep_fraction" in values:
        frac = values["sde_timestep_fraction"]
        try:
            lo, hi = (float(x) for x in frac)
        except (TypeError, ValueError):
            problems.append(f"sde_timestep_fraction must be a pair [lo, hi], got {frac!r}")
        else:
            if not 0.0 <= lo < hi <= 1.0:
                problems.append(f"sde_timestep_fraction must satisfy 0 <= lo < hi <= 1, got {list(frac)}")
            values["sde_timestep_fraction"] = (lo, hi)
    for key in ("guidance_scale", "eta", "timestep_fraction"):
        if key in values and is_number(values[key]):
            values[key] = float(values[key])
