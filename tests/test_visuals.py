"""Pictures and progress: captioned grids, the reward curve from metrics.jsonl, the run bar,
W&B's run name / resumable id / images (a fake ``wandb`` module: the package is optional),
and one short run of the tiny recipe producing all of them."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.visuals import (PALETTE, captioned_grid, captions, reward_series, sample_rewards,
                             write_reward_curve)


def test_captioned_grid_lays_out_tiles_with_text_under_each():
    images = torch.zeros(3, 32, 32, 3, dtype=torch.uint8)
    images[1] = 200
    texts = captions(["a red cube on the left", "two blue spheres", "x"], [0.5, -1.25, 2])
    assert texts[1] == "-1.250  two blue spheres"
    grid = captioned_grid(images, texts, ncol=2, min_tile=128, lines=2)
    tile_h = 128 + 13 * 2 + 4  # 32 px upscaled x4, two caption lines
    assert grid.shape == (2 * (tile_h + 4) + 4, 2 * (128 + 4) + 4, 3) and grid.dtype == np.uint8
    first = grid[4:4 + tile_h, 4:4 + 128]
    assert (first[:128] == 0).all()                      # the image, upscaled, untouched
    caption = first[128:]
    assert (caption < 128).any() and (caption == 255).mean() > 0.5  # dark text on white
    blank = grid[4 + tile_h + 4:, 4 + 128 + 4:]           # the 4th cell: padding only
    assert (blank == 255).all()
    with pytest.raises(ValueError, match="3 images but 2 captions"):
        captioned_grid(images, texts[:2])


def test_sample_rewards_match_the_weighted_mean():
    comps = {"a": torch.tensor([1.0, 3.0]), "b": torch.tensor([0.0, 1.0])}
    assert sample_rewards(comps, {"a": 3.0, "b": 1.0}).tolist() == [0.75, 2.5]
    assert sample_rewards(comps, {}).tolist() == [0.5, 2.0]


def write_rows(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"step\": 9, \"rew")


def test_reward_curve_from_metrics_jsonl(tmp_path):
    rows = [{"step": 0, "eval/reward_mean": 0.2, "eval/color_mean": 0.1},
            {"step": 1, "reward/mean": 0.3, "reward/color_mean": 0.25, "reward/color_std": 0.1,
             "reward/color_min": 0.0, "reward/advantage_mean": 0.0,
             "reward/advantage_std": 1.0, "train/loss": 1.0},
            {"step": 2, "reward/mean": 0.5, "reward/color_mean": 0.45, "reward/color_std": 0.1,
             "reward/color_min": 0.0, "reward/group_std_mean": 0.3,
             "eval/reward_mean": 0.6, "eval/color_mean": 0.55},
            {"step": 2, "reward/mean": 0.55, "reward/color_mean": float("nan")}]  # resumed
    write_rows(tmp_path / "metrics.jsonl", rows)
    total, parts = reward_series([json.loads(line) for line in
                                  (tmp_path / "metrics.jsonl").read_text().splitlines()[:4]])
    assert total == {"eval": [(0, 0.2), (2, 0.6)], "train": [(1, 0.3), (2, 0.55)]}
    assert parts == {"eval color": [(0, 0.1), (2, 0.55)], "train color": [(1, 0.25), (2, 0.45)]}
    path = write_reward_curve(tmp_path)  # the cut last line is skipped, not fatal
    img = np.asarray(Image.open(path).convert("RGB"))
    assert img.shape == (640, 900, 3)
    top, bottom = img[30:290, 70:700], img[350:610, 70:700]
    for colour, panel in ((PALETTE[0], top), (PALETTE[1], top), (PALETTE[2], bottom)):
        assert (panel == np.array(colour, dtype=np.uint8)).all(-1).sum() > 20, colour


def test_run_progress_shows_done_total_phase_and_reward(capsys):
    from trainer.profiling import StageTimer
    from trainer.progress import RunProgress
    progress = RunProgress(10, initial=3)
    timer = progress.watch(StageTimer(sync=False), updates_per_rollout=2)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    opt.register_step_post_hook(progress.optimizer_stepped)
    with timer.stage("train"):
        opt.step()
        assert progress._train.bar.n == 1 and progress._train.bar.total == 2
        opt.step()
        assert progress._train.bar.n == 2
    assert progress._train is None
    opt.step()  # outside the train stage: nothing to advance
    with timer.stage("reward"):
        pass
    progress.step_done({"reward/mean": 0.4321, "eval/reward_mean": 0.25})
    assert set(timer.pop()) == {"train", "reward"}
    with progress.train_bar(2) as bar:
        bar.tick()
        bar.tick()
        assert bar.bar.n == 2
    progress.close()
    err = capsys.readouterr().err
    assert "4/10" in err and "phase=reward" in err and "reward=0.4321" in err
    assert "eval=0.25" in err and "train:" in err and "update" in err


class FakeWandb(types.ModuleType):
    """The part of the wandb API the trainer calls, recording every call."""

    def __init__(self):
        super().__init__("wandb")
        import importlib.machinery
        # libraries probe importlib.util.find_spec("wandb"), which needs a spec
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
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


@pytest.fixture
def fake_wandb(monkeypatch):
    module = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_name_resumable_id_and_images(fake_wandb, tmp_path):
    from trainer.config import load_config
    from trainer.metrics import MetricsLogger
    cfg = load_config("sd3-t2i-lora", [f"logging.run_dir={tmp_path / 'sd3-t2i-lora'}"])
    run_dir = tmp_path / "sd3-t2i-lora"
    first = MetricsLogger(run_dir, tensorboard=False, wandb=True, wandb_project="p",
                          config=cfg.to_dict())
    first.image("eval/samples", 3, np.zeros((4, 5, 3), dtype=np.uint8))
    first.close()
    again = MetricsLogger(run_dir, tensorboard=False, wandb=True, wandb_project="p",
                          config=cfg.to_dict())
    again.close()
    a, b = fake_wandb.inits
    assert a["name"] == "sd3-t2i-lora-pickscore" and a["project"] == "p"
    assert a["resume"] == "allow" and a["id"] == b["id"] and len(a["id"]) == 8
    assert (run_dir / "wandb_run_id").read_text().strip() == a["id"]
    step, data = fake_wandb.logged[0]
    assert step == 3 and data["eval/samples"].data.shape == (4, 5, 3)
    named = load_config("tiny", ["logging.wandb_name=my run"]).to_dict()
    from trainer.wandb_run import run_name
    assert run_name(named) == "my run"
    assert run_name(load_config("tiny").to_dict()) == "tiny-toy-full-toycomposition"


@pytest.mark.slow
def test_tiny_run_writes_grids_curve_bars_and_wandb(fake_wandb, tmp_path, capsys):
    from trainer.config import load_config
    from trainer.loop import Trainer
    cfg = load_config("tiny", [f"logging.run_dir={tmp_path / 'run'}", "train.num_rollouts=2",
                               "data.eval_interval=1", "data.eval_max_prompts=2",
                               "logging.tensorboard=false", "logging.wandb=true",
                               "logging.train_samples=4", "rollout.write_artifacts=false"])
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        trainer.train()
    finally:
        trainer.close()
    run = tmp_path / "run"
    for name in ("eval/eval_step00000.png", "eval/eval_step00001.png",
                 "eval/eval_step00002.png", "train_samples/step00001.png",
                 "train_samples/step00002.png", "reward_curve.png"):
        assert (run / name).is_file(), name
    grid = np.asarray(Image.open(run / "train_samples/step00002.png"))
    assert grid.shape[1] == 4 * (128 + 4) + 4  # four captioned tiles in a row
    total, _ = reward_series([json.loads(x) for x in (run / "metrics.jsonl").read_text()
                              .splitlines()])
    assert [s for s, _ in total["eval"]] == [0, 1, 2] and [s for s, _ in total["train"]] == [1, 2]
    tags = {k for _, data in fake_wandb.logged for k in data}
    assert {"eval/samples", "train/samples", "reward_curve", "reward/mean"} <= tags
    err = capsys.readouterr().err
    assert "2/2" in err and "run" in err and "eval" in err


def test_real_wandb_offline_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from trainer.config import load_config
    from trainer.metrics import MetricsLogger
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config("tiny", [f"logging.run_dir={tmp_path}"])
    ids = []
    for step in (1, 2):
        logger = MetricsLogger(tmp_path, tensorboard=False, wandb=True, config=cfg.to_dict())
        ids.append(logger._wandb.id)
        assert logger._wandb.name == "tiny-toy-full-toycomposition"
        logger.log(step, {"reward/mean": 0.5}, console=False)
        logger.image("eval/samples", step, np.zeros((8, 8, 3), dtype=np.uint8))
        logger.close()
    assert ids[0] == ids[1] == (tmp_path / "wandb_run_id").read_text().strip()
