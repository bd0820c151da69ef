"""Pictures of editing samples: source and result side by side with the instruction under
the pair, in the grid (PNG, TensorBoard) and in each W&B image; text-to-image grids are
byte-identical to what they were."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from trainer.media import ImageRef
from trainer.visuals import SOURCE_GAP, captioned_grid, log_pictures, log_samples, side_by_side

RED, BLUE, GREEN = (220, 20, 20), (20, 20, 220), (20, 200, 20)


def _solid(colour, h, w):
    return np.broadcast_to(np.array(colour, np.uint8), (h, w, 3)).copy()


class _Metrics:
    enabled = True

    def __init__(self):
        self.logged = []

    def samples(self, tag, step, grid, images, texts, path=None):
        self.logged.append((tag, grid, np.asarray(images), list(texts)))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(grid).save(path)


def test_side_by_side_puts_each_source_resized_left_of_its_result(tmp_path):
    Image.fromarray(_solid(RED, 5, 7)).save(tmp_path / "src.png")
    results = torch.from_numpy(np.stack([_solid(BLUE, 16, 12), _solid(GREEN, 16, 12)]))
    pairs = side_by_side(results, [(ImageRef(str(tmp_path / "src.png")),),
                                   (_solid(GREEN, 30, 30), _solid(RED, 8, 8))])
    assert pairs.shape == (2, 16, 2 * (12 + SOURCE_GAP) + 12, 3)
    first = pairs[0]
    assert (first[:, :12] == RED).all()                      # the source, at the result's size
    assert (first[:, 12 + SOURCE_GAP + 12:][:, :SOURCE_GAP] == 255).all()  # padding: no 2nd source
    assert (first[:, -12:] == BLUE).all()                    # the result, rightmost
    second = pairs[1]
    assert (second[:, :12] == GREEN).all() and (second[:, 12 + SOURCE_GAP:24 + SOURCE_GAP]
                                                == RED).all()


def test_edit_grid_shows_source_then_result_with_the_instruction_under_the_pair(tmp_path):
    metrics = _Metrics()
    results = torch.from_numpy(np.stack([_solid(BLUE, 32, 32)] * 2))
    sources = [(_solid(RED, 32, 32),)] * 2
    log_samples(metrics, "eval/samples", 3, results, ["make the square blue"] * 2, [0.5, 0.25],
                path=tmp_path / "grid.png", sources=sources)
    _, grid, wandb_images, texts = metrics.logged[0]
    assert texts == ["0.500  make the square blue", "0.250  make the square blue"]
    assert wandb_images.shape[2] == 2 * 32 + SOURCE_GAP  # W&B gets the pair, not the result
    saved = np.asarray(Image.open(tmp_path / "grid.png").convert("RGB"))
    assert np.array_equal(saved, grid)
    scale = -(-192 // (2 * 32 + SOURCE_GAP))  # the pair is upscaled to min_tile's width
    pair_w = scale * (2 * 32 + SOURCE_GAP)
    row = saved[4 + 10, 4:4 + pair_w]  # through the first pair (past the 4 px padding)
    red_x = np.flatnonzero((row == RED).all(-1))
    blue_x = np.flatnonzero((row == BLUE).all(-1))
    assert red_x.tolist() == list(range(32 * scale))  # source left, then the gap, the result
    assert blue_x.tolist() == list(range((32 + SOURCE_GAP) * scale, pair_w))
    # the caption strip under the pair holds dark (text) pixels across the tile's width
    tile_h = 32 * scale
    strip = saved[4 + tile_h:4 + tile_h + 20, 4:4 + pair_w]
    assert (strip.max(-1) < 100).any()


def test_text_to_image_grids_are_unchanged_byte_for_byte():
    images = torch.from_numpy(np.stack([_solid(RED, 16, 16), _solid(BLUE, 16, 16)]))
    texts = ["0.100  a red square", "0.900  a blue square"]
    plain = captioned_grid(images, texts)
    assert np.array_equal(captioned_grid(images, texts, sources=None), plain)
    assert np.array_equal(captioned_grid(images, texts, sources=[(), ()]), plain)
    metrics = _Metrics()
    log_samples(metrics, "train/samples", 1, images, ["a red square", "a blue square"],
                [0.1, 0.9])
    _, grid, wandb_images, _ = metrics.logged[0]
    assert np.array_equal(grid, plain) and np.array_equal(wandb_images, images.numpy())


def test_training_pictures_take_sources_as_a_fourth_item(tmp_path):
    metrics = _Metrics()
    trainer = SimpleNamespace(rank=0, metrics=metrics, run_dir=Path(tmp_path),
                              last_samples=(torch.from_numpy(_solid(BLUE, 16, 16)[None]),
                                            ["make it blue"], torch.tensor([0.7]),
                                            [(_solid(RED, 16, 16),)]))
    log_pictures(trainer.metrics, trainer.run_dir, 2, trainer.last_samples, evaluated=False)
    saved = np.asarray(Image.open(tmp_path / "train_samples" / "step00002.png").convert("RGB"))
    assert (saved == RED).all(-1).any() and (saved == BLUE).all(-1).any()
    trainer.last_samples = trainer.last_samples[:3]  # text-to-image: the three items as before
    log_pictures(trainer.metrics, trainer.run_dir, 3, trainer.last_samples, evaluated=False)
    saved = np.asarray(Image.open(tmp_path / "train_samples" / "step00003.png").convert("RGB"))
    assert not (saved == RED).all(-1).any() and (saved == BLUE).all(-1).any()
