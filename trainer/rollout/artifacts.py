"""Trajectory sidecars, PNGs and their retention under ``artifact_root``.

Layout::

    <artifact_root>/<task>/rollout_0000007/group_00000003.safetensors
    <artifact_root>/<task>/rollout_0000007/group_00000003_sample_0000.png   (.gif: a video)
    <artifact_root>/eval/<task>/rollout_<policy_version>/...   (evaluation, same layout)

One safetensors sidecar per prompt group with three flat namespaces:

- ``common.*``: ``sigmas`` (the full T+1 schedule), ``sde_indices`` [S], ``sample_index``
  [G] (each candidate's slot), ``group_index`` [1], ``policy_version`` [1], ``rollout_id``
  [1] (-1 for evaluation), ``seed_hash`` [1] (63 bits of sha256 over the seed and the sample
  ids: a cheap "same noise?" check between two sidecars).
- ``conditions.*``: the frozen conditions of the group. Every candidate of a t2i group shares
  its prompt, so one row is stored (batch dim kept, size 1) when all rows are equal, and all
  rows otherwise (``conditions_shared`` in the metadata says which). A Qwen-Image prompt
  embedding is ~3.6 MB; storing it once per group instead of once per candidate keeps a
  256-sample rollout at ~100 MB instead of ~1 GB.
- ``tracks.*``: per candidate: ``latents`` / ``next_latents`` [G, S, *latent],
  ``log_probs`` / ``sigmas`` / ``sigmas_next`` [G, S].

The string metadata holds the prompt, sample ids, task, geometry, eta, sde type, sampling
fingerprint and weight checksum as JSON-safe strings; an editing group also its candidates'
reference images (``sources``: their ``ImageRef`` entries, paths or data URIs) and a video
group its ``frames``. The reference images' encoding is among the ``conditions.*``. Files are written ``.tmp`` → fsync →
atomic ``os.replace`` (then the directory is fsynced), so a reader never sees half a sidecar.
PNGs are written ``.tmp`` → rename without fsync: they are for eyes, the sidecar is the audit
record.

The training path never reads these files back (trajectories reach the actor in memory);
``load_group_sidecar`` exists for audit, replay debugging and the round-trip test.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save
from safetensors import safe_open

from trainer.media import ImageRef, gif_bytes
from trainer.models.base import RolloutBatch
from trainer.utils.fsio import fsync_dir

SIDECAR_FORMAT = "flowgrpo-sidecar/1"
_ROLLOUT_DIR = re.compile(r"^rollout_(\d+)$")


def rollout_dir(artifact_root: str | os.PathLike, task: str, rollout_id: int, *,
                evaluation: bool = False) -> Path:
    """``<root>/<task>/rollout_<id>`` (``<root>/eval/<task>/...`` for evaluation)."""
    base = Path(artifact_root) / ("eval" if evaluation else "") / task
    return base / f"rollout_{int(rollout_id):07d}"


def sidecar_path(directory: Path, group_index: int) -> Path:
    return directory / f"group_{int(group_index):08d}.safetensors"


def image_path(directory: Path, group_index: int, slot: int) -> Path:
    return directory / f"group_{int(group_index):08d}_sample_{int(slot):04d}.png"


def sampling_fingerprint(sampling: dict[str, Any]) -> str:
    """A short stable hash of the sampling config (written into every sidecar and manifest)."""
    blob = json.dumps(sampling, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def seed_hash(seed: int, sample_ids: list[str]) -> int:
    digest = hashlib.sha256(json.dumps([int(seed), list(sample_ids)]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` through ``path.tmp`` and an atomic rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def write_group_sidecar(directory: Path, group_index: int, rows: RolloutBatch, *, task: str,
                        sigmas: torch.Tensor, seed: int, sampling_fp: str,
                        weight_checksum: str | None = None) -> Path:
    """Write one group's sidecar (``rows`` = that group's candidates, slot order)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {
        "common.sigmas": _cpu(sigmas).float(),
        "common.sde_indices": torch.tensor(rows.sde_indices, dtype=torch.int64),
        "common.sample_index": torch.arange(len(rows), dtype=torch.int64),
        "common.group_index": torch.tensor([group_index], dtype=torch.int64),
        "common.policy_version": torch.tensor([rows.policy_version], dtype=torch.int64),
        "common.rollout_id": torch.tensor(
            [-1 if rows.rollout_id is None else rows.rollout_id], dtype=torch.int64),
        "common.seed_hash": torch.tensor([seed_hash(seed, rows.sample_ids)], dtype=torch.int64),
        "tracks.latents": _cpu(rows.latents),
        "tracks.next_latents": _cpu(rows.next_latents),
        "tracks.log_probs": _cpu(rows.log_probs),
        "tracks.sigmas": _cpu(rows.sigmas),
        "tracks.sigmas_next": _cpu(rows.sigmas_next),
    }
    shared = all(bool(torch.equal(v[:1].expand_as(v), v)) for v in rows.conditions.values())
    for name, value in rows.conditions.items():
        tensors[f"conditions.{name}"] = _cpu(value[:1] if shared else value)
    metadata = {
        "format": SIDECAR_FORMAT,
        "task": task,
        "prompt": json.dumps(rows.prompts[0] if rows.prompts else ""),
        "sample_ids": json.dumps(rows.sample_ids),
        "height": str(rows.height),
        "width": str(rows.width),
        "eta": repr(float(rows.eta)),
        "sde_type": rows.sde_type,
        "guidance_scale": repr(float(rows.guidance_scale)),
        "sde_options": json.dumps(rows.sde_options),
        "sampling_fingerprint": sampling_fp,
        "weight_checksum": weight_checksum or "",
        "conditions_shared": "1" if shared else "0",
        "metadata": json.dumps(rows.metadata, default=str),
    }
    # only where they say something, so a text-to-image sidecar stays what it was
    if rows.frames != 1:
        metadata["frames"] = str(rows.frames)
    if rows.sources is not None:
        metadata["sources"] = json.dumps([[getattr(ref, "entry", ref) for ref in refs]
                                          for refs in rows.sources])
    path = sidecar_path(directory, group_index)
    atomic_write_bytes(path, save(tensors, metadata=metadata))
    return path


def write_group_images(directory: Path, group_index: int, images: torch.Tensor) -> list[Path]:
    """One PNG per candidate from ``images`` [G, H, W, 3] uint8; for videos [G, F, H, W, 3]
    one animated GIF per candidate (``trainer.media.gif_bytes``; one frame: a PNG)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for slot, img in enumerate(_cpu(images).numpy()):
        img = img[0] if img.ndim == 4 and len(img) == 1 else img
        path = image_path(directory, group_index, slot)
        if img.ndim == 4:
            path, data = path.with_suffix(".gif"), gif_bytes(img)
        else:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            data = buf.getvalue()
        atomic_write_bytes(path, data, fsync=False)
        paths.append(path)
    return paths


def load_group_sidecar(path: str | os.PathLike, *, with_images: bool = True) -> RolloutBatch:
    """Rebuild a group's ``RolloutBatch`` from its sidecar (and PNGs when present)."""
    path = Path(path)
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"{path} is not a {SIDECAR_FORMAT} sidecar (format={meta.get('format')!r})")
    sample_ids = json.loads(meta["sample_ids"])
    n = len(sample_ids)
    conditions = {k[len("conditions."):]: v for k, v in tensors.items() if k.startswith("conditions.")}
    if meta.get("conditions_shared") == "1":
        conditions = {k: v.expand(n, *v.shape[1:]).contiguous() for k, v in conditions.items()}
    group_index = int(tensors["common.group_index"][0])
    rollout_id = int(tensors["common.rollout_id"][0])
    images = None
    if with_images:
        pngs = [image_path(path.parent, group_index, s) for s in range(n)]
        if all(p.exists() for p in pngs):
            images = torch.from_numpy(np.stack([np.asarray(Image.open(p).convert("RGB")) for p in pngs]))
    return RolloutBatch(
        prompts=[json.loads(meta["prompt"])] * n,
        sample_ids=sample_ids,
        group_index=torch.full((n,), group_index, dtype=torch.int64),
        sde_indices=[int(i) for i in tensors["common.sde_indices"].tolist()],
        latents=tensors["tracks.latents"],
        next_latents=tensors["tracks.next_latents"],
        sigmas=tensors["tracks.sigmas"],
        sigmas_next=tensors["tracks.sigmas_next"],
        log_probs=tensors["tracks.log_probs"],
        conditions=conditions,
        height=int(meta["height"]),
        width=int(meta["width"]),
        eta=float(meta["eta"]),
        sde_type=meta["sde_type"],
        images=images,
        metadata=json.loads(meta.get("metadata", "[]")),
        policy_version=int(tensors["common.policy_version"][0]),
        rollout_id=None if rollout_id < 0 else rollout_id,
        # absent in sidecars written before CFG and the Flow-GRPO options: their defaults
        guidance_scale=float(meta.get("guidance_scale", "1.0")),
        sde_options=json.loads(meta.get("sde_options", "{}")),
        frames=int(meta.get("frames", "1")),
        sources=None if "sources" not in meta else
        [tuple(ImageRef(entry) for entry in refs) for refs in json.loads(meta["sources"])],
    )


def prune_stale_artifacts(task_dir: str | os.PathLike, *, current_rollout_id: int,
                          retention: int) -> list[Path]:
    """Delete rollout directories outside the ``retention`` most recent ids; return them.

    Called at the start of rollout ``current_rollout_id`` (before it writes), so the kept
    window is ``(current - retention, current]``: after this rollout writes, exactly
    ``retention`` rollouts remain. Directories with an id *above* the current one come from an
    abandoned timeline (a run resumed from an earlier checkpoint) and are deleted too, so a
    resumed run never mixes its groups with stale files. The current rollout's own directory
    is cleared as well for the same reason. ``retention <= 0`` keeps every earlier rollout (unbounded); the current and abandoned-future directories are still cleared.
    """
    task_dir = Path(task_dir)
    removed: list[Path] = []
    if not task_dir.is_dir():
        return removed
    for entry in sorted(task_dir.iterdir()):
        m = _ROLLOUT_DIR.match(entry.name)
        if not m or not entry.is_dir():
            continue
        rid = int(m.group(1))
        stale = rid == current_rollout_id or rid > current_rollout_id or (
            retention > 0 and rid <= current_rollout_id - retention)
        if stale:
            shutil.rmtree(entry)
            removed.append(entry)
    return removed
