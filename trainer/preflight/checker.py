"""The preflight checker: the config under check, the problems found, and each key named with
its flag. Torch-free, like every preflight module: it runs before anything heavy loads."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from trainer.config import Config


def _flags() -> dict[tuple[str, str], str]:
    out = {}
    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(sec.default_factory):
            out[(sec.name, f.name)] = f.metadata["flag"]
    return out


_FLAG_OF = _flags()


def flagged(dotted: str) -> str:
    """``'fsdp.trainable_mode'`` -> ``'fsdp.trainable_mode (--fsdp-trainable-mode)'``."""
    section, _, name = dotted.partition(".")
    if section == "sampling":
        return f"rollout.sampling.{name} (--sampling-config)"
    flag = _FLAG_OF.get((section, name))
    return f"{dotted} ({flag})" if flag else dotted


@dataclasses.dataclass
class Checker:
    """The configuration under check and the errors and warnings found so far."""

    cfg: Config
    world_size: int | None
    gpus_per_node: int | None
    device: str
    check_paths: bool
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def error(self, msg: str) -> None:
        self.errors.append(msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)

    def one_of(self, dotted: str, value: Any, allowed: tuple[str, ...]) -> bool:
        if value not in allowed:
            self.error(f"{flagged(dotted)}={value!r} is not one of {', '.join(allowed)}")
            return False
        return True

    def at_least(self, dotted: str, value: Any, low: float, what: str = "") -> bool:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value) and value >= low
        if not ok:
            self.error(f"{flagged(dotted)}={value!r} must be >= {low}{what}")
        return ok


def check_finite_numbers(c: Checker) -> None:
    """Every float field holds a finite number: an ``inf`` passes every "> 0" rule (``lr=inf``
    trained until the log-probs overflowed) and a NaN passes every "< 0" one. Runs after the
    other rules; a key another rule already refused is not named twice."""
    for sec in dataclasses.fields(Config):
        section = getattr(c.cfg, sec.name)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if not isinstance(value, float) or math.isfinite(value):
                continue
            key = flagged(f"{sec.name}.{f.name}")
            if any(e.startswith(key) for e in c.errors):
                continue
            unset = " (leave it unset for none)" if "None" in str(f.type) else ""
            c.error(f"{key}={value!r} must be a finite number{unset}")
