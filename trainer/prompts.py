"""Prompt sources for training and eval: prompt files (JSONL, parquet, plain text, GenEval's
metadata.jsonl: ``trainer.data.prompt_files``), or the toy world.

Records are ``{"prompt": str, "metadata": {"task": "t2i", "sample_id": str, ...}}``. The
sampler is an epoch-shuffled cycle seeded by --rollout-seed, so rollout ``r`` always sees the
same prompts (exact resume needs only the rollout id).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trainer.data.prompt_files import open_prompt_file
from trainer.toy.world import make_prompt_records

TOY_TRAIN_SIZE = 4096
TOY_EVAL_SIZE = 64


def load_records(source: str, *, seed: int = 0, limit: int | None = None
                 ) -> Sequence[dict]:
    if source.startswith("toy:"):
        split = source.split(":", 1)[1] or "train"
        n = TOY_TRAIN_SIZE if split == "train" else TOY_EVAL_SIZE
        records = make_prompt_records(limit or n, seed=seed, split=split)
    else:
        if not Path(source).exists():
            raise FileNotFoundError(f"prompt data {source!r} does not exist")
        # line offsets, parsed on access (trainer.data.prompt_files: memory on every rank);
        # PromptFileError (a ValueError) names file:line
        records = open_prompt_file(source)
        return records[:limit] if limit else records
    for i, r in enumerate(records):
        r["metadata"].setdefault("task", "t2i")
        r["metadata"].setdefault("sample_id", f"{Path(source).stem}_{i:07d}")
    return records[:limit] if limit else records


class PromptSampler:
    """Rollout r -> its groups' records, identical on every rank and across resumes."""

    def __init__(self, records: list[dict], seed: int) -> None:
        if not records:
            raise ValueError("no prompt records")
        self.records = records
        self.seed = seed

    def groups_for_rollout(self, rollout_id: int, num_groups: int) -> list[dict]:
        n = len(self.records)
        start = rollout_id * num_groups
        out = []
        for k in range(start, start + num_groups):
            epoch, pos = divmod(k, n)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            out.append(self.records[int(perm[pos])])
        return out
