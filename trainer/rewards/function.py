"""Custom reward functions by dotpath (``--custom-reward-path module.fn``).

``fn(images, prompts, metadata)`` scores a whole batch (images uint8 [B, H, W, 3] on the
rollout device, prompts list[str], metadata list[dict]) and returns either

* B numbers (a list, tuple, numpy array or tensor): one component, named by the function's
  ``component`` attribute if it has one, else by the function's ``__name__``; or
* a dict ``{component: B numbers}``: several components, which the function must declare up
  front as ``fn.components = ("a", "b")`` so the trainer can check the configured weights and
  required components before the first rollout rather than after it.

``None`` (or NaN) marks a sample the function could not score.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from trainer.rewards.base import RewardError, RewardScorer, load_object


class FunctionScorer(RewardScorer):
    """A RewardScorer around a plain batch function (see the module docstring)."""

    required_tracks = ("image",)

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None) -> None:
        if not callable(fn):
            raise ValueError(f"custom reward {name or fn!r} is not callable")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", repr(fn))
        declared = getattr(fn, "components", None)
        self.declared = declared is not None
        if declared is not None:
            if isinstance(declared, str) or not declared or \
                    not all(isinstance(c, str) and c for c in declared):
                raise ValueError(f"custom reward {self.name}: fn.components must be a non-empty "
                                 f"tuple of names, got {declared!r}")
            self.components = tuple(declared)
        else:
            self.components = (str(getattr(fn, "component", None) or fn.__name__),)

    @classmethod
    def from_dotpath(cls, dotpath: str) -> "FunctionScorer":
        return cls(load_object(dotpath, "custom reward path"), name=dotpath)

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.fn(images, prompts, metadata)
        if isinstance(out, Mapping):
            if not self.declared and len(self.components) == 1 and set(out) != set(self.components):
                raise RewardError(
                    f"custom reward {self.name} returned a dict with keys {sorted(out)} but does "
                    f"not declare them: set `{getattr(self.fn, '__name__', 'fn')}.components = "
                    f"{tuple(sorted(out))!r}`")
            unknown = sorted(set(out) - set(self.components))
            if unknown:
                raise RewardError(f"custom reward {self.name} returned undeclared components "
                                  f"{unknown} (declared: {list(self.components)})")
            return dict(out)
        if isinstance(out, (int, float)):
            raise RewardError(f"custom reward {self.name} returned one number for a batch of "
                              f"{len(prompts)}; return one value per sample")
        return {self.components[0]: out}
