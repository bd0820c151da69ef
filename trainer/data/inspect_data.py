"""``inspect``: check record files before a run ever touches a GPU.

Error classes, each reported as ``file:line: [class] message``:

* ``parse``: a line that is not JSON (or a parquet row whose metadata is not).
* ``schema``: required keys missing or mistyped (prompt, metadata.task, metadata.sample_id,
  media lists).
* ``task``: metadata.task is not a known generation task.
* ``placeholder``: the count of <image> / <video> placeholders differs from the media list.
* ``media``: a referenced local media file does not exist.
* ``decode``: (with ``decode_media``) a media file exists but does not decode.
* ``duplicate_id``: a sample_id repeated inside one file.
* ``leak``: an eval record whose sample_id or content (prompt + media) is also in train.

Exit status is non-zero when there is any error. Duplicate prompts inside one file are
counted but are not an error (raw converter output has them; curate removes them).
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from PIL import Image

from trainer.data.records import Line, read_lines
from trainer.data.schema import (IMAGE_SUFFIXES, TASKS, content_hash, is_url, media_entries,
                                 record_problems, resolve_media)

ERROR_CLASSES = ("parse", "schema", "task", "placeholder", "media", "decode", "duplicate_id",
                 "leak")


@dataclass
class Finding:
    where: str
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: [{self.kind}] {self.message}"


def _classify(problem: str) -> str:
    if problem.startswith("unknown task"):
        return "task"
    if "placeholder" in problem:
        return "placeholder"
    return "schema"


def _decode_problem(path: str) -> str | None:
    """None when the file decodes; otherwise why not."""
    if path.lower().endswith(IMAGE_SUFFIXES):
        try:
            with Image.open(path) as image:
                image.load()
        except Exception as exc:  # PIL raises many types for corrupt data
            return f"cannot decode image {path}: {exc}"
        return None
    try:
        import av  # optional: PyAV, the decoder behind torchvision and imageio's ffmpeg plugin
    except ImportError:
        return f"cannot decode {path}: no video decoder installed (pip install av)"
    try:
        with av.open(path) as container:
            next(container.decode(video=0))
    except Exception as exc:  # av raises its own error hierarchy
        return f"cannot decode video {path}: {exc}"
    return None


def _scan(path: str, decode_media: bool, findings: list[Finding], stats: Counter
          ) -> tuple[dict[str, str], dict[str, str]]:
    """Check one file; returns {sample_id: where} and {content hash: where} of its records."""
    ids: dict[str, str] = {}
    contents: dict[str, str] = {}
    base = os.path.dirname(os.path.abspath(path))
    for line in read_lines(path):
        stats["records"] += 1
        if line.error:
            findings.append(Finding(line.where, "parse", line.error))
            continue
        problems = record_problems(line.record)
        findings.extend(Finding(line.where, _classify(p), p) for p in problems)
        if not isinstance(line.record, dict):
            continue
        _check_media(line, base, decode_media, findings, stats)
        meta = line.record.get("metadata")
        sample_id = meta.get("sample_id") if isinstance(meta, dict) else None
        if isinstance(sample_id, str) and sample_id:
            if sample_id in ids:
                findings.append(Finding(line.where, "duplicate_id",
                                        f"sample_id {sample_id!r} already at {ids[sample_id]}"))
            else:
                ids[sample_id] = line.where
        prompt = line.record.get("prompt")
        if isinstance(prompt, str):
            digest = content_hash(prompt, [resolve_media(p, base)
                                           for _, p in media_entries(line.record)])
            if digest in contents:
                stats["duplicate_prompts"] += 1
            else:
                contents[digest] = line.where
    return ids, contents


def _check_media(line: Line, base: str, decode_media: bool, findings: list[Finding],
                 stats: Counter) -> None:
    for key, entry in media_entries(line.record):
        if is_url(entry):
            continue
        path = resolve_media(entry, base)
        stats["media"] += 1
        if not os.path.isfile(path):
            findings.append(Finding(line.where, "media", f"{key} entry {entry!r}: no file {path}"))
        elif decode_media:
            problem = _decode_problem(path)
            if problem:
                findings.append(Finding(line.where, "decode", problem))


def inspect_files(*, train: str | None, evals: Sequence[str] = (), decode_media: bool = False
                  ) -> tuple[list[Finding], Counter]:
    """Check the files; returns (findings, counts)."""
    findings: list[Finding] = []
    stats: Counter = Counter()
    train_ids: dict[str, str] = {}
    train_contents: dict[str, str] = {}
    if train is not None:
        train_ids, train_contents = _scan(train, decode_media, findings, stats)
    for path in evals:
        ids, contents = _scan(path, decode_media, findings, stats)
        leaked = set()
        for sample_id, where in ids.items():
            if sample_id in train_ids:
                leaked.add(where)
                findings.append(Finding(where, "leak", f"sample_id {sample_id!r} is also in "
                                                       f"train at {train_ids[sample_id]}"))
        for digest, where in contents.items():
            if digest in train_contents and where not in leaked:
                findings.append(Finding(where, "leak", "same prompt and media as the train "
                                                       f"record at {train_contents[digest]}"))
    return findings, stats


def report(findings: list[Finding], stats: Counter, files: Sequence[str]) -> str:
    kinds = Counter(f.kind for f in findings)
    lines = [str(f) for f in findings]
    summary = (f"{stats['records']} records in {len(files)} file(s), {stats['media']} media "
               f"entries, {stats['duplicate_prompts']} duplicate prompt(s); known tasks: "
               f"{', '.join(TASKS)}")
    if findings:
        lines.append(f"FAILED: {len(findings)} error(s) ("
                     + ", ".join(f"{k}={kinds[k]}" for k in ERROR_CLASSES if kinds[k])
                     + f"); {summary}")
    else:
        lines.append(f"OK: {summary}")
    return "\n".join(lines)
