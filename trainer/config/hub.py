"""Hugging Face hub ids as model paths: ``--model-path stabilityai/stable-diffusion-3.5-medium``
is looked up in the local Hugging Face cache (huggingface_hub's own lookup, never the network:
a run does not download a model behind the user's back) and stands for that snapshot folder;
an id that is not in the cache gets an error that says how to download it.

Torch-free: the config loader and preflight call it before anything heavy loads.
"""
from __future__ import annotations

import re
from pathlib import Path

# "org/name": a hub repository id, as huggingface_hub validates it (letters, digits, - _ .)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def looks_like_hub_id(value: object) -> bool:
    """True for ``org/name`` that is not a path on this machine (a relative folder wins)."""
    return isinstance(value, str) and bool(_HUB_ID.fullmatch(value)) \
        and not value.startswith(".") and not Path(value).exists()


def cached_snapshot(repo_id: str) -> str | None:
    """The local snapshot folder of ``repo_id`` (its ``main`` revision) in the Hugging Face
    cache (``HF_HUB_CACHE`` / ``HF_HOME``), or None when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        return None


def resolve_model_path(value: str) -> str:
    """``value`` itself, or the cached snapshot folder when it is a hub id in the cache."""
    if looks_like_hub_id(value):
        return cached_snapshot(value) or value
    return value


def download_hint(value: object) -> str:
    """For an error about a model path that is not a folder: how to get it, when it is a hub
    id (else empty)."""
    if not looks_like_hub_id(value):
        return ""
    from huggingface_hub.constants import HF_HUB_CACHE
    return (f"; it reads as a Hugging Face hub id, and it is not in the local cache "
            f"({HF_HUB_CACHE}): download it once with `hf download {value}` (older "
            f"huggingface_hub: `huggingface-cli download {value}`; gated models need "
            f"`hf auth login` first), or pass the folder that holds it")
