"""Small checks and look-ups shared by the torch-free config side and the runtime.

This module imports no torch: preflight (``trainer.preflight``, ``trainer.config.sampling``) uses it
before anything heavy loads.
"""
from __future__ import annotations

import importlib
import math
from typing import Any

# The dtypes a run may train, reduce and sample in (``trainer.utils.dtypes`` maps names to torch).
RUN_DTYPES: tuple[str, ...] = ("bf16", "fp32")


def is_int(v: Any) -> bool:
    """An integer, and not a bool (``True`` is an int to Python, never to a config)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float, and not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def import_dotpath(dotpath: str, what: str = "dotpath") -> Any:
    """Import ``package.module.attr`` and return ``attr`` (a class or a function).

    Every failure is a ValueError naming ``what`` and the path."""
    module_name, _, attr = dotpath.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {dotpath!r} is not a dotpath of the form module.attr")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {dotpath!r}: cannot import module {module_name!r} "
                         f"({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what} {dotpath!r}: module {module_name!r} has no attribute {attr!r}") \
            from None
