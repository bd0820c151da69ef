"""Prompt files as ``--prompt-data`` / ``--eval-prompt-data`` take them, read in one pass that
reports every bad line as ``file:line`` (standard library only: preflight parses them before
anything heavy loads).

Formats, by suffix:

* ``.txt`` (also ``.text``, ``.lst``): one prompt per line, blank lines skipped (Flow-GRPO's
  prompt lists).
* ``.jsonl`` (also ``.json``, ``.ndjson``): one object per line with a string ``prompt``; an
  optional ``metadata`` object; every other top-level field except the media lists
  (``images``, ``videos``) is kept in the record's metadata, so GenEval's ``metadata.jsonl``
  (``tag``, ``include``, ``exclude``) reaches the reward functions unchanged.
* parquet (``.parquet``, ``.pq``): the same fields as columns.

A record is ``{"prompt": str, "metadata": {...}}``; ``task`` and ``sample_id`` are filled in
(``<file stem>_<i:07d>``, i the record's 0-based position, as before) when absent.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.data.records import is_parquet, read_lines
from trainer.data.schema import MEDIA_PLACEHOLDERS, normalize_prompt

TEXT_SUFFIXES = (".txt", ".text", ".lst")
MAX_REPORTED = 20  # problems listed in one error; the rest are counted
_CUT = 80


class PromptFileError(ValueError):
    """A prompt file cannot be used; the message lists its bad lines (``file:line``)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        shown = self.problems[:MAX_REPORTED]
        more = len(self.problems) - len(shown)
        super().__init__("bad prompt data:\n  - " + "\n  - ".join(shown)
                         + (f"\n  - ... and {more} more" if more > 0 else ""))


def cut(value: Any, limit: int = _CUT) -> str:
    """``repr(value)`` cut to ``limit`` characters, saying how long it was."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def _from_row(row: Any, where: str, problems: list[str]) -> dict | None:
    if not isinstance(row, dict):
        problems.append(f"{where}: a record must be a JSON object, got {type(row).__name__}")
        return None
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        problems.append(f"{where}: no non-empty string 'prompt' (got {cut(prompt)})")
        return None
    meta = row.get("metadata") if row.get("metadata") is not None else {}
    if not isinstance(meta, dict):
        problems.append(f"{where}: 'metadata' must be an object, got {cut(meta)}")
        return None
    meta = dict(meta)
    for key, value in row.items():  # GenEval's tag / include / exclude, and the like
        if key not in ("prompt", "metadata", *MEDIA_PLACEHOLDERS):
            meta.setdefault(key, value)
    return {"prompt": prompt, "metadata": meta}


def _read_text(path: str, problems: list[str]) -> list[tuple[int, dict]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, text in enumerate(f, start=1):
                if text.strip():
                    out.append((number, {"prompt": text.strip(), "metadata": {}}))
    except UnicodeDecodeError as exc:
        problems.append(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})")
    return out


def read_prompt_file(path: str | Path) -> list[dict]:
    """Every record of a prompt file; raises PromptFileError naming every bad line, or the
    file when it is missing, unreadable or holds no prompt at all."""
    return [record for _, record in read_numbered(path)]


def read_numbered(path: str | Path) -> list[tuple[str, dict]]:
    """``read_prompt_file`` with each record's ``file:line``."""
    path = str(path)
    problems: list[str] = []
    numbered: list[tuple[int, dict]] = []
    try:
        if path.lower().endswith(TEXT_SUFFIXES):
            numbered = _read_text(path, problems)
        else:
            for line in read_lines(path):
                if line.error is not None:
                    problems.append(f"{line.where}: {line.error}")
                    continue
                record = _from_row(line.record, line.where, problems)
                if record is not None:
                    numbered.append((line.line, record))
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError([f"{path}: cannot read it ({type(exc).__name__}: {exc})"]) \
            from None
    except Exception as exc:  # a damaged parquet file: pyarrow's own errors
        if not is_parquet(path):
            raise
        raise PromptFileError([f"{path}: not a readable parquet file ({cut(str(exc), 200)})"]) \
            from None
    if not numbered and not problems:
        problems.append(f"{path}: holds no prompt (empty file, or only blank lines)")
    if problems:
        raise PromptFileError(problems)
    stem = Path(path).stem
    for index, (_, record) in enumerate(numbered):
        record["metadata"].setdefault("task", "t2i")
        record["metadata"].setdefault("sample_id", f"{stem}_{index:07d}")
    return [(f"{path}:{number}", record) for number, record in numbered]


def overlap_problems(train: list[tuple[str, dict]], evals: list[tuple[str, dict]]
                     ) -> list[str]:
    """Eval prompts that are also training prompts (whitespace-insensitive), as one problem;
    both lists as ``read_numbered`` gives them."""
    seen = {normalize_prompt(r["prompt"]): where for where, r in train}
    shared = [(where, r, seen[normalize_prompt(r["prompt"])]) for where, r in evals
              if normalize_prompt(r["prompt"]) in seen]
    if not shared:
        return []
    examples = "; ".join(f"{cut(r['prompt'], 60)} at {where} = {train_where}"
                         for where, r, train_where in shared[:3])
    return [f"{len(shared)} of the {len(evals)} eval prompts are also training prompts, so "
            f"eval would not measure held-out prompts (split them with `python -m trainer "
            f"data curate`): {examples}"]
