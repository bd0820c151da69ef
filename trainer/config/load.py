"""Run configuration: one dataclass per section, loaded from a TOML recipe.

Precedence: ``--set section.key=value`` (nested for tables: ``rollout.sampling.height=512``)
and flags (``--train-num-rollouts 3``: each key's own, ``cli_flag``; the older short names
such as ``--num-rollout`` stay as aliases) > the TOML file > the defaults in
``trainer.config.sections``. A Flow-GRPO dataset folder as ``data.prompt_data`` becomes its
train file, and its test file the eval data unless eval data is given at the same or a higher
level (``resolve_dataset_folders``); a Hugging Face hub id as ``model.model_path`` becomes its
snapshot folder in the local cache (``trainer.config.hub``). Applying one value (coercion, nesting, the derived global batch
size) and the ``--help`` listing: ``trainer.config.overrides``. The resolved config is written to
``<run_dir>/config.toml`` (and ``config.json``) so a run can be reproduced from its directory
alone. This module imports no torch: preflight runs before anything heavy loads.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from trainer.config.hub import resolve_model_path
from trainer.config.overrides import apply_value, field_help_text
from trainer.config.sections import Config, ConfigError, flag_table
from trainer.data.prompt_files import dataset_splits, folder_problem

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def field_help(recipe: str | None = None) -> str:
    """The ``launch --help`` listing; with a recipe, its values as the defaults (a recipe that
    does not load falls back to the built-in defaults, saying why)."""
    if recipe is None:
        return field_help_text()
    try:
        return field_help_text(load_config(recipe), f"recipe {recipe!r}")
    except ConfigError as exc:
        return f"(recipe {recipe!r} does not load, built-in defaults shown: {exc})\n" + \
            field_help_text()


def resolve_recipe(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" and p.exists():
        return p
    shipped = RECIPES_DIR / f"{name_or_path}.toml"
    if shipped.exists():
        return shipped
    known = sorted(q.stem for q in RECIPES_DIR.glob("*.toml"))
    what = "no such TOML file" if p.suffix == ".toml" or len(p.parts) > 1 else \
        "neither a TOML file nor a shipped recipe"
    raise ConfigError([f"recipe {name_or_path!r}: {what} (shipped: {', '.join(known)})"])


def load_config(recipe: str | None = None, overrides: list[str] | None = None,
                flags: dict[str, str] | None = None, *,
                problems_out: list[str] | None = None) -> Config:
    """Defaults < TOML recipe < flags < ``--set section.key=value`` overrides.

    Every problem (unknown keys, bad types, bad syntax) is collected and raised at once; with
    ``problems_out`` they are appended there instead and the config (bad values left at their
    defaults) is returned, so the caller can add the later checks' problems to the same error.
    """
    cfg = Config()
    problems: list[str] = []
    levels: dict[str, int] = {}  # data key -> 1 (recipe) or 2 (command line) where it was set
    if recipe:
        path = resolve_recipe(recipe)
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"{path}: {exc}"]) from exc
        for section, table in data.items():
            if not isinstance(table, dict):
                problems.append(f"{path}: top-level key {section!r} must be a [section]")
                continue
            for key, value in table.items():
                apply_value(cfg, section, key, value, f"{path.name}:{section}.{key}", problems)
                levels[f"{section}.{key}"] = 1
    table = flag_table()
    for flag, value in (flags or {}).items():
        if flag not in table:
            problems.append(f"unknown flag {flag}")
            continue
        sec, key = table[flag]
        apply_value(cfg, sec, key, value, flag, problems)
        levels[f"{sec}.{key}"] = 2
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            problems.append(f"--set {item!r}: expected section.key=value")
            continue
        lhs, rhs = item.split("=", 1)
        section, key = lhs.strip().split(".", 1)
        apply_value(cfg, section, key, rhs, f"--set {lhs}", problems)
        levels[f"{section}.{key}"] = 2
    resolve_dataset_folders(cfg, levels, problems)
    # a hub id found in the local Hugging Face cache stands for its snapshot folder; one not
    # there is left as given, and preflight says how to download it
    cfg.model.model_path = resolve_model_path(cfg.model.model_path)
    if problems_out is not None:
        problems_out.extend(problems)
    elif problems:
        raise ConfigError(problems)
    return cfg


def resolve_dataset_folders(cfg: Config, levels: dict[str, int], problems: list[str]) -> None:
    """A dataset folder (``train.txt`` + ``test.txt``, ``train_metadata.jsonl`` +
    ``test_metadata.jsonl``, ...) keeps its split: ``data.prompt_data`` becomes its train
    file, and ``data.eval_prompt_data`` its test file unless eval data was given at the same or
    a higher level than the folder (a recipe's placeholder eval path does not outrank a
    ``--prompt-data`` folder on the command line; an ``--eval-prompt-data`` does). The resolved
    config names the files, so a run directory's config.toml reproduces the run."""
    d = cfg.data
    train_level = levels.get("data.prompt_data", 0)
    eval_level = levels.get("data.eval_prompt_data", 0)
    for key in ("prompt_data", "eval_prompt_data"):
        value = getattr(d, key)
        if not isinstance(value, str) or not Path(value).is_dir():
            continue
        splits = dataset_splits(value)
        if splits is None:
            problems.append(f"data.{key}: {folder_problem(value)}")
            continue
        if key == "prompt_data":
            d.prompt_data = splits["train"]
            if eval_level < train_level:
                d.eval_prompt_data = splits["test"]
        else:
            d.eval_prompt_data = splits["test"]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON escapes are TOML escapes; no surrogates
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} to TOML")


def _has_none(v: Any) -> bool:
    if isinstance(v, dict):
        return any(_has_none(x) for x in v.values())
    if isinstance(v, list):
        return any(_has_none(x) for x in v)
    return v is None


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML; ``load_config`` of it gives back an equal Config.

    TOML has no null: a None whose default is None is omitted, one that overrides a non-None
    default is written as ``"none"`` (what ``--set key=none`` reads as None), and a table or
    list holding a None (e.g. ``sampling.sde_indices = null``) is written as a JSON string,
    which the loader parses for dict/list fields.
    """
    out = []
    defaults = Config().to_dict(unset="none")
    for section, table in cfg.to_dict(unset="none").items():
        out.append(f"[{section}]")
        for k, v in table.items():
            if v is None:
                if defaults[section][k] is not None:
                    out.append(f'{k} = "none"')
            elif isinstance(v, (dict, list)) and _has_none(v):
                out.append(f"{k} = {_toml_value(json.dumps(v))}")
            else:
                out.append(f"{k} = {_toml_value(v)}")
        out.append("")
    return "\n".join(out)


def write_resolved(cfg: Config, run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    path = run_dir / "config.toml"
    path.write_text(dump_toml(cfg))
    return path
