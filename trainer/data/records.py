"""Reading and writing record files: JSONL (one object per line) and parquet (one per row).

Reading never stops at the first bad line: every line comes back with its location, and
either the parsed object or the reason it could not be parsed, so tools can report all of
them at once. Writing is atomic (``.tmp`` -> fsync -> rename) and byte-deterministic.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from trainer.media import inline_entry

PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class Line:
    """One input line: ``path:line`` (1-based; the row number for parquet)."""

    path: str
    line: int
    record: Any = None
    error: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def is_parquet(path: str) -> bool:
    return path.lower().endswith(PARQUET_SUFFIXES)


def read_lines(path: str) -> Iterator[Line]:
    """Every record of a JSONL or parquet file; blank JSONL lines are skipped."""
    if is_parquet(path):
        yield from _read_parquet(path)
        return
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield Line(path, number, json.loads(text))
            except json.JSONDecodeError as exc:
                yield Line(path, number, error=f"invalid JSON ({exc.msg} at column {exc.colno})")


def _read_parquet(path: str) -> Iterator[Line]:
    # local: preflight reads prompt files through this module and stays numpy-free for JSONL
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            meta = row.get("metadata")
            if isinstance(meta, str):  # metadata stored as a JSON string column
                try:
                    row["metadata"] = json.loads(meta)
                except json.JSONDecodeError as exc:
                    yield Line(path, number, error=f"'metadata' is not valid JSON ({exc.msg})")
                    continue
            images = row.get("images")
            if isinstance(images, list) and any(isinstance(v, bytes) for v in images):
                # a binary image column: the bytes inline, as a JSONL line writes them
                row["images"] = [inline_entry(v) if isinstance(v, bytes) else v for v in images]
            yield Line(path, number, {k: v for k, v in row.items() if v is not None})


def dumps(record: dict[str, Any]) -> str:
    """One JSONL line: UTF-8 as is, key order as built (prompt, metadata, media)."""
    return json.dumps(record, ensure_ascii=False)


def write_jsonl(path: str, records: Iterable[dict[str, Any]]) -> int:
    """Write atomically; returns the number of records."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    count = 0
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(dumps(record) + "\n")
            count += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return count
