"""Pictures of video samples: frame strips in the grid (PNG, TensorBoard), an animated GIF per
sample that decodes back to its frames, one ``wandb.Video`` per sample (a fake ``wandb`` and
the real package offline), and a one-frame video pictured exactly as the image it is."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.media import gif_bytes, read_frames, spread_indices
from trainer.visuals import (FRAME_GAP, SOURCE_GAP, STRIP_FRAMES, captioned_grid, captions,
                             frame_strip, log_pictures, log_samples, sample_gif_path,
                             video_tiles)

N, F, H, W = 2, 10, 12, 16
# frame f of video n is a flat colour no other frame has: a decoded frame says which it is
COLOURS = np.array([[(10 * f + 5, 100 * n + 20, 255 - 20 * f) for f in range(F)]
                    for n in range(N)], dtype=np.uint8)
VIDEOS = torch.from_numpy(np.ascontiguousarray(
    np.broadcast_to(COLOURS[:, :, None, None, :], (N, F, H, W, 3))))
PROMPTS = ["a ball rolling left", "a cup filling with tea"]


class _Metrics:
    """The logger's samples call, recorded (what TensorBoard and W&B would get)."""

    enabled = True

    def __init__(self):
        self.logged = []

    def samples(self, tag, step, grid, images, texts, path=None):
        self.logged.append((tag, grid, np.asarray(images), list(texts)))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(grid).save(path)


def test_a_frame_strip_is_the_spread_frames_left_to_right_on_white():
    strip = frame_strip(VIDEOS[0])
    picked = spread_indices(F, STRIP_FRAMES)
    assert len(picked) == STRIP_FRAMES and picked[0] == 0 and picked[-1] == F - 1
    assert strip.shape == (H, STRIP_FRAMES * (W + FRAME_GAP) - FRAME_GAP, 3)
    for slot, index in enumerate(picked):
        left = slot * (W + FRAME_GAP)
        assert (strip[:, left:left + W] == COLOURS[0, index]).all()
        assert (strip[:, left + W:left + W + FRAME_GAP] == 255).all()
    assert frame_strip(VIDEOS[1, :3]).shape == (H, 3 * (W + FRAME_GAP) - FRAME_GAP, 3)


def test_video_samples_are_strips_in_the_grid_and_a_gif_each_that_decodes_to_its_frames(
        tmp_path):
    metrics = _Metrics()
    path = tmp_path / "eval" / "eval_step00004.png"
    grid = log_samples(metrics, "eval/samples", 4, VIDEOS, PROMPTS, [0.5, 0.25], path=path)
    expected = captioned_grid(np.stack([frame_strip(v) for v in VIDEOS]),
                              captions(PROMPTS, [0.5, 0.25]), ncol=2)
    assert np.array_equal(grid, expected)
    tag, logged_grid, logged_media, texts = metrics.logged[0]
    assert np.array_equal(logged_grid, grid) and logged_media.shape == (N, F, H, W, 3)
    for n in range(N):
        gif = sample_gif_path(path, n)
        assert gif.name == f"eval_step00004_sample{n:02d}.gif"
        frames = read_frames(gif)
        assert frames.shape == (F, H, W, 3)
        assert np.array_equal(frames[:, 0, 0], COLOURS[n])  # a flat colour survives the palette
    assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), grid)


def test_a_one_frame_video_is_pictured_exactly_as_the_image_it_is(tmp_path):
    images, videos = VIDEOS[:, 3], VIDEOS[:, 3:4]
    as_images, as_videos = _Metrics(), _Metrics()
    a = log_samples(as_images, "train/samples", 1, images, PROMPTS, [0.1, 0.9],
                    path=tmp_path / "a" / "step.png")
    b = log_samples(as_videos, "train/samples", 1, videos, PROMPTS, [0.1, 0.9],
                    path=tmp_path / "b" / "step.png")
    assert np.array_equal(a, b)
    assert np.array_equal(as_videos.logged[0][2], images.numpy())  # W&B: images, not videos
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step.png"]  # no GIF


def test_a_video_with_a_source_shows_it_resized_to_one_frame_left_of_the_strip():
    source = np.full((40, 30, 3), (200, 10, 10), np.uint8)
    tiles = video_tiles(VIDEOS, [(source,), ()])
    strip_width = STRIP_FRAMES * (W + FRAME_GAP) - FRAME_GAP
    assert tiles.shape == (N, H, W + SOURCE_GAP + strip_width, 3)
    assert (tiles[0, :, :W] == (200, 10, 10)).all() and (tiles[1, :, :W] == 255).all()
    assert np.array_equal(tiles[0, :, W + SOURCE_GAP:], frame_strip(VIDEOS[0]))


def test_training_pictures_of_a_video_rollout_write_the_grid_and_the_gifs(tmp_path):
    metrics = _Metrics()
    samples = (VIDEOS, PROMPTS, torch.tensor([0.3, 0.6]))
    log_pictures(metrics, Path(tmp_path), 7, samples, evaluated=False)
    written = sorted(p.name for p in (tmp_path / "train_samples").iterdir())
    assert written == ["step00007.png", "step00007_sample00.gif", "step00007_sample01.gif"]


class FakeWandb(types.ModuleType):
    """The part of the wandb API the trainer calls for samples, recording every call."""

    def __init__(self):
        super().__init__("wandb")
        import importlib.machinery
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.logged = []

    def init(self, **kwargs):
        module = self

        class Run:
            def log(self, data, step=None):
                module.logged.append((step, data))

            def finish(self):
                pass
        return Run()

    class Image:
        def __init__(self, data, caption=None):
            self.data, self.caption = np.asarray(data), caption

    class Video:
        def __init__(self, data, caption=None, fps=None, format=None):
            self.data, self.caption, self.format = data.read(), caption, format


def test_wandb_gets_one_captioned_gif_video_per_sample(monkeypatch, tmp_path):
    from trainer.metrics import MetricsLogger
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricsLogger(tmp_path, tensorboard=False, wandb=True, config={})
    log_samples(logger, "eval/samples", 3, VIDEOS, PROMPTS, [0.5, 0.25])
    logger.close()
    step, data = fake.logged[-1]
    shown = data["eval/samples"]
    assert step == 3 and [v.caption for v in shown] == captions(PROMPTS, [0.5, 0.25])
    assert all(v.format == "gif" for v in shown)
    assert np.array_equal(read_frames(shown[1].data), VIDEOS[1].numpy())


def test_real_wandb_offline_stores_each_video_sample_as_a_gif(tmp_path, monkeypatch):
    import wandb  # a test dependency: the W&B path is tested against the real package
    from trainer.metrics import MetricsLogger
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "scratch"))
    logger = MetricsLogger(tmp_path / "run", tensorboard=False, wandb=True, config={})
    log_samples(logger, "eval/samples", 1, VIDEOS, PROMPTS, [0.5, 0.25])
    logger.close()
    assert wandb.run is None
    offline, = (tmp_path / "scratch" / "wandb").glob("offline-run-*")
    media = sorted(offline.rglob("media/videos/eval/samples_*.gif"))
    assert len(media) == N, sorted(p.name for p in offline.rglob("*"))
    assert read_frames(media[0].read_bytes()).shape == (F, H, W, 3)


def test_gif_writing_refuses_what_is_not_uint8_frames():
    from trainer.media import MediaError
    with pytest.raises(MediaError, match=r"uint8 \[F, H, W, 3\]"):
        gif_bytes(VIDEOS.float()[0])
    with pytest.raises(MediaError, match=r"uint8 \[F, H, W, 3\]"):
        gif_bytes(VIDEOS)


def test_rollout_artifacts_of_a_video_group_are_gifs_and_of_one_frame_pngs(tmp_path):
    from trainer.rollout.artifacts import write_group_images
    gifs = write_group_images(tmp_path, 3, VIDEOS)
    assert [p.name for p in gifs] == ["group_00000003_sample_0000.gif",
                                      "group_00000003_sample_0001.gif"]
    for n, path in enumerate(gifs):
        assert np.array_equal(read_frames(path), VIDEOS[n].numpy())
    pngs = write_group_images(tmp_path, 4, VIDEOS[:, 5:6])
    assert [p.suffix for p in pngs] == [".png", ".png"]
    assert np.array_equal(np.asarray(Image.open(pngs[1]).convert("RGB")), VIDEOS[1, 5].numpy())


def test_a_gif_that_cannot_be_written_is_counted_not_raised(tmp_path):
    from trainer.metrics import _WRITE_FAILURES
    from trainer.visuals import write_sample_gifs
    (tmp_path / "taken").write_text("a file where the folder should be")
    before = _WRITE_FAILURES["count"]
    assert write_sample_gifs(VIDEOS, tmp_path / "taken" / "grid.png") == []
    assert _WRITE_FAILURES["count"] == before + N
