"""Weights & Biases for a run: a readable name from the recipe and a resumable id.

* name: ``logging.wandb_name`` when set, else ``<run_dir name>-<model family>-<trainable
  mode>-<reward components>``, e.g. ``sd3-t2i-lora-sd3-lora-pickscore`` (shipped recipes put
  each run in ``runs/<recipe name>``, so the name starts with the recipe's).
* id: drawn once and kept in ``<run_dir>/wandb_run_id``; a resumed run (same run_dir) passes
  it back with ``resume="allow"``, so W&B continues the same run instead of starting another.
  Delete the file to start a fresh W&B run in the same directory.

Offline use is W&B's own: ``WANDB_MODE=offline`` (then ``wandb sync`` later).
W&B's files go to ``WANDB_DIR`` when it is set (W&B's own variable: a cluster's scratch
space, say), else into the run directory.

Samples go to W&B one ``wandb.Image`` per sample, each with its caption (reward and the whole
prompt), in one list per step: W&B's media panel shows them side by side with the captions
in full, which a grid with the text burnt in cannot do. Video samples (uint8 [N, F, H, W, 3],
F > 1) go as one captioned ``wandb.Video`` each, handed over as a GIF we encode
(``trainer.media.gif_bytes``): W&B encodes raw frames itself only with moviepy installed,
a file it takes as it is.
"""
from __future__ import annotations

import io
import os
import secrets
from pathlib import Path
from typing import Any

from trainer.models import ADAPTERS  # torch-free

ID_FILE = "wandb_run_id"


def run_name(config: dict[str, Any]) -> str:
    logging = config.get("logging", {})
    if logging.get("wandb_name"):
        return str(logging["wandb_name"])
    parts = [Path(str(logging.get("run_dir", "run"))).name]
    adapter = str(config.get("model", {}).get("adapter_path", ""))
    family = {path: name for name, path in ADAPTERS.items()}.get(
        adapter, adapter.rsplit(".", 1)[-1].removesuffix("Adapter").lower())
    if family and family not in parts[0]:
        parts.append(family)
    mode = config.get("fsdp", {}).get("trainable_mode")
    if mode and mode not in parts[0]:
        parts.append(mode)
    reward = config.get("reward", {})
    names = list(reward.get("scorers") or {})
    if not names and reward.get("scorer_path"):
        names = [str(reward["scorer_path"]).rsplit(".", 1)[-1].removesuffix("Scorer").lower()]
    if names:
        parts.append("+".join(names))
    return "-".join(parts)


def resumable_id(run_dir: str | Path) -> str:
    path = Path(run_dir) / ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def init_wandb(run_dir: str | Path, project: str, config: dict[str, Any]):
    import wandb  # optional dependency (the wandb extra): only runs that log to W&B need it
    return wandb.init(project=project, config=config, dir=wandb_dir(run_dir),
                      name=run_name(config), id=resumable_id(run_dir), resume="allow")


def wandb_dir(run_dir: str | Path) -> str:
    """Where W&B writes its files: ``WANDB_DIR`` when set (created if missing), else the run
    directory."""
    path = os.environ.get("WANDB_DIR") or str(run_dir)
    os.makedirs(path, exist_ok=True)
    return path


def log_image(run, tag: str, step: int, image, caption: str | None = None) -> None:
    import wandb  # optional, as above
    run.log({tag: wandb.Image(image, caption=caption)}, step=step)


def log_samples(run, tag: str, step: int, images, texts) -> None:
    """One captioned ``wandb.Image`` per sample (uint8 [N, H, W, 3] and N captions), or one
    captioned ``wandb.Video`` per sample of a video batch [N, F, H, W, 3]."""
    import wandb  # optional, as above
    arrays = images.cpu().numpy() if hasattr(images, "cpu") else images
    if arrays.ndim == 5:
        from trainer.media import gif_bytes
        run.log({tag: [wandb.Video(io.BytesIO(gif_bytes(video)), caption=text, format="gif")
                       for video, text in zip(arrays, texts)]}, step=step)
        return
    run.log({tag: [wandb.Image(image, caption=text) for image, text in zip(arrays, texts)]},
            step=step)
