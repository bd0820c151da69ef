"""The model card (``README.md``) of an export: what the weights are and how they were made.

A Hugging Face model card: YAML front matter (``base_model``, ``library_name: diffusers``,
tags) that the Hub reads, then the base model, the recipe (the run's resolved config, copied
beside the card as ``training_config.toml``, and its main settings), the LoRA rank and alpha,
the checkpoint's step, and the last evaluation at or before that step from the run's
``metrics.jsonl``.

The run directory is found from the checkpoint (``<run_dir>/checkpoints/<task>/iter_N``, the
default layout) or given (``export --run-dir``); without it the card says the recipe and the
eval are unknown rather than guessing.
"""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

TRAINING_CONFIG = "training_config.toml"
_HUB_CACHE_PATH = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/")


def find_run_dir(iter_dir: Path) -> Path | None:
    """The run directory of a checkpoint in the default layout, if its config is there."""
    for candidate in list(Path(iter_dir).resolve().parents)[:4]:
        if (candidate / "config.toml").is_file():
            return candidate
    return None


def hub_id_of(path: str | None) -> str | None:
    """``org/name`` of a path inside the Hugging Face cache, else None."""
    match = _HUB_CACHE_PATH.search(str(path or ""))
    return f"{match['org']}/{match['name']}" if match else None


def last_eval(run_dir: Path | None, step: int | None) -> tuple[int, dict[str, float]] | None:
    """(step, {metric: value}) of the last eval row at or before ``step`` in metrics.jsonl."""
    path = None if run_dir is None else Path(run_dir) / "metrics.jsonl"
    if path is None or not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if "eval/reward_mean" not in row or (step is not None and row.get("step", 0) > step):
            continue
        found = (int(row.get("step", 0)),
                 {k: v for k, v in row.items() if k.startswith("eval/")
                  and isinstance(v, (int, float))})
    return found


def _settings(config: dict[str, Any]) -> list[str]:
    model, lora = config.get("model", {}), config.get("lora", {})
    rollout, train, reward = config.get("rollout", {}), config.get("train", {}), \
        config.get("reward", {})
    sampling = rollout.get("sampling", {}) or {}
    scorers = reward.get("scorers") or {}
    rewards = ", ".join(f"{name} (weight {spec.get('weight', 1.0)})"
                        for name, spec in scorers.items()) or reward.get("scorer_path", "?")
    return [f"- adapter: `{model.get('adapter_path')}`",
            f"- reward: {rewards}",
            f"- algorithm: {train.get('algorithm', 'flow-grpo')}, lr {train.get('lr')}, "
            f"{rollout.get('rollout_batch_size')} prompts x "
            f"{rollout.get('n_samples_per_prompt')} samples per rollout",
            f"- sampling: {sampling.get('num_inference_steps')} steps, "
            f"{sampling.get('height')}x{sampling.get('width')}, "
            f"guidance {sampling.get('guidance_scale')}",
            f"- prompts: `{config.get('data', {}).get('prompt_data')}`",
            f"- LoRA targets: {lora.get('target_modules') or 'the adapter default'}"]


def model_card(*, form: str, contract: dict, state: dict, run_dir: Path | None,
               pipeline: bool) -> str:
    """The card's text."""
    base = contract.get("base_model_path") or state.get("model_path")
    hub = hub_id_of(base)
    config = {}
    if run_dir is not None and (Path(run_dir) / "config.toml").is_file():
        config = tomllib.loads((Path(run_dir) / "config.toml").read_text())
    step = state.get("iteration")
    evaluated = last_eval(run_dir, step)
    lora = contract.get("mode") == "lora"
    front = ["---", "library_name: diffusers",
             "tags: [flow-grpo, reinforcement-learning, text-to-image"
             + (", lora" if lora else "") + "]"]
    if hub:
        front.append(f"base_model: {hub}")
    front.append("---")
    what = ("a complete diffusers pipeline folder: load it with "
            "`DiffusionPipeline.from_pretrained(<this folder>)`" if pipeline else
            "a diffusers transformer folder: load it with "
            "`<TransformerClass>.from_pretrained(<this folder>)` and pass it to the base "
            "pipeline as `transformer=`")
    body = ["", "# Flow-GRPO fine-tune", "",
            f"Exported ({form}) from checkpoint step {step}: {what}.", "",
            "## Base model", "", f"- {hub or base}" + (f" (local path `{base}`)" if hub else ""),
            f"- content hash `{contract.get('base_model_hash')}`", "",
            "## Training", ""]
    if lora:
        body.append(f"- LoRA rank {contract.get('rank')}, alpha {contract.get('alpha')}"
                    + (" (merged into the base weights)" if form == "merged" else ""))
    else:
        body.append("- full fine-tune (no LoRA: rank 0)")
    if config:
        body += [f"- recipe: the run's resolved config, `{TRAINING_CONFIG}` beside this card "
                 f"(run directory `{Path(run_dir).name}`)", *_settings(config)]
    else:
        body.append("- recipe: unknown (the run directory was not found; "
                    "`python -m trainer export --run-dir RUN` names it)")
    body += ["", "## Final evaluation", ""]
    if evaluated is None:
        body.append("No evaluation was recorded at or before this checkpoint.")
    else:
        eval_step, values = evaluated
        body.append(f"At step {eval_step} (`metrics.jsonl`):")
        body.append("")
        body += ["| metric | value |", "| --- | --- |"]
        body += [f"| {k} | {v:.4f} |" for k, v in sorted(values.items())]
    return "\n".join(front + body) + "\n"
