"""Preflight's second stage, after the torch-free ``trainer.preflight.preflight``: import every
dotpath the run will import (model adapter, reward scorers, custom reward, a scorer's own
dotpath options), check every reward scorer option against its constructor, and call the
custom reward once on a dummy batch (two grey images at the run's resolution, with the first
prompts and metadata of the training data), loading no model weights of ours. A typo, a wrong
signature or a wrong return then fails before any process starts, as one line of one error.
"""
from __future__ import annotations

from trainer.config import Config, ConfigError
from trainer.models import adapter_class
from trainer.rewards.spec import import_problems


def _dummy_batch(cfg: Config) -> dict:
    """Keywords of ``dummy_batch_problems``: the run's image size and first prompt records
    (none when the prompt data cannot be read: the data rules report that)."""
    from trainer.prompts import load_records  # local: numpy; the toy world only when asked
    sampling = cfg.rollout.sampling if isinstance(cfg.rollout.sampling, dict) else {}
    try:
        records = load_records(cfg.data.prompt_data, limit=2)
    except Exception:  # any reason: the data rules report unreadable prompt data themselves
        records = []
    return {"height": int(sampling.get("height", 64)), "width": int(sampling.get("width", 64)),
            "records": records}


def check_imports(cfg: Config) -> None:
    """Raise ONE ConfigError naming every problem found."""
    problems = []
    try:
        adapter_class(cfg.model.adapter_path)
    except ValueError as exc:
        problems.append(f"model.adapter_path: {exc}")
    dummy = _dummy_batch(cfg) if cfg.reward.custom_reward_path else None
    problems += import_problems(cfg.reward, dummy_batch=dummy)
    if problems:
        raise ConfigError(problems)
