"""``prepare``: convert a public prompt source into the unified JSONL schema.

Converters (``--source``):

* ``pickapic``: Pick-a-Pic parquet shards (a file or a directory of them), ``caption``
  column. Only that column is read, so shards with embedded image bytes stream cheaply.
* ``prompts``: a generic prompt list: parquet with a ``prompt`` or ``caption`` column (or
  ``--prompt-column``), JSONL with a ``prompt`` field (its ``metadata``, ``images`` and
  ``videos`` are kept, every other top-level field goes into the metadata: GenEval's
  ``metadata.jsonl`` keeps its ``tag`` / ``include`` / ``exclude``; a missing task /
  sample_id is filled in), or plain text, one prompt per line (Flow-GRPO's ``.txt`` lists).
  JSONL and text files are read by the trainer's own reader (``trainer.data.prompt_files``),
  so a line it refuses here ``launch`` would refuse too, with the same message. Relative media
  paths (an editing record's source images) are rewritten relative to the output's folder, so
  they name the same files from there; inline ``data:`` images are copied as they are.

A Flow-GRPO dataset folder (``train.txt`` + ``test.txt``, or ``train_metadata.jsonl`` +
``test_metadata.jsonl``: ``prompt_files.SPLIT_LAYOUTS``) as ``--input`` keeps its split:
``--output`` is then a folder, and ``train.jsonl`` and ``test.jsonl`` are written into it (ids
``<prefix>train_<n>`` and ``<prefix>test_<n>``), a dataset folder ``--prompt-data`` takes as is.

Sample ids are ``<id-prefix><n:07d>`` with n the 1-based row (or line) number across the
input files in sorted order, counting skipped rows too, so an id always points back at its
source row and rerunning gives the same ids. Empty prompts are skipped and counted; anything
unreadable is reported with file and line and nothing is written.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator

from trainer.data.prompt_files import dataset_splits, iter_prompt_lines
from trainer.data.records import PARQUET_SUFFIXES, is_parquet, write_jsonl
from trainer.data.schema import MEDIA_PLACEHOLDERS, resolve_media

PROMPT_COLUMNS = ("prompt", "caption")
TEXT_SUFFIXES = (".txt", ".text", ".lst")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


class PrepareError(ValueError):
    """The input cannot be converted; the message lists every bad line."""


def _input_files(path: str, suffixes: tuple[str, ...]) -> list[str]:
    if os.path.isdir(path):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                       for name in names if name.lower().endswith(suffixes))
        if not files:
            raise PrepareError(f"{path}: no files ending in {', '.join(suffixes)}")
        return files
    if not os.path.isfile(path):
        raise PrepareError(f"{path}: no such file or directory")
    return [path]


def _parquet_column(path: str, wanted: str | None) -> Iterator[Any]:
    import pyarrow.parquet as pq  # local: only parquet sources need pyarrow (and its numpy)

    shard = pq.ParquetFile(path)
    names = shard.schema_arrow.names
    column = wanted or next((c for c in PROMPT_COLUMNS if c in names), None)
    if column not in names:
        raise PrepareError(f"{path}: no column {column or ' / '.join(PROMPT_COLUMNS)!r} "
                           f"(columns: {names})")
    for batch in shard.iter_batches(batch_size=8192, columns=[column]):
        yield from batch.column(0).to_pylist()


def _line_count(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _relocated(row: dict[str, Any], path: str, out_dir: str | None) -> dict[str, Any]:
    """The row with its relative media paths rewritten relative to ``out_dir`` (the folder the
    output is written to), so they still name the same files; absolute paths, URLs and inline
    ``data:`` images stay as written."""
    if out_dir is None:
        return row
    base = os.path.dirname(os.path.abspath(path))
    out = dict(row)
    for key in MEDIA_PLACEHOLDERS:
        if isinstance(row.get(key), list):
            out[key] = [entry if resolve_media(entry, base) == entry
                        else os.path.relpath(resolve_media(entry, base), out_dir)
                        for entry in row[key]]
    return out


def _text_rows(path: str, problems: list[str], out_dir: str | None = None
               ) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """(prompt, row) per source row; (None, {}) for a row that is skipped (blank, empty prompt,
    or bad: then its problem is recorded), so the row count, and so the ids, stay aligned.
    Relative media paths are rewritten relative to ``out_dir`` (``_relocated``)."""
    if is_parquet(path):
        for value in _parquet_column(path, None):
            yield value, {}
        return
    last = 0
    for line in iter_prompt_lines(path):
        yield from [(None, {})] * (line.line - last - 1)  # blank lines the reader skips
        last = max(last, line.line)
        row = line.row
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) \
                and not row["prompt"].strip():
            yield None, {}  # an empty prompt: skipped and counted, as in parquet sources
        elif line.problems:
            where = line.where if line.line else path
            problems.extend(f"{where}: {message}" for _, message in line.problems)
            yield None, {}
        else:
            yield row["prompt"], _relocated(row, path, out_dir)
    yield from [(None, {})] * max(0, _line_count(path) - last)


def _emit(rows: Iterator[tuple[Any, dict[str, Any]]], *, task: str, id_prefix: str,
          stats: dict[str, int]) -> Iterator[dict[str, Any]]:
    for number, (prompt, extra) in enumerate(rows, start=1):
        if not isinstance(prompt, str) or not prompt.strip():
            stats["skipped_empty"] += 1
            continue
        meta = dict(extra.get("metadata") or {})
        for key, value in extra.items():  # GenEval's tag / include / exclude, and the like
            if key not in ("prompt", "metadata", *MEDIA_PLACEHOLDERS):
                meta.setdefault(key, value)
        meta.setdefault("task", task)
        meta.setdefault("sample_id", f"{id_prefix}{number:07d}")
        record: dict[str, Any] = {"prompt": prompt.strip(), "metadata": meta}
        for key in MEDIA_PLACEHOLDERS:
            if key in extra:
                record[key] = extra[key]
        stats["written"] += 1
        yield record


def convert_pickapic(input_path: str, *, task: str, id_prefix: str | None,
                     prompt_column: str | None, stats: dict[str, int],
                     problems: list[str], out_dir: str | None = None
                     ) -> Iterator[dict[str, Any]]:
    files = _input_files(input_path, PARQUET_SUFFIXES)
    column = prompt_column or "caption"
    rows = ((value, {}) for path in files for value in _parquet_column(path, column))
    return _emit(rows, task=task, id_prefix="pickapic_" if id_prefix is None else id_prefix,
                 stats=stats)


def convert_prompts(input_path: str, *, task: str, id_prefix: str | None,
                    prompt_column: str | None, stats: dict[str, int],
                    problems: list[str], out_dir: str | None = None
                    ) -> Iterator[dict[str, Any]]:
    files = _input_files(input_path, PARQUET_SUFFIXES + JSONL_SUFFIXES + TEXT_SUFFIXES)
    if id_prefix is None:
        stem = os.path.basename(os.path.normpath(input_path))
        id_prefix = stem.split(".")[0] + "_"

    def rows() -> Iterator[tuple[Any, dict[str, Any]]]:
        for path in files:
            if prompt_column and is_parquet(path):
                yield from ((v, {}) for v in _parquet_column(path, prompt_column))
            else:
                yield from _text_rows(path, problems, out_dir)

    return _emit(rows(), task=task, id_prefix=id_prefix, stats=stats)


CONVERTERS: dict[str, Callable[..., Iterator[dict[str, Any]]]] = {
    "pickapic": convert_pickapic,
    "prompts": convert_prompts,
}


def prepare(*, source: str, input_path: str, output: str, task: str = "t2i",
            id_prefix: str | None = None, prompt_column: str | None = None) -> dict[str, int]:
    """Run a converter; returns counts. Raises PrepareError (nothing written) on bad input."""
    if source not in CONVERTERS:
        raise PrepareError(f"unknown source {source!r} (known: {', '.join(CONVERTERS)})")
    splits = dataset_splits(input_path) if os.path.isdir(input_path) else None
    if splits is not None and source == "prompts":
        return _prepare_split_folder(splits, input_path, output, task=task, id_prefix=id_prefix)
    return _prepare_one(source=source, input_path=input_path, output=output, task=task,
                        id_prefix=id_prefix, prompt_column=prompt_column)


def _prepare_split_folder(splits: dict[str, str], input_path: str, output: str, *, task: str,
                          id_prefix: str | None) -> dict[str, int]:
    """A dataset folder: each split converted on its own into ``<output>/<split>.jsonl``;
    both are checked before either is written."""
    if output.lower().endswith(JSONL_SUFFIXES) or os.path.isfile(output):
        raise PrepareError(f"{input_path} is a dataset folder ({', '.join(splits.values())}): "
                           f"--output must be a folder, where train.jsonl and test.jsonl are "
                           f"written (merging them would lose the split); got {output!r}")
    stem = os.path.basename(os.path.normpath(input_path)) + "_" if id_prefix is None \
        else id_prefix
    stats = {"written": 0, "skipped_empty": 0}
    converted, problems = {}, []
    for split, path in splits.items():
        part = {"written": 0, "skipped_empty": 0}
        converted[split] = list(convert_prompts(path, task=task, id_prefix=f"{stem}{split}_",
                                                prompt_column=None, stats=part,
                                                problems=problems,
                                                out_dir=os.path.abspath(output)))
        stats = {k: stats[k] + part[k] for k in stats}
    if problems:
        raise PrepareError(f"{len(problems)} problem(s) in {input_path}:\n  "
                           + "\n  ".join(problems))
    for split, records in converted.items():
        write_jsonl(os.path.join(output, f"{split}.jsonl"), records)
    return stats


def _prepare_one(*, source: str, input_path: str, output: str, task: str,
                 id_prefix: str | None, prompt_column: str | None) -> dict[str, int]:
    stats = {"written": 0, "skipped_empty": 0}
    problems: list[str] = []
    records = list(CONVERTERS[source](input_path, task=task, id_prefix=id_prefix,
                                      prompt_column=prompt_column, stats=stats,
                                      problems=problems,
                                      out_dir=os.path.dirname(os.path.abspath(output))))
    ids: dict[str, int] = {}
    for index, record in enumerate(records):
        sample_id = record["metadata"]["sample_id"]
        if sample_id in ids:
            problems.append(f"sample_id {sample_id!r} appears in records {ids[sample_id] + 1} "
                            f"and {index + 1} of the output")
        ids.setdefault(sample_id, index)
    if problems:
        raise PrepareError(f"{len(problems)} problem(s) in {input_path}:\n  "
                           + "\n  ".join(problems))
    write_jsonl(output, records)
    return stats
