"""Pictures of a run: captioned sample grids and the reward curve.

* ``captioned_grid``: each image with its caption (reward, then the whole prompt) underneath,
  laid out by torchvision's ``make_grid``. Tiles narrower than ``min_tile`` pixels are upscaled
  (nearest: the pixels stay the model's) so a caption fits under a 32-pixel toy image. The
  caption is wrapped to the tile's width and kept whole: OCR prompts carry the quoted text the
  reward reads and GenEval prompts their second object, both near the end. A caption longer
  than ``MAX_CAPTION_LINES`` at the normal size is set in a smaller font; only one longer than
  that at the small size is cut, with an ellipsis. Every tile of a grid gets the strip height
  of its longest caption, so rows stay aligned.
* Editing samples (``sources``: per sample, its reference images): each tile is the source(s)
  and the result side by side, left to right, the sources resized to the result's size (so
  every tile of a grid has one width; a sample with fewer sources than the most is padded
  with white), and the caption (reward, then the instruction) under the pair. Without
  sources (text-to-image) nothing changes.
* ``pick_samples``: which of a rollout's candidates the training grid shows: spread over the
  groups (each group is one prompt's candidates), so the grid reads several prompts rather
  than one prompt's candidates only.
* ``write_reward_curve``: ``<run_dir>/reward_curve.png`` from ``metrics.jsonl`` (so a resumed
  run's curve holds its whole history), drawn with matplotlib: the weighted reward of training
  rollouts and of evals, and below it every reward component. One colour per reward; train a
  solid line, eval a dashed line with open circles; ticks and gridlines on both axes.
* ``log_samples``: one set of samples to the run directory and TensorBoard (the grid) and to
  W&B (one captioned ``wandb.Image`` per sample).
* Video samples (uint8 [N, F, H, W, 3], ``trainer.media``'s convention): each tile of the grid
  is the sample's frame strip (``frame_strip``: up to ``STRIP_FRAMES`` frames, evenly spread,
  first and last included, left to right with a white gap), captioned as an image is; each
  sample is also an animated GIF next to the grid's PNG (``<grid stem>_sample<i>.gif``,
  through PIL's GIF writer: ``trainer.media.gif_bytes``), and on W&B one captioned
  ``wandb.Video`` per sample made from that GIF (no video encoder needed). A video with one
  frame is pictured as the image it is, exactly as before; with sources (a first frame to
  animate, say), the sources are resized to one frame and put left of the strip.
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

from trainer.media import spread_indices, write_gif
from trainer.metrics import record_write_failure

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


MAX_CAPTION_LINES = 8
_SIZES = ((11, 13), (9, 11))  # (font size, line height) in pixels: normal, then small


def _wrap(text: str, width_px: int, size: int) -> list[str]:
    chars = max(8, int(width_px / max(1.0, _font(size).getlength("n"))))
    return textwrap.wrap(text, chars) or [""]


def caption_lines(text: str, tile_width: int, lines: int | None = None) -> list[str]:
    """The lines a caption is drawn in under a tile ``tile_width`` pixels wide."""
    return _caption_layout(text, tile_width, lines)[1]


def _caption_layout(text: str, width_px: int, lines: int | None) -> tuple[int, list[str]]:
    """(font size, wrapped lines) of one caption: the normal size when it fits in the lines
    allowed, else the small size, cut only when that does not fit either."""
    limit = lines or MAX_CAPTION_LINES
    for size, _ in _SIZES:
        wrapped = _wrap(text, width_px - 4, size)
        if len(wrapped) <= limit:
            return size, wrapped
    wrapped = wrapped[:limit]
    wrapped[-1] = wrapped[-1][:-1] + "\u2026" if len(wrapped[-1]) > 1 else "\u2026"
    return size, wrapped


def _upscaled(image: np.ndarray, min_tile: int) -> Image.Image:
    tile = Image.fromarray(np.ascontiguousarray(image))
    if tile.width < min_tile:
        scale = math.ceil(min_tile / tile.width)
        tile = tile.resize((tile.width * scale, tile.height * scale), Image.NEAREST)
    return tile


def _caption_tile(tile: Image.Image, layout: tuple[int, list[str]], strip_h: int
                  ) -> np.ndarray:
    size, wrapped = layout
    line_h = dict(_SIZES)[size]
    out = Image.new("RGB", (tile.width, tile.height + strip_h), "white")
    out.paste(tile, (0, 0))
    draw = ImageDraw.Draw(out)
    for i, line in enumerate(wrapped):
        draw.text((2, tile.height + 2 + i * line_h), line, fill="black", font=_font(size))
    return np.array(out)  # a writable copy: torch.from_numpy refuses read-only views


SOURCE_GAP = 4  # white pixels between a source and its result
STRIP_FRAMES = 8  # frames a strip shows: enough to read the motion, narrow enough for a grid
FRAME_GAP = 2  # white pixels between the frames of a strip


def frame_strip(video: torch.Tensor | np.ndarray, max_frames: int = STRIP_FRAMES) -> np.ndarray:
    """uint8 [F, H, W, 3] -> [H, k * (W + gap) - gap, 3]: k = min(F, max_frames) frames,
    evenly spread (``trainer.media.spread_indices``), left to right on white."""
    frames = video.cpu().numpy() if isinstance(video, torch.Tensor) else np.asarray(video)
    picked = spread_indices(len(frames), max_frames)
    _, h, w, _ = frames.shape
    out = np.full((h, len(picked) * (w + FRAME_GAP) - FRAME_GAP, 3), 255, dtype=np.uint8)
    for slot, index in enumerate(picked):
        out[:, slot * (w + FRAME_GAP):slot * (w + FRAME_GAP) + w] = frames[index]
    return out


def is_video(images) -> bool:
    """Whether a sample batch is videos of more than one frame ([N, F, H, W, 3], F > 1)."""
    return len(images.shape) == 5 and images.shape[1] > 1


def as_pictured(images):
    """A one-frame video batch as the image batch it is; anything else unchanged."""
    return images[:, 0] if len(images.shape) == 5 and images.shape[1] == 1 else images


def has_sources(sources: Sequence[Sequence] | None) -> bool:
    return sources is not None and any(len(s) for s in sources)


def side_by_side(images: torch.Tensor | np.ndarray, sources: Sequence[Sequence],
                 source_width: int | None = None) -> np.ndarray:
    """uint8 [N, H, W, 3] results + per-sample sources (ImageRefs or uint8 [h, w, 3] arrays)
    -> uint8 [N, H, k * (w + gap) + W, 3]: every source resized to H x w (``source_width``,
    default W), then the result."""
    from trainer.media import as_arrays  # local: torch-free module, used here only for edits

    arrays = images.cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if len(sources) != len(arrays):
        raise ValueError(f"{len(arrays)} images but {len(sources)} source lists")
    n, h, width, _ = arrays.shape
    w = source_width or width
    k = max(len(s) for s in sources)
    out = np.full((n, h, k * (w + SOURCE_GAP) + width, 3), 255, dtype=np.uint8)
    for i, (result, sample) in enumerate(zip(arrays, sources)):
        for j, source in enumerate(as_arrays(sample)):
            resized = Image.fromarray(np.ascontiguousarray(source)).resize((w, h),
                                                                          Image.BILINEAR)
            out[i, :, j * (w + SOURCE_GAP):j * (w + SOURCE_GAP) + w] = np.asarray(resized)
        out[i, :, k * (w + SOURCE_GAP):] = result
    return out


def video_tiles(videos: torch.Tensor | np.ndarray, sources: Sequence[Sequence] | None
                ) -> np.ndarray:
    """uint8 [N, F, H, W, 3] -> [N, H, W', 3]: each video's frame strip, after its sources
    (each resized to one frame) when it has any."""
    strips = np.stack([frame_strip(video) for video in videos])
    if has_sources(sources):
        strips = side_by_side(strips, sources, source_width=videos.shape[3])
    return strips


def captioned_grid(images: torch.Tensor | np.ndarray, texts: Sequence[str], *, ncol: int = 8,
                   min_tile: int = 192, lines: int | None = None,
                   sources: Sequence[Sequence] | None = None) -> np.ndarray:
    """uint8 [N, H, W, 3] + N captions -> one uint8 [H', W', 3] grid (white padding). With
    ``lines``, every caption strip is that many lines high (captions cut to fit); without, as
    high as the longest caption needs (up to ``MAX_CAPTION_LINES``). With ``sources`` (per
    sample, its reference images), each tile is source(s) and result side by side."""
    if has_sources(sources):
        images = side_by_side(images, sources)
        ncol = max(1, ncol // 2)  # a pair is two images wide: keep the grid's width
    arrays = images.cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if len(arrays) != len(texts):
        raise ValueError(f"{len(arrays)} images but {len(texts)} captions")
    tiles = [_upscaled(a, min_tile) for a in arrays]
    layouts = [_caption_layout(t, tile.width, lines) for tile, t in zip(tiles, texts)]
    strip_h = (13 * lines if lines else
               max((dict(_SIZES)[size] * len(w) for size, w in layouts), default=13)) + 4
    chw = [torch.from_numpy(_caption_tile(tile, layout, strip_h)).permute(2, 0, 1)
           for tile, layout in zip(tiles, layouts)]
    grid = make_grid(chw, nrow=max(1, min(ncol, len(chw))), padding=4, pad_value=255)
    return grid.permute(1, 2, 0).contiguous().numpy().astype(np.uint8)


def pick_samples(prompts: Sequence[str], k: int) -> list[int]:
    """Up to ``k`` indices of a rollout's samples, taken round-robin over its groups (runs of
    one prompt), returned in rollout order: the first candidate of every group before any
    group's second."""
    groups: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == prompt:
            groups[-1].append(i)
        else:
            groups.append([i])
    chosen: list[int] = []
    for rank in range(max((len(g) for g in groups), default=0)):
        chosen += [g[rank] for g in groups if rank < len(g)]
    return sorted(chosen[:max(0, k)])


def log_samples(metrics, tag: str, step: int, images, prompts: Sequence[str], rewards,
                path: Path | None = None, sources: Sequence[Sequence] | None = None
                ) -> np.ndarray:
    """Samples to the PNG and TensorBoard as one captioned grid, to W&B one captioned image
    each (``metrics.samples``); with ``sources`` (editing), source and result side by side in
    both. Videos (module docstring): frame strips in the grid, a GIF per sample beside the
    PNG, a ``wandb.Video`` per sample."""
    texts = captions(prompts, rewards)
    images = as_pictured(images)
    if is_video(images):
        grid = captioned_grid(video_tiles(images, sources), texts, ncol=2)
        if path is not None:
            write_sample_gifs(images, path)
        metrics.samples(tag, step, grid, images, texts, path=path)
        return grid
    if has_sources(sources):
        images = side_by_side(images, sources)
    grid = captioned_grid(images, texts, ncol=4 if has_sources(sources) else 8)
    metrics.samples(tag, step, grid, images, texts, path=path)
    return grid


def sample_gif_path(path: Path, index: int) -> Path:
    """Where sample ``index`` of the grid saved at ``path`` goes as a GIF."""
    return path.with_name(f"{path.stem}_sample{index:02d}.gif")


def write_sample_gifs(videos, path: Path) -> list[Path]:
    """Each video of uint8 [N, F, H, W, 3] as a GIF beside the grid ``path``; a failed write
    (a full disk) is logged and counted as the logger's pictures are, not raised."""
    written = []
    for index, video in enumerate(videos):
        target = sample_gif_path(path, index)
        try:
            write_gif(target, video)
            written.append(target)
        except OSError as exc:
            record_write_failure(f"picture {target.name} in {target.parent}", exc)
    return written


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


def _reward_colours(total: dict[str, list], parts: dict[str, list]) -> dict[str, tuple]:
    """One colour per reward (train and eval of a reward share it; the line style differs)."""
    bases = ["weighted"] + sorted({n.split(" ", 1)[1] for n in parts})
    colours = {b: tuple(c / 255 for c in PALETTE[i % len(PALETTE)]) for i, b in enumerate(bases)}
    out = {n: colours["weighted"] for n in total}
    out.update({n: colours[n.split(" ", 1)[1]] for n in parts})
    return out


def _plot_panel(ax, title: str, series: dict[str, list], colours: dict[str, tuple],
                label_of) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.set_title(title, fontsize=11, loc="left")
    ax.grid(True, which="major", color="0.85", linewidth=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("reward")
    if not series:
        ax.text(0.5, 0.5, "no data yet", transform=ax.transAxes, ha="center", color="0.5")
        return
    for name in sorted(series, key=lambda n: (n.split(" ", 1)[-1], n)):
        steps, values = zip(*series[name])
        if name.split(" ", 1)[0] == "eval":
            ax.plot(steps, values, linestyle="--", marker="o", markerfacecolor="white",
                    markersize=5, linewidth=1.2, color=colours[name], label=label_of(name))
        else:
            ax.plot(steps, values, linestyle="-", marker="." if len(steps) < 40 else None,
                    linewidth=1.8, color=colours[name], label=label_of(name))
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9, frameon=False)


def reward_figure(total: dict[str, list], parts: dict[str, list]):
    """The reward curve as a matplotlib Figure (no pyplot: no global state, no display)."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(9.0, 6.4), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    colours = _reward_colours(total, parts)
    _plot_panel(top, "weighted reward", total, colours, lambda n: f"{n} (weighted)")
    _plot_panel(bottom, "reward components", parts, colours, lambda n: n)
    bottom.set_xlabel("step")
    bottom.tick_params(labelbottom=True)
    return fig


def draw_reward_curve(total: dict[str, list], parts: dict[str, list]) -> np.ndarray:
    """The reward curve as an RGB uint8 array (900 x 640)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(reward_figure(total, parts))
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


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
    rollout's chosen ``samples`` (``pick_samples``: images, prompts, rewards, and for editing
    the samples' sources as a fourth item; or None) as a captioned grid (captioned images on
    W&B), and after an eval the reward curve, to the run directory, TensorBoard and W&B."""
    if not metrics.enabled:
        return
    if samples is not None and step > 0:
        images, prompts, rewards, *sources = samples
        log_samples(metrics, "train/samples", step, images, prompts, rewards,
                    path=run_dir / "train_samples" / f"step{step:05d}.png",
                    sources=sources[0] if sources else None)
    if evaluated:
        # drawn in memory, written by the logger: a full disk is counted, not fatal
        curve = draw_reward_curve(*reward_series(read_metrics(run_dir / "metrics.jsonl")))
        metrics.image("reward_curve", step, curve,
                              path=run_dir / "reward_curve.png")
