"""What a checkpoint promises about the model it belongs to: the adapter contract, the base
model's identity hash, and the weight-sync manifest.

A LoRA checkpoint stores only the adapter; the frozen base is reloaded from --model-path on
every resume. ``adapter_contract.json`` records everything the adapter's meaning depends on
that cannot be read back from its tensors (alpha above all: a wrong alpha silently rescales
the policy), and resume refuses (``contract_mismatches`` -> ``ContractMismatchError``) to
change any of it.

Design choices:

* ``mode`` is the trainable mode (``full`` | ``lora``). The weight-sync mode (merge vs adapter)
  is recorded but not enforced: both train the same adapter, and switching between them on
  resume is legitimate.
* The base-model hash is compared for LoRA checkpoints only: a full checkpoint carries every
  weight, so a re-saved or moved base cannot change what it resumes.
* ``alpha`` is the effective one (``--lora-alpha`` or, when 0, the rank), as ``apply_lora``
  builds the peft config; ``target_modules`` is the effective sorted list.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch

from ipc.protocol import manifest_hash
from trainer.actor.model import strip_wrapper_names
from trainer.utils.dtypes import TORCH_DTYPES
from trainer.actor.sync import sync_payload

# The base hash samples 16 x 64 KiB per weight file instead of reading every byte: a 40 GB
# base would cost tens of seconds of reads at every save and resume, the samples 1 MiB per
# file; two fine-tunes of one architecture still differ (training moves nearly every tensor,
# so nearly every sample). Small files (configs, indexes, anything <= 1 MiB) are hashed whole.
# What it does not see: an edit of bytes between the samples of a file whose size stays the
# same (one tensor changed in place). ``checkpoint.base_hash = "full"`` hashes every byte
# instead; its value carries its own prefix, so a check always recomputes in the mode the
# checkpoint recorded.
_WHOLE_FILE_MAX = 1 << 20
_SAMPLES = 16
_SAMPLE_BYTES = 64 << 10
_FULL_PREFIX = "sha256-full:"
BASE_HASH_MODES = ("sampled", "full")


def model_weights_dir(model_path: str | Path) -> Path:
    """The transformer directory of a diffusers-layout model (``<path>/transformer`` when it
    exists, else ``path`` itself)."""
    p = Path(model_path)
    return p / "transformer" if (p / "transformer").is_dir() else p


def _file_digest(path: Path, size: int, full: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if full:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        elif size <= _WHOLE_FILE_MAX:
            h.update(f.read())
        else:
            step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
            for i in range(_SAMPLES):
                f.seek(i * step)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def base_model_hash(model_path: str | Path, revision: str | None = None, *,
                    full: bool = False) -> str:
    """A content hash of the trainable base (the transformer directory), independent of
    where it lives: relative file names, sizes and sampled contents (every byte with
    ``full``), plus the revision."""
    root = model_weights_dir(model_path)
    prefix = _FULL_PREFIX if full else "sha256:"
    h = hashlib.sha256(f"revision={revision}\n".encode())
    if not root.is_dir():
        h.update(f"not-a-directory:{model_path}".encode())
        return prefix + h.hexdigest()
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        size = p.stat().st_size
        h.update(f"{rel.as_posix()}\x1f{size}\x1f{_file_digest(p, size, full)}\x1e".encode())
    return prefix + h.hexdigest()


def base_hash_matches(model_path: str | Path, revision: str | None, recorded: str) -> bool:
    """Whether the base at ``model_path`` has the ``recorded`` hash, computed in the mode the
    recorded value was (sampled or full)."""
    full = str(recorded).startswith(_FULL_PREFIX)
    return base_model_hash(model_path, revision, full=full) == recorded


def lora_scaling(contract: dict[str, Any]) -> float:
    return float(contract["alpha"]) / float(contract["rank"])


def adapter_contract(model: Any, lora_cfg: Any, sync_mode: str, adapter, model_path: str | Path,
                     *, base_hash: str = "sampled") -> dict[str, Any]:
    """The contract of a run with these ``[model]`` and ``[lora]`` sections, weight-sync mode
    and ``checkpoint.base_hash`` (the current run, or a saved one)."""
    lora = lora_cfg.rank > 0
    targets = None
    if lora:
        targets = lora_cfg.target_modules or adapter.lora_target_modules()
        targets = sorted(str(t) for t in targets)
    return {
        "mode": "lora" if lora else "full",
        "base_model_hash": base_model_hash(
            model_path, model.revision,
            full=base_hash == "full"),
        "base_model_path": str(model_path),
        "revision": model.revision,
        "rank": int(lora_cfg.rank) if lora else 0,
        "alpha": float(lora_cfg.alpha or lora_cfg.rank) if lora else 0.0,
        "dropout": float(lora_cfg.dropout) if lora else 0.0,
        "target_modules": targets,
        "task_type": None,  # peft task type: diffusers transformers use the generic LoRA model
        "task": model.task,
        "weight_sync_mode": sync_mode,
    }


_COMPARED = ("mode", "rank", "alpha", "dropout", "target_modules", "task_type", "task")


def contract_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Every way ``current`` differs from ``saved`` that would change the trained policy."""
    keys = list(_COMPARED)
    if saved.get("mode") == "lora":
        keys.append("base_model_hash")
    problems = []
    for k in keys:
        if k == "base_model_hash" and _same_base_other_mode(saved, current):
            continue
        if saved.get(k) != current.get(k):
            why = ""
            if k == "alpha":
                why = " (alpha cannot be read back from the weights: a different value " \
                      "silently rescales the adapter)"
            elif k == "base_model_hash":
                why = f" (checkpoint trained on {saved.get('base_model_path')}, " \
                      f"--model-path is {current.get('base_model_path')})"
            problems.append(f"{k}: checkpoint has {saved.get(k)!r}, current config has "
                            f"{current.get(k)!r}{why}")
    return problems


def _same_base_other_mode(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """The two base hashes were taken in different modes (checkpoint.base_hash changed): the
    current base, hashed in the saved mode, matches."""
    ours, theirs = str(current.get("base_model_hash")), str(saved.get("base_model_hash"))
    if ours.startswith(_FULL_PREFIX) == theirs.startswith(_FULL_PREFIX) \
            or not current.get("base_model_path"):
        return False
    return base_hash_matches(current["base_model_path"], current.get("revision"), theirs)


class ContractMismatchError(RuntimeError):
    """Resume refused: the checkpoint's adapter contract differs from the current config."""

    def __init__(self, checkpoint: Path, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"refusing to resume from {checkpoint}: the adapter contract does not "
                         "match the current config:\n  - " + "\n  - ".join(self.problems))


# ---- weight-sync manifest -----------------------------------------------------------------
class _MetaView:
    """Parameter names, shapes and dtypes as meta tensors: lets ``sync_payload`` list what a
    sync would send (names, order, merged shapes) with no gather and no arithmetic."""

    def __init__(self, model: torch.nn.Module):
        self._params = [(n, torch.empty(tuple(p.shape), dtype=p.dtype, device="meta"))
                        for n, p in model.named_parameters()]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._params)


def weight_sync_manifest(model: torch.nn.Module, sync_mode: str, engine_dtype: str,
                         adapter=None) -> dict[str, Any]:
    """The per-step sync payload of this run as the embedded engine receives it: ordered
    (name, shape, source dtype, wire dtype) entries under the engine's names (the adapter's
    ``weight_name_map``, as the loop builds it), their count, bytes and hash (the same hash
    ``ipc`` checks on every sync)."""
    mode = sync_mode
    wire = TORCH_DTYPES.get(engine_dtype)
    name_map = None
    if hasattr(adapter, "weight_name_map"):
        name_map = adapter.weight_name_map([strip_wrapper_names(n)
                                            for n, _ in model.named_parameters()])
    entries = []
    nbytes = 0
    for name, t in sync_payload(_MetaView(model), mode, scaling=1.0, first=False,
                                name_map=name_map):
        w = wire if (wire is not None and t.dtype.is_floating_point) else t.dtype
        shape = [int(d) for d in t.shape]
        entries.append((name, shape, str(t.dtype).removeprefix("torch."),
                        str(w).removeprefix("torch.")))
        numel = 1
        for d in shape:
            numel *= d
        nbytes += numel * torch.empty(0, dtype=w).element_size()
    return {"mode": mode, "count": len(entries), "nbytes": nbytes,
            "hash": manifest_hash(entries), "entries": [list(e) for e in entries]}


def sampling_fingerprint(driver: Any, sampling: dict[str, Any]) -> str:
    """The rollout driver's fingerprint (the one in every sidecar), or, with no driver built,
    the same function of the configured ``sampling`` (kept equal to
    ``trainer.rollout.artifacts.sampling_fingerprint`` by a test; not imported, because the
    rollout package pulls in safetensors and the engine client)."""
    fp = getattr(driver, "fingerprint", None)
    if isinstance(fp, str):
        return fp
    if hasattr(sampling, "to_dict"):  # the typed config; the drivers hash its table
        sampling = sampling.to_dict()
    blob = json.dumps(sampling, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
