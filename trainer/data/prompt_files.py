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

Text files are read as bytes and decoded line by line, so a line that is not UTF-8 is named
``file:line`` (with the byte's column), like every other bad line, and the rest of the file
is still checked.

Memory: every rank holds the training prompts. ``open_prompt_file`` (what the loop uses)
validates JSONL and text files in one streaming pass and keeps only each record's byte offset
and line number (16 bytes a record); a record is parsed again when it is read, which a rollout
does for a few groups. Holding every record as dicts cost an order of magnitude more than the
file itself. Parquet files (row groups, not lines) are still read whole. A file edited after
the pass is read as it is then; a line that no longer parses raises ``PromptFileError`` naming
it.
"""
from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterator, Sequence
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


def _scan(path: str, problems: list[str]) -> Iterator[tuple[int, int, dict]]:
    """(line number, byte offset, record) of every good record of a text or JSONL file; each
    bad line goes to ``problems`` as ``file:line``."""
    text = path.lower().endswith(TEXT_SUFFIXES)
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            record = _parse_line(raw, path, number, text, problems)
            if record is not None:
                yield number, start, record


def _parse_line(raw: bytes, path: str, number: int, text: bool,
                problems: list[str]) -> dict | None:
    where = f"{path}:{number}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        problems.append(f"{where}: not UTF-8 text ({exc.reason}: byte {raw[exc.start]:#04x} at "
                        f"column {exc.start + 1})")
        return None
    if not line.strip():
        return None
    if text:
        return {"prompt": line.strip(), "metadata": {}}
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        problems.append(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})")
        return None
    return _from_row(row, where, problems)


def _fill_defaults(record: dict, stem: str, index: int) -> dict:
    record["metadata"].setdefault("task", "t2i")
    record["metadata"].setdefault("sample_id", f"{stem}_{index:07d}")
    return record


def _collect(path: str, sink: Callable[[int, int, dict], None]) -> None:
    """Hand every good record (line, byte offset or -1 for parquet, record) to ``sink``;
    raise one PromptFileError naming every bad line, or the file when it cannot be read or
    holds no prompt."""
    problems: list[str] = []
    count = 0
    try:
        if is_parquet(path):
            for line in read_lines(path):
                if line.error is not None:
                    problems.append(f"{line.where}: {line.error}")
                    continue
                record = _from_row(line.record, line.where, problems)
                if record is not None:
                    sink(line.line, -1, record)
                    count += 1
        else:
            for number, offset, record in _scan(path, problems):
                sink(number, offset, record)
                count += 1
    except OSError as exc:
        raise PromptFileError([f"{path}: cannot read it ({type(exc).__name__}: {exc})"]) \
            from None
    except Exception as exc:  # a damaged parquet file: pyarrow's own errors
        if not is_parquet(path):
            raise
        raise PromptFileError([f"{path}: not a readable parquet file ({cut(str(exc), 200)})"]) \
            from None
    if not count and not problems:
        problems.append(f"{path}: holds no prompt (empty file, or only blank lines)")
    if problems:
        raise PromptFileError(problems)


def read_prompt_file(path: str | Path) -> list[dict]:
    """Every record of a prompt file; raises PromptFileError naming every bad line, or the
    file when it is missing, unreadable or holds no prompt at all."""
    return [record for _, record in read_numbered(path)]


def read_numbered(path: str | Path) -> list[tuple[str, dict]]:
    """``read_prompt_file`` with each record's ``file:line``."""
    path, stem = str(path), Path(path).stem
    out: list[tuple[str, dict]] = []
    _collect(path, lambda number, _, record: out.append(
        (f"{path}:{number}", _fill_defaults(record, stem, len(out)))))
    return out


class PromptRecords(Sequence):
    """The records of a text or JSONL prompt file, parsed from the file when read (see the
    module docstring); an index gives a fresh record, a slice a list of them."""

    def __init__(self, path: str, lines: array, offsets: array) -> None:
        self.path, self._lines, self._offsets = path, lines, offsets
        self._stem = Path(path).stem
        self._text = path.lower().endswith(TEXT_SUFFIXES)

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # negative indices; IndexError past the end
        with open(self.path, "rb") as f:
            f.seek(self._offsets[index])
            raw = f.readline()
        problems: list[str] = []
        record = _parse_line(raw, self.path, self._lines[index], self._text, problems)
        if record is None:
            raise PromptFileError(problems or [f"{self.path}:{self._lines[index]}: the line "
                                               f"is blank now (the file changed after it was "
                                               f"checked)"])
        return _fill_defaults(record, self._stem, index)


def open_prompt_file(path: str | Path) -> Sequence[dict]:
    """The records of a prompt file for training: checked in one pass (``PromptFileError``
    naming every bad line), held as line offsets (``PromptRecords``); parquet as a list."""
    path = str(path)
    if is_parquet(path):
        return read_prompt_file(path)
    lines, offsets = array("q"), array("q")

    def keep_offset(number: int, offset: int, _record: dict) -> None:
        lines.append(number)
        offsets.append(offset)

    _collect(path, keep_offset)
    return PromptRecords(path, lines, offsets)


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
