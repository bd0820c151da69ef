"""The unified prompt-record schema and the checks every tool shares.

One JSON object per line (or per parquet row)::

    {"prompt": "a red panda in a teacup",
     "metadata": {"task": "t2i", "sample_id": "pickapic_0000001"}}

* ``prompt``: non-empty string.
* ``metadata``: object with ``task`` (one of TASKS) and ``sample_id`` (non-empty string, unique
  in a dataset: it seeds each candidate's noise and decides the train/eval split). Other
  metadata keys are kept and passed through to reward functions.
* Media, for tasks that condition on them: optional ``images`` / ``videos`` lists of paths
  (relative paths are relative to the file holding the record), URLs, or (images) the bytes
  inline as ``data:image/<type>;base64,`` URIs (``trainer.media``). A prompt with no
  ``<image>`` / ``<video>`` placeholder takes every entry as a reference (an editing
  instruction such as "make the car blue"); a prompt with placeholders has one per entry, in
  order, so their counts must match.

This module is import-light (no torch): ``python -m trainer data`` never loads a model stack.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Iterable

from trainer.media import is_inline
from trainer.tasks import GENERATION_TASKS as TASKS  # torch-free: the data tools import this
MEDIA_PLACEHOLDERS: dict[str, str] = {"images": "<image>", "videos": "<video>"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def record_problems(record: Any) -> list[str]:
    """Everything wrong with one record (empty when it is valid)."""
    if not isinstance(record, dict):
        return [f"a record must be a JSON object, got {type(record).__name__}"]
    problems = []
    prompt = record.get("prompt")
    if "prompt" not in record:
        problems.append("missing required key 'prompt'")
    elif not isinstance(prompt, str) or not prompt.strip():
        problems.append(f"'prompt' must be a non-empty string, got {prompt!r:.60}")
    meta = record.get("metadata")
    if "metadata" not in record:
        problems.append("missing required key 'metadata'")
    elif not isinstance(meta, dict):
        problems.append(f"'metadata' must be an object, got {type(meta).__name__}")
    else:
        for key in ("task", "sample_id"):
            if key not in meta:
                problems.append(f"missing required key 'metadata.{key}'")
        task, sample_id = meta.get("task"), meta.get("sample_id")
        if "task" in meta and task not in TASKS:
            problems.append(f"unknown task {task!r} (known: {', '.join(TASKS)})")
        if "sample_id" in meta and (not isinstance(sample_id, str) or not sample_id.strip()):
            problems.append(f"'metadata.sample_id' must be a non-empty string, got {sample_id!r}")
    for key, placeholder in MEDIA_PLACEHOLDERS.items():
        paths = record.get(key, [])
        if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
            problems.append(f"'{key}' must be a list of paths")
            continue
        if isinstance(prompt, str) and placeholder_mismatch(prompt, placeholder, paths):
            problems.append(f"{prompt.count(placeholder)} {placeholder} placeholder(s) in the "
                            f"prompt but {len(paths)} entr{'y' if len(paths) == 1 else 'ies'} "
                            f"in '{key}'")
    return problems


def placeholder_mismatch(prompt: str, placeholder: str, entries: list) -> bool:
    """Whether a prompt's placeholders disagree with its media list: none at all is fine (every
    entry is a reference, as editing instructions are written); otherwise one per entry."""
    count = prompt.count(placeholder)
    return count != 0 and count != len(entries)


def is_url(path: str) -> bool:
    return "://" in path


def media_entries(record: dict[str, Any]) -> list[tuple[str, str]]:
    """[(key, path)] for every media entry of a (valid) record."""
    return [(key, p) for key in MEDIA_PLACEHOLDERS for p in record.get(key, [])
            if isinstance(p, str)]


def resolve_media(path: str, base_dir: str) -> str:
    """Absolute path of a media entry (URLs and inline ``data:`` images unchanged)."""
    if is_url(path) or is_inline(path) or os.path.isabs(path):
        return path
    return os.path.normpath(os.path.join(base_dir, path))


def normalize_prompt(prompt: str) -> str:
    """Whitespace-insensitive form used for de-duplication (case is kept: it can matter)."""
    return " ".join(prompt.split())


def content_hash(prompt: str, media: Iterable[str]) -> str:
    """Stable hash of the prompt plus its sorted (resolved) media paths."""
    h = hashlib.sha256(normalize_prompt(prompt).encode("utf-8"))
    for path in sorted(media):
        h.update(b"\0" + path.encode("utf-8"))
    return h.hexdigest()


def split_key(sample_id: str, salt: str = "") -> float:
    """A sample id's position in [0, 1): the train/eval split is a function of the id alone,
    so reruns and reordered inputs give the same split (no RNG involved)."""
    digest = hashlib.sha256(f"{salt}\0{sample_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64
