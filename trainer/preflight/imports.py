"""Preflight's second stage, after the torch-free ``trainer.preflight.preflight``: import every
dotpath the run will import (model adapter, reward scorers, custom reward, a scorer's own
dotpath options) and check every reward scorer option against its constructor, loading no
weights. A typo then fails before any process starts, as one line of one error.
"""
from __future__ import annotations

from trainer.config import Config, ConfigError
from trainer.models import adapter_class
from trainer.rewards.spec import import_problems


def check_imports(cfg: Config) -> None:
    """Raise ONE ConfigError naming every problem found."""
    problems = []
    try:
        adapter_class(cfg.model.adapter_path)
    except ValueError as exc:
        problems.append(f"model.adapter_path: {exc}")
    problems += import_problems(cfg.reward)
    if problems:
        raise ConfigError(problems)
