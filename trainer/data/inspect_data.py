"""``inspect``: check prompt files before a run ever touches a GPU.

It reads every format ``launch`` trains on through the trainer's own reader
(``trainer.data.prompt_files``): JSONL / parquet records, ``.txt`` lists (one prompt a line),
GenEval's ``metadata.jsonl``; a Flow-GRPO dataset folder given as ``--train`` is its two
files, the test file checked as eval. A ``task`` or ``sample_id`` the file leaves out is filled
in as the trainer fills it (so it is no error), and only ids the files name count as leaks.

Error classes, each reported as ``file:line: [class] message``:

* ``parse``: a line that is not JSON (or a parquet row whose metadata is not).
* ``schema``: the prompt missing or not a non-empty string, metadata not an object, a
  sample_id that is not a non-empty string, media lists that are not lists of paths.
* ``task``: metadata.task is not a known generation task.
* ``placeholder``: the count of <image> / <video> placeholders differs from the media list.
* ``media``: a referenced local media file does not exist.
* ``decode``: (with ``decode_media``) a media file exists but does not decode, or an image
  decodes to a size the trainer refuses (a side under ``trainer.media.MIN_SIDE``, more than
  ``trainer.media.MAX_PIXELS`` pixels); an inline (``data:`` URI) image is checked always.
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

from trainer.data.prompt_files import (PromptLine, dataset_splits, folder_problem,
                                       iter_prompt_lines)
from trainer.media import ImageRef, image_problem, is_inline
from trainer.data.schema import (IMAGE_SUFFIXES, TASKS, content_hash, is_url, media_entries,
                                 resolve_media)

ERROR_CLASSES = ("parse", "schema", "task", "placeholder", "media", "decode", "duplicate_id",
                 "leak")


@dataclass
class Finding:
    where: str
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: [{self.kind}] {self.message}"


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
    """Check one file; returns {sample_id the file names: where} and {content hash: where}."""
    ids: dict[str, str] = {}
    contents: dict[str, str] = {}
    base = os.path.dirname(os.path.abspath(path))
    try:
        lines = list(iter_prompt_lines(path))
    except Exception as exc:  # unreadable: OSError, or pyarrow's errors for a damaged file
        findings.append(Finding(path, "parse", f"cannot read it ({type(exc).__name__}: {exc})"))
        return ids, contents
    for line in lines:
        stats["records"] += line.line > 0
        findings.extend(Finding(line.where if line.line else path, kind, message)
                        for kind, message in line.problems)
        if not isinstance(line.row, dict):
            continue
        _check_media(line, base, decode_media, findings, stats)
        if line.record is None:
            continue
        sample_id = line.record["metadata"]["sample_id"]
        if sample_id in ids:
            findings.append(Finding(line.where, "duplicate_id",
                                    f"sample_id {sample_id!r} already at {ids[sample_id]}"))
        elif line.id_given:
            ids[sample_id] = line.where
        digest = content_hash(line.record["prompt"], [resolve_media(p, base)
                                                      for _, p in media_entries(line.row)])
        if digest in contents:
            stats["duplicate_prompts"] += 1
        else:
            contents[digest] = line.where
    if not lines:
        findings.append(Finding(path, "schema", "holds no prompt (empty file, or only blank "
                                                "lines)"))
    return ids, contents


def _check_media(line: PromptLine, base: str, decode_media: bool, findings: list[Finding],
                 stats: Counter) -> None:
    listed = {k: v for k, v in line.row.items() if isinstance(v, list)}  # else a schema finding
    for key, entry in media_entries(listed):
        if is_url(entry):
            continue
        stats["media"] += 1
        if is_inline(entry):  # bytes in the line: always decoded, there is no file to look for
            problem = image_problem(ImageRef(entry))
            if problem:
                findings.append(Finding(line.where, "decode", f"{key} entry (inline): {problem}"))
            continue
        path = resolve_media(entry, base)
        if not os.path.isfile(path):
            findings.append(Finding(line.where, "media", f"{key} entry {entry!r}: no file {path}"))
        elif decode_media:
            problem = _decode_problem(path)
            if problem:
                findings.append(Finding(line.where, "decode", problem))
            elif key == "images":  # it decodes: the trainer's size bounds (trainer.media)
                problem = image_problem(ImageRef(path))
                if problem:
                    findings.append(Finding(line.where, "decode", f"{key} entry {entry!r}: "
                                                                  f"{problem}"))


def expand_folders(train: str | None, evals: Sequence[str]) -> tuple[str | None, list[str]]:
    """A dataset folder as ``--train`` is its train file, its test file added to the evals
    (the split ``launch --prompt-data <folder>`` trains and evaluates on); as ``--eval``, its
    test file."""
    evals = [dataset_splits(p)["test"] if os.path.isdir(p) and dataset_splits(p) else p
             for p in evals]
    if train is not None and os.path.isdir(train) and dataset_splits(train):
        splits = dataset_splits(train)
        train, evals = splits["train"], [splits["test"], *evals]
    return train, evals


def inspect_files(*, train: str | None, evals: Sequence[str] = (), decode_media: bool = False
                  ) -> tuple[list[Finding], Counter]:
    """Check the files; returns (findings, counts)."""
    findings: list[Finding] = []
    stats: Counter = Counter()
    train, evals = expand_folders(train, evals)
    for path in [p for p in [train, *evals] if p is not None and os.path.isdir(p)]:
        findings.append(Finding(path, "parse", folder_problem(path) or "a folder"))
    if findings:
        return findings, stats
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
