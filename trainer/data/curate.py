"""``curate``: de-duplicate, filter and split unified records into train / eval files.

Every step is a pure function of the input records, so a rerun writes identical bytes:

1. Validate every record (schema.record_problems); any bad record fails the run with its
   file and line, and nothing is written.
2. Drop records with a media file that does not exist, or a reference image (a file or inline
   bytes) that does not decode or has a size the trainer refuses (``trainer.media``), unless
   ``check_media=False``.
3. Drop prompts with fewer than ``min_prompt_words`` whitespace-separated words.
4. De-duplicate by content hash (normalised prompt + sorted resolved media paths); the first
   occurrence in input order is kept. Two different kept records with one sample_id are an
   error (the id decides the split and the noise seed).
5. Split by the hash of sample_id (schema.split_key): with ``eval_size`` the N records of
   smallest key are eval, and subset ``evalK`` is the K smallest of those (so eval64 is inside
   eval256 is inside eval); otherwise a record is eval when its key < ``eval_fraction``, which
   keeps every record's side fixed when more data is added.

Files: ``<prefix>train.jsonl``, ``<prefix>eval.jsonl``, ``<prefix>eval<K>.jsonl``; records keep
input order. Relative media paths are rewritten relative to the output directory.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from trainer.data.records import read_lines, write_jsonl
from trainer.media import ImageRef, image_problem, is_inline
from trainer.data.schema import (MEDIA_PLACEHOLDERS, content_hash, is_url, media_entries,
                                 record_problems, resolve_media, split_key)

DEFAULT_EVAL_FRACTION = 0.01


class CurateError(ValueError):
    """Bad input or options; the message lists every problem."""


def curate(*, inputs: Sequence[str], out_dir: str, prefix: str = "", min_prompt_words: int = 0,
           eval_size: int | None = None, eval_fraction: float | None = None,
           eval_subset_sizes: Sequence[int] = (), check_media: bool = True,
           split_salt: str = "") -> dict[str, Any]:
    """Run the pipeline above; returns counts and the written paths."""
    problems = _option_problems(inputs, min_prompt_words, eval_size, eval_fraction,
                                eval_subset_sizes)
    if problems:
        raise CurateError("curate: " + "; ".join(problems))
    if eval_size is None and eval_fraction is None:
        eval_fraction = DEFAULT_EVAL_FRACTION
    kept, stats = _filter_records(inputs, os.path.abspath(out_dir), min_prompt_words,
                                  check_media)
    if eval_size is not None and eval_size >= len(kept):
        raise CurateError(f"curate: --eval-size {eval_size} leaves no training records "
                          f"({len(kept)} kept after filtering)")
    written = {}
    for name, records in _split(kept, eval_size, eval_fraction, eval_subset_sizes,
                                split_salt).items():
        target = os.path.join(out_dir, f"{prefix}{name}.jsonl")
        written[name] = {"path": target, "records": write_jsonl(target, records)}
    return {**stats, "kept": len(kept), "files": written}


def _option_problems(inputs: Sequence[str], min_prompt_words: int, eval_size: int | None,
                     eval_fraction: float | None, eval_subset_sizes: Sequence[int]) -> list[str]:
    problems = []
    if eval_size is not None and eval_fraction is not None:
        problems.append("give --eval-size or --eval-fraction, not both")
    if eval_size is not None and eval_size < 1:
        problems.append(f"--eval-size {eval_size} must be >= 1")
    if eval_fraction is not None and not 0.0 <= eval_fraction < 1.0:
        problems.append(f"--eval-fraction {eval_fraction} must be in [0, 1)")
    if eval_subset_sizes and eval_size is None:
        problems.append("--eval-subset-sizes needs --eval-size")
    for k in eval_subset_sizes:
        if k < 1 or (eval_size is not None and k > eval_size):
            problems.append(f"eval subset size {k} must be in [1, --eval-size]")
    if len(set(eval_subset_sizes)) != len(eval_subset_sizes):
        problems.append(f"repeated eval subset sizes {list(eval_subset_sizes)}")
    if min_prompt_words < 0:
        problems.append(f"--min-prompt-words {min_prompt_words} must be >= 0")
    missing_inputs = [p for p in inputs if not os.path.isfile(p)]
    if missing_inputs:
        problems.append(f"input file(s) not found: {missing_inputs}")
    return problems


def _filter_records(inputs: Sequence[str], out_abs: str, min_prompt_words: int,
                    check_media: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every valid record that passes the filters, first copy of each content, media paths
    relocated to the output directory; raises with every bad record."""
    problems = []
    stats = {"read": 0, "dropped_missing_media": 0, "dropped_short": 0, "dropped_duplicate": 0}
    kept: list[dict[str, Any]] = []
    seen_content: set[str] = set()
    id_owner: dict[str, str] = {}
    for path in inputs:
        base = os.path.dirname(os.path.abspath(path))
        for line in read_lines(path):
            stats["read"] += 1
            issues = [line.error] if line.error else record_problems(line.record)
            if issues:
                problems.extend(f"{line.where}: {issue}" for issue in issues)
                continue
            record = line.record
            resolved = [resolve_media(p, base) for _, p in media_entries(record)]
            if check_media and _media_unusable(record, resolved):
                stats["dropped_missing_media"] += 1
                continue
            if len(record["prompt"].split()) < min_prompt_words:
                stats["dropped_short"] += 1
                continue
            digest = content_hash(record["prompt"], resolved)
            if digest in seen_content:
                stats["dropped_duplicate"] += 1
                continue
            sample_id = record["metadata"]["sample_id"]
            if sample_id in id_owner:
                problems.append(f"{line.where}: sample_id {sample_id!r} already used by a "
                                f"different record at {id_owner[sample_id]}")
                continue
            seen_content.add(digest)
            id_owner[sample_id] = line.where
            kept.append(_relocate_media(record, base, out_abs))
    if problems:
        raise CurateError(f"curate: {len(problems)} bad record(s), nothing written:\n  "
                          + "\n  ".join(problems))
    return kept, stats


def _split(kept: list[dict[str, Any]], eval_size: int | None, eval_fraction: float | None,
           eval_subset_sizes: Sequence[int], split_salt: str) -> dict[str, list[dict[str, Any]]]:
    """train / eval (and nested evalK subsets) by each sample id's salted hash."""
    keys = [split_key(r["metadata"]["sample_id"], split_salt) for r in kept]
    if eval_size is not None:
        rank = sorted(range(len(kept)), key=keys.__getitem__)
        eval_rank = {index: position for position, index in enumerate(rank[:eval_size])}
    else:
        eval_rank = {i: 0 for i, key in enumerate(keys) if key < eval_fraction}
    names = {"train": [r for i, r in enumerate(kept) if i not in eval_rank],
             "eval": [r for i, r in enumerate(kept) if i in eval_rank]}
    for k in sorted(eval_subset_sizes):
        names[f"eval{k}"] = [r for i, r in enumerate(kept) if eval_rank.get(i, k) < k]
    return names


def _media_unusable(record: dict[str, Any], resolved: list[str]) -> bool:
    """A local media file missing, or a reference image (file or inline) that does not decode
    or whose size the trainer refuses (``trainer.media.image_problem``)."""
    if any(not is_url(p) and not is_inline(p) and not os.path.isfile(p) for p in resolved):
        return True
    images = resolved[:len(record.get("images", []))]  # media_entries lists images first
    return any(not is_url(p) and image_problem(ImageRef(p)) is not None for p in images)


def _relocate_media(record: dict[str, Any], base: str, out_abs: str) -> dict[str, Any]:
    out = dict(record)
    for key in MEDIA_PLACEHOLDERS:
        if key in record:
            out[key] = [p if is_url(p) or is_inline(p) or os.path.isabs(p)
                        else os.path.relpath(resolve_media(p, base), out_abs)
                        for p in record[key]]
    return out
