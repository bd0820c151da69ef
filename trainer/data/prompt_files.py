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

A record is ``{"prompt": str, "metadata": {...}}``, plus ``"images": [entry, ...]`` when the
line names reference images (an editing record: entries are absolute paths or inline
``data:`` URIs, ``trainer.media.conditioning_images`` turns them into ``ImageRef``s; their
decoding is checked by preflight and ``data inspect``, not here); ``task`` and
``sample_id`` are filled in (``<file stem>_<i:07d>``, i the record's 0-based position, as
before) when absent. A line is refused when its prompt is not a non-empty string, its
metadata not an object, its task not a known one, its sample_id not a non-empty string, or
its ``<image>`` / ``<video>`` placeholders (optional; when written, one per entry) do not
match its media lists: each problem carries the class ``data inspect``
reports it under.

A Flow-GRPO dataset folder (``dataset/ocr`` with ``train.txt`` and ``test.txt``,
``dataset/geneval`` with ``train_metadata.jsonl`` and ``test_metadata.jsonl``; also
``train.jsonl`` / ``test.jsonl`` or ``.parquet``, what ``data prepare`` writes from such a
folder) is a pair of prompt files: ``dataset_splits`` names them, and the config loader
points ``data.prompt_data`` at the train file and ``data.eval_prompt_data`` at the test file.

This module is THE reader: the trainer (``trainer.prompts``), preflight, ``data inspect`` and
``data prepare`` all read prompt files through ``iter_prompt_lines``, so a file one of them
accepts the others accept too.

Text and JSONL files are read as bytes and decoded line by line, so a line that is not UTF-8
is named ``file:line`` (with the byte's column) like every other bad line, and the rest of the
file is still checked.

Memory: every rank holds the training prompts. ``open_prompt_file`` (what the loop uses)
checks a text or JSONL file in one streaming pass and keeps only each record's line number
and byte offset (16 bytes a record); a record is parsed again when it is read, which a rollout
does for a few groups. Holding every record as dicts cost an order of magnitude more than the
file itself. Parquet files (row groups, not lines) are still read whole. A file edited after
the pass is read as it is then; a line that no longer parses raises ``PromptFileError``
naming it.
"""
from __future__ import annotations

import json
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from trainer.data.records import is_parquet, read_lines
from trainer.data.schema import (MEDIA_PLACEHOLDERS, TASKS, normalize_prompt,
                                 placeholder_mismatch, resolve_media)

TEXT_SUFFIXES = (".txt", ".text", ".lst")
# Dataset folders, in the order they are looked for: (train file, test file).
SPLIT_LAYOUTS: tuple[tuple[str, str], ...] = (
    ("train.txt", "test.txt"),                       # Flow-GRPO's ocr, pickscore, drawbench
    ("train_metadata.jsonl", "test_metadata.jsonl"),  # Flow-GRPO's geneval
    ("train.jsonl", "test.jsonl"),                   # data prepare's output for a folder
    ("train.parquet", "test.parquet"),
)
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


@dataclass
class PromptLine:
    """One line (or parquet row) of a prompt file as the trainer reads it.

    ``record`` is ``{"prompt", "metadata"}`` with ``task`` / ``sample_id`` filled in, or None
    when the line cannot be used; ``problems`` are ``(class, message)`` pairs, the classes of
    ``data inspect`` (parse, schema, task, placeholder); ``row`` is the parsed line as written
    (its media lists included); ``id_given`` says whether the file named the sample_id.
    """

    path: str
    line: int
    record: dict | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)
    row: Any = None
    id_given: bool = False
    offset: int = -1  # the line's byte offset in a text or JSONL file (-1: parquet)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _row_problems(row: Any) -> list[tuple[str, str]]:
    """What stops a parsed row from being a training record (empty when it is one)."""
    if not isinstance(row, dict):
        return [("schema", f"a record must be a JSON object, got {type(row).__name__}")]
    problems = []
    prompt = row.get("prompt")
    if "prompt" not in row:
        problems.append(("schema", "missing required key 'prompt'"))
    elif not isinstance(prompt, str) or not prompt.strip():
        problems.append(("schema", f"'prompt' must be a non-empty string, got {cut(prompt)}"))
    meta = row.get("metadata") if row.get("metadata") is not None else {}
    if not isinstance(meta, dict):
        return problems + [("schema", f"'metadata' must be an object, got {cut(meta)}")]
    task, sample_id = meta.get("task", TASKS[0]), meta.get("sample_id", "filled")
    if task not in TASKS:
        problems.append(("task", f"unknown task {task!r} (known: {', '.join(TASKS)})"))
    if not isinstance(sample_id, str) or not sample_id.strip():
        problems.append(("schema", f"'metadata.sample_id' must be a non-empty string, got "
                                   f"{cut(sample_id)}"))
    for key, placeholder in MEDIA_PLACEHOLDERS.items():
        paths = row.get(key, [])
        if not isinstance(paths, list) or not all(isinstance(q, str) and q for q in paths):
            problems.append(("schema", f"'{key}' must be a list of paths"))
        elif isinstance(prompt, str) and placeholder_mismatch(prompt, placeholder, paths):
            problems.append(("placeholder", f"{prompt.count(placeholder)} {placeholder} "
                             f"placeholder(s) in the prompt but {len(paths)} "
                             f"entr{'y' if len(paths) == 1 else 'ies'} in '{key}'"))
    return problems


def _record(row: dict, base_dir: str) -> dict:
    meta = dict(row.get("metadata") or {})
    for key, value in row.items():  # GenEval's tag / include / exclude, and the like
        if key not in ("prompt", "metadata", *MEDIA_PLACEHOLDERS):
            meta.setdefault(key, value)
    record = {"prompt": row["prompt"], "metadata": meta}
    if row.get("images"):  # an editing record: its references, absolute (trainer.media)
        record["images"] = [resolve_media(entry, base_dir) for entry in row["images"]]
    return record


def _parse_raw(raw: bytes, path: str, number: int, offset: int, text: bool
               ) -> PromptLine | None:
    """One line of a text or JSONL file as read (None for a blank line), before its checks."""
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return PromptLine(path, number, offset=offset, problems=[(
            "parse", f"not UTF-8 text ({exc.reason}: byte {raw[exc.start]:#04x} at column "
                     f"{exc.start + 1})")])
    if not decoded.strip():
        return None
    if text:
        return PromptLine(path, number, offset=offset, row={"prompt": decoded.strip()})
    try:
        return PromptLine(path, number, offset=offset, row=json.loads(decoded))
    except json.JSONDecodeError as exc:
        return PromptLine(path, number, offset=offset, problems=[(
            "parse", f"invalid JSON ({exc.msg} at column {exc.colno})")])


def _raw_lines(path: str) -> Iterator[PromptLine]:
    if is_parquet(path):
        for line in read_lines(path):
            yield PromptLine(path, line.line, row=line.record,
                             problems=[("parse", line.error)] if line.error else [])
        return
    text, offset = path.lower().endswith(TEXT_SUFFIXES), 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _parse_raw(raw, path, number, offset, text)
            offset += len(raw)
            if line is not None:
                yield line


def _checked(line: PromptLine, stem: str, index: int) -> PromptLine:
    """``line`` with its row's problems, or its record (task and sample_id filled in)."""
    if line.problems:
        return line
    line.problems = _row_problems(line.row)
    if not line.problems:
        line.record = _record(line.row, os.path.dirname(os.path.abspath(line.path)))
        meta = line.record["metadata"]
        line.id_given = "sample_id" in meta
        meta.setdefault("task", TASKS[0])
        meta.setdefault("sample_id", f"{stem}_{index:07d}")
    return line


def iter_prompt_lines(path: str | Path) -> Iterator[PromptLine]:
    """Every line of a prompt file (``.txt`` list, JSONL, parquet), checked and normalised;
    bad lines come back with their problems instead of stopping the read. Raises OSError (and
    pyarrow's errors for a damaged parquet file) for a file that cannot be read at all."""
    path, index = str(path), 0
    stem, base_dir = Path(path).stem, os.path.dirname(os.path.abspath(path))
    for line in _raw_lines(path):
        line = _checked(line, stem, index)
        index += line.record is not None
        yield line


def read_prompt_file(path: str | Path) -> list[dict]:
    """Every record of a prompt file; raises PromptFileError naming every bad line, or the
    file when it is missing, unreadable or holds no prompt at all."""
    return [record for _, record in read_numbered(path)]


def read_numbered(path: str | Path) -> list[tuple[str, dict]]:
    """``read_prompt_file`` with each record's ``file:line``."""
    return [(line.where, line.record) for line in _good_lines(str(path))]


def _good_lines(path: str) -> Iterator[PromptLine]:
    """The usable lines of a prompt file, streamed; once the file is read, raises one
    PromptFileError naming every bad line, or the file when it is missing, unreadable or holds
    no prompt at all."""
    problems: list[str] = []
    good = 0
    try:
        for line in iter_prompt_lines(path):
            where = path if line.line == 0 else line.where
            problems += [f"{where}: {message}" for _, message in line.problems]
            if line.record is not None:
                good += 1
                yield line
    except OSError as exc:
        raise PromptFileError([f"{path}: cannot read it ({type(exc).__name__}: {exc})"]) \
            from None
    except Exception as exc:  # a damaged parquet file: pyarrow's own errors
        if not is_parquet(path):
            raise
        raise PromptFileError([f"{path}: not a readable parquet file ({cut(str(exc), 200)})"]) \
            from None
    if not good and not problems:
        problems.append(f"{path}: holds no prompt (empty file, or only blank lines)")
    if problems:
        raise PromptFileError(problems)


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
        number, offset = self._lines[index], self._offsets[index]
        with open(self.path, "rb") as f:
            f.seek(offset)
            raw = f.readline()
        line = _parse_raw(raw, self.path, number, offset, self._text)
        if line is None:
            raise PromptFileError([f"{self.path}:{number}: the line is blank now (the file "
                                   f"changed after it was checked)"])
        line = _checked(line, self._stem, index)
        if line.record is None:
            raise PromptFileError([f"{line.where}: {message}" for _, message in line.problems])
        return line.record


def open_prompt_file(path: str | Path) -> Sequence[dict]:
    """The records of a prompt file for training: checked in one pass (``PromptFileError``
    naming every bad line), held as line offsets (``PromptRecords``); parquet as a list."""
    path = str(path)
    if is_parquet(path):
        return read_prompt_file(path)
    lines, offsets = array("q"), array("q")
    for line in _good_lines(path):
        lines.append(line.line)
        offsets.append(line.offset)
    return PromptRecords(path, lines, offsets)


def dataset_splits(folder: str | Path) -> dict[str, str] | None:
    """``{"train": file, "test": file}`` of a dataset folder (``SPLIT_LAYOUTS``), else None."""
    folder = Path(folder)
    for train, test in SPLIT_LAYOUTS:
        if (folder / train).is_file() and (folder / test).is_file():
            return {"train": str(folder / train), "test": str(folder / test)}
    return None


def split_layouts_text() -> str:
    return " or ".join(f"{a} + {b}" for a, b in SPLIT_LAYOUTS)


def folder_problem(folder: str | Path) -> str | None:
    """Why a folder given as prompt data is not a dataset folder (None when it is one)."""
    if dataset_splits(folder) is not None:
        return None
    present = sorted(os.listdir(folder))[:8]
    return (f"{folder} is a folder but not a dataset folder: it needs {split_layouts_text()} "
            f"(it holds {present or 'nothing'})")


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
