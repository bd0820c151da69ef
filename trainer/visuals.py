"""Pictures of a run: captioned sample grids and the reward curve.

* ``captioned_grid``: each image with its caption (reward, then prompt) underneath, laid out by
  torchvision's ``make_grid``. Tiles narrower than ``min_tile`` pixels are upscaled (nearest:
  the pixels stay the model's) so a caption fits under a 32-pixel toy image.
* ``write_reward_curve``: ``<run_dir>/reward_curve.png`` from ``metrics.jsonl`` (so a resumed
  run's curve holds its whole history): the weighted reward of training rollouts and of evals,
  and below it every reward component (train as lines, eval as dotted markers). Drawn with PIL
  (matplotlib is not a dependency of the trainer).
"""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torchvision.utils import make_grid

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def _font(size: int):
    return ImageFont.load_default(size=size)


def sample_rewards(components: dict[str, torch.Tensor], weights: dict[str, float]
                   ) -> torch.Tensor:
    """Per-sample weighted reward on the scale of reward/mean: sum_c w_c r_c / sum_c w_c."""
    weights = weights or {c: 1.0 for c in components}
    total = sum(weights.get(c, 0.0) * v.float().cpu() for c, v in components.items())
    wsum = sum(weights.get(c, 0.0) for c in components) or 1.0
    return total / wsum


def captions(prompts: Sequence[str], rewards: torch.Tensor | Sequence[float]) -> list[str]:
    return [f"{float(r):.3f}  {p}" for p, r in zip(prompts, rewards)]


def _caption_tile(image: np.ndarray, text: str, min_tile: int, lines: int) -> np.ndarray:
    tile = Image.fromarray(np.ascontiguousarray(image))
    if tile.width < min_tile:
        scale = math.ceil(min_tile / tile.width)
        tile = tile.resize((tile.width * scale, tile.height * scale), Image.NEAREST)
    font = _font(11)
    chars = max(8, int(tile.width / max(1.0, font.getlength("n"))))
    wrapped = textwrap.wrap(text, chars)[:lines] or [""]
    line_h = 13
    out = Image.new("RGB", (tile.width, tile.height + line_h * lines + 4), "white")
    out.paste(tile, (0, 0))
    draw = ImageDraw.Draw(out)
    for i, line in enumerate(wrapped):
        draw.text((2, tile.height + 2 + i * line_h), line, fill="black", font=font)
    return np.array(out)  # a writable copy: torch.from_numpy refuses read-only views


def captioned_grid(images: torch.Tensor | np.ndarray, texts: Sequence[str], *, ncol: int = 8,
                   min_tile: int = 128, lines: int = 3) -> np.ndarray:
    """uint8 [N, H, W, 3] + N captions -> one uint8 [H', W', 3] grid (white padding)."""
    arrays = images.cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if len(arrays) != len(texts):
        raise ValueError(f"{len(arrays)} images but {len(texts)} captions")
    tiles = [torch.from_numpy(_caption_tile(a, t, min_tile, lines)).permute(2, 0, 1)
             for a, t in zip(arrays, texts)]
    grid = make_grid(tiles, nrow=max(1, min(ncol, len(tiles))), padding=4, pad_value=255)
    return grid.permute(1, 2, 0).contiguous().numpy().astype(np.uint8)


# ---- the reward curve ---------------------------------------------------------------------
def reward_series(rows: Sequence[dict]) -> tuple[dict[str, list], dict[str, list]]:
    """metrics.jsonl rows -> ({"train": pts, "eval": pts}, {"train color": pts, ...}), each
    a list of (step, value) with finite values only; a later row for a step wins (resume)."""
    total: dict[str, dict[int, float]] = {}
    parts: dict[str, dict[int, float]] = {}
    for row in rows:
        step = int(row.get("step", 0))
        for key, value in row.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            if key == "reward/mean":
                total.setdefault("train", {})[step] = value
            elif key == "eval/reward_mean":
                total.setdefault("eval", {})[step] = value
            elif key.startswith("reward/") and key.endswith("_mean") and all(
                    f"{key[:-len('_mean')]}_{s}" in row for s in ("std", "min")):
                # a component: mean, std, min, max (the advantages have a mean and std only)
                parts.setdefault(f"train {key[len('reward/'):-len('_mean')]}", {})[step] = value
            elif key.startswith("eval/") and key.endswith("_mean") and \
                    key != "eval/reward_mean":
                parts.setdefault(f"eval {key[len('eval/'):-len('_mean')]}", {})[step] = value
    as_list = lambda d: {k: sorted(v.items()) for k, v in d.items()}  # noqa: E731
    return as_list(total), as_list(parts)


def _panel(draw, box, title: str, series: dict[str, list], colours: dict[str, tuple]) -> None:
    x0, y0, x1, y1 = box
    font = _font(12)
    draw.text((x0, y0 - 18), title, fill="black", font=font)
    draw.rectangle(box, outline=(90, 90, 90))
    points = [p for pts in series.values() for p in pts]
    if not points:
        draw.text((x0 + 10, y0 + 10), "no data yet", fill="gray", font=font)
        return
    smin, smax = min(p[0] for p in points), max(p[0] for p in points)
    vmin, vmax = min(p[1] for p in points), max(p[1] for p in points)
    if smax == smin:
        smax = smin + 1
    if vmax == vmin:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    pad = 10

    def xy(step, value):
        return (x0 + pad + (step - smin) / (smax - smin) * (x1 - x0 - 2 * pad),
                y1 - pad - (value - vmin) / (vmax - vmin) * (y1 - y0 - 2 * pad))

    for label, value in ((f"{vmax:.4g}", vmax), (f"{vmin:.4g}", vmin)):
        draw.text((x0 - 58, xy(smin, value)[1] - 6), label, fill="black", font=font)
    draw.text((x0, y1 + 4), f"step {smin}", fill="black", font=font)
    draw.text((x1 - 60, y1 + 4), f"step {smax}", fill="black", font=font)
    for name, pts in series.items():
        colour = colours[name]
        coords = [xy(s, v) for s, v in pts]
        if name.startswith("eval"):  # eval: markers, so it reads apart from train's lines
            for cx, cy in coords:
                draw.ellipse((cx - 3, cy - 3, cx + 3, cy + 3), outline=colour, width=2)
        if len(coords) > 1:
            draw.line(coords, fill=colour, width=2 if name.startswith("train") else 1)
        elif coords and not name.startswith("eval"):
            cx, cy = coords[0]
            draw.ellipse((cx - 2, cy - 2, cx + 2, cy + 2), fill=colour)


def draw_reward_curve(total: dict[str, list], parts: dict[str, list]) -> np.ndarray:
    width, height = 900, 640
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    names = list(total) + list(parts)
    bases = sorted({n.split(" ", 1)[-1] for n in parts})
    colours = {"train": PALETTE[0], "eval": PALETTE[1]}
    colours.update({n: PALETTE[(2 + bases.index(n.split(" ", 1)[1])) % len(PALETTE)]
                    for n in parts})
    _panel(draw, (70, 30, 700, 290), "weighted reward (train: line, eval: circles)", total,
           colours)
    _panel(draw, (70, 350, 700, 610), "reward components", parts, colours)
    font = _font(12)
    for i, name in enumerate(names):
        y = 40 + 18 * i
        draw.rectangle((715, y + 3, 727, y + 13), fill=colours[name])
        draw.text((732, y), name, fill="black", font=font)
    return np.asarray(img)


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash: the rest of the history still draws
    return rows


def write_reward_curve(run_dir: str | Path) -> Path:
    """Redraw ``<run_dir>/reward_curve.png`` from ``<run_dir>/metrics.jsonl``."""
    run_dir = Path(run_dir)
    total, parts = reward_series(read_metrics(run_dir / "metrics.jsonl"))
    path = run_dir / "reward_curve.png"
    tmp = path.with_suffix(".tmp.png")
    Image.fromarray(draw_reward_curve(total, parts)).save(tmp)
    tmp.replace(path)  # a viewer never sees a half-written file
    return path


def log_pictures(metrics, run_dir: Path, step: int, samples, *, evaluated: bool) -> None:
    """The loop's logged-step pictures (rank 0's ``metrics``, the only enabled one): the last
    rollout's first ``samples`` (images, prompts, rewards; or None) as a captioned grid, and
    after an eval the reward curve, to the run directory, TensorBoard and W&B alike."""
    if not metrics.enabled:
        return
    if samples is not None and step > 0:
        images, prompts, rewards = samples
        grid = captioned_grid(images, captions(prompts, rewards))
        metrics.image("train/samples", step, grid,
                      path=run_dir / "train_samples" / f"step{step:05d}.png")
    if evaluated:
        path = write_reward_curve(run_dir)
        metrics.image("reward_curve", step, np.asarray(Image.open(path).convert("RGB")))
