"""Applying one config value: coercion to the field's type, nested ``--set`` into tables, the global batch size
that follows its factors, and the ``--help`` listing. Torch-free, like ``trainer.config``.

* ``--set rollout.sampling.height=512`` / ``--set reward.scorers.ocr.weight=0.5``: one entry
  inside a dict-typed key (the value read as JSON, else kept as a string), the rest of the
  table kept.
* ``rollout.global_batch_size`` is the product of ``rollout_batch_size`` and
  ``n_samples_per_prompt``. A recipe states it for its own factors, so when the command line
  changes a factor but does not state the product, the product is re-derived (``--rollout-
  batch-size 4`` on ``tiny`` just works); stated on the command line, it is kept and preflight
  checks it. Order on the command line does not matter.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from trainer.config.sections import (Config, _field_types, _sections, _type_name, cli_flag,
                                     is_table, plain, store)

_FACTORS = ("rollout_batch_size", "n_samples_per_prompt")
_STATED = "_global_batch_size_on_command_line"  # attribute on the Config instance, not a field


def apply_nested(cfg, section: str, dotted: str, value: Any, where: str,
                 problems: list[str]) -> None:
    key, *path = dotted.split(".")
    secs = _sections()
    if section not in secs or key not in {f.name for f in dataclasses.fields(secs[section])}:
        apply_value(cfg, section, key, None, where, problems)  # names the unknown section / key
        return
    if not is_table(_field_types(secs[section])[key]):
        problems.append(f"{where}: {section}.{key} is not a table; nested keys need one")
        return
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass  # a plain string value
    root = json.loads(json.dumps(plain(getattr(getattr(cfg, section), key)) or {}))
    node = root
    for part in path[:-1]:
        if not isinstance(node.get(part, {}), dict):
            problems.append(f"{where}: {part!r} holds {node[part]!r}, not a table")
            return
        node = node.setdefault(part, {})
    node[path[-1]] = value
    store(cfg, section, key, root, where, problems)


def follow_batch_factors(cfg, key: str) -> None:
    """Called after the command line sets ``rollout.<key>`` (see the module docstring)."""
    r = cfg.rollout
    if key == "global_batch_size":
        object.__setattr__(cfg, _STATED, r.global_batch_size is not None)
    elif key in _FACTORS and not getattr(cfg, _STATED, False) and \
            r.global_batch_size is not None and isinstance(r.rollout_batch_size, int) and \
            isinstance(r.n_samples_per_prompt, int):
        r.global_batch_size = r.rollout_batch_size * r.n_samples_per_prompt


def default_text(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return value_text(value)


def value_text(value: Any) -> str:
    return repr(value) if value is None or isinstance(value, str) else json.dumps(plain(value))


PROMPT_FORMATS = """Prompt data (--prompt-data, --eval-prompt-data), by suffix:
  .jsonl / .json / .ndjson  one object a line: a string "prompt", an optional "metadata"
                            object; other fields (GenEval's tag / include / exclude) go into the
                            metadata the rewards get; task and sample_id filled in if absent
  .parquet / .pq            the same fields as columns
  .txt / .text / .lst       one prompt a line (Flow-GRPO's prompt lists), blank lines skipped
  a dataset folder          train.txt + test.txt (Flow-GRPO's dataset/ocr, dataset/pickscore),
                            or train_metadata.jsonl + test_metadata.jsonl (dataset/geneval),
                            or train.jsonl + test.jsonl: trains on the train file and evaluates
                            on the test file unless --eval-prompt-data is given
  toy:train / toy:eval      the toy world's prompts
Check a file before a run: python -m trainer data inspect --train FILE_OR_FOLDER"""


def field_help_text(cfg: Config | None = None, source: str | None = None) -> str:
    """Every key with its type, default, flag (and its short alias) and meaning; with ``cfg``
    (a recipe's config), its values stand as the defaults, marked where the recipe changes one."""
    lines = ["Any key also takes --set section.key=value; tables take nested keys "
             "(--set rollout.sampling.height=512, --set reward.scorers.ocr.weight=0.5)."]
    if cfg is not None:
        lines.append(f"Defaults are {source or 'the recipe'}'s values; '(recipe)' marks those "
                     f"it changes from the built-in default.")
    for sec, cls in _sections().items():
        lines.append(f"[{sec}]")
        hints = _field_types(cls)
        for f in dataclasses.fields(cls):
            flag, alias = cli_flag(sec, f.name), f.metadata["flag"]
            flags = flag if alias == flag else f"{flag} (alias {alias})"
            default = default_text(f)
            if cfg is not None:
                default = value_text(getattr(getattr(cfg, sec), f.name))
            if len(default) > 60:
                default = default[:57] + "..."
            mark = "  (recipe)" if cfg is not None and default_text(f) != value_text(
                getattr(getattr(cfg, sec), f.name)) else ""
            lines.append(f"  {sec}.{f.name}: {_type_name(hints[f.name])} = {default}{mark}")
            lines.append(f"      {flags}  {f.metadata['doc']}")
    return "\n".join(lines) + "\n\n" + PROMPT_FORMATS


def _coerce(value: Any, typ: Any, where: str, problems: list[str]) -> Any:
    """Coerce a TOML or CLI value to the field's annotated type."""
    t = _type_name(typ)
    if t == "int | str" and isinstance(value, str):  # an integer or "auto" (micro-batch)
        text = value.strip()
        if re.fullmatch(r"-?\d+", text):
            return int(text)
        if text != "auto":
            problems.append(f"{where}: expected an integer or 'auto', got {value!r}")
        return text
    if isinstance(value, str) and "None" in t and value.strip().lower() in ("none", "null"):
        return None  # also for str | None: how --set and dump_toml spell "unset"
    if isinstance(value, str) and not t.startswith("str"):
        text = value.strip()
        if t.startswith("bool"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            problems.append(f"{where}: expected a boolean, got {value!r}")
            return value
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            if t.startswith(("dict", "list", "int", "float")):
                problems.append(f"{where}: cannot parse {value!r} as {t}")
            return value
    if value is None:
        if "None" not in t:
            problems.append(f"{where}: may not be null")
        return value
    if t.startswith("bool") and not isinstance(value, bool):
        problems.append(f"{where}: expected a boolean, got {value!r}")
    elif t.startswith("int") and (isinstance(value, bool) or not isinstance(value, int)):
        problems.append(f"{where}: expected an integer, got {value!r}")
    elif t.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: expected a number, got {value!r}")
        else:
            value = float(value)
    elif t.startswith("dict") and not isinstance(value, dict):
        problems.append(f"{where}: expected a table/dict, got {value!r}")
    elif t.startswith("list") and not isinstance(value, list):
        problems.append(f"{where}: expected a list, got {value!r}")
    elif t.startswith("str") and not isinstance(value, str):
        problems.append(f"{where}: expected a string, got {value!r}")
    return value


def apply_value(cfg: Config, section: str, key: str, value: Any, where: str,
           problems: list[str]) -> None:
    secs = _sections()
    if "." in key:  # --set section.table.a.b=value
        return apply_nested(cfg, section, key, value, where, problems)
    if section not in secs:
        problems.append(f"{where}: unknown section [{section}] (known: {', '.join(secs)})")
        return
    fields = {f.name: f for f in dataclasses.fields(secs[section])}
    if key not in fields:
        problems.append(f"{where}: unknown key {section}.{key}")
        return
    hints = _field_types(secs[section])
    before = len(problems)
    value = _coerce(value, hints[key], where, problems)
    if len(problems) > before:
        return  # a badly typed value is reported, never applied: later checks see the default
    store(cfg, section, key, value, where, problems)  # a typed table: keys over keys
    if where.startswith("--") and section == "rollout":  # flags and --set, not the TOML
        follow_batch_factors(cfg, key)
