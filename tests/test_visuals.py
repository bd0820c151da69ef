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
    top, bottom = img[:320], img[320:]
    for colour, panel in ((PALETTE[0], top), (PALETTE[1], bottom)):
        assert (np.abs(panel.astype(int) - colour).max(-1) < 8).sum() > 20, colour


def _curve_rows(steps=12):
    rows = []
    for s in range(steps):
        row = {"step": s, "reward/mean": 0.1 + 0.05 * s}
        for name, base in (("ocr", 0.2), ("pickscore", 0.6)):
            row.update({f"reward/{name}_mean": base + 0.02 * s, f"reward/{name}_std": 0.1,
                        f"reward/{name}_min": 0.0})
        if s % 4 == 0:
            row.update({"eval/reward_mean": 0.12 + 0.05 * s, "eval/ocr_mean": 0.25 + 0.02 * s,
                        "eval/pickscore_mean": 0.58 + 0.02 * s})
        rows.append(row)
    return rows


def test_reward_curve_has_ticks_gridlines_and_train_eval_styles_per_reward():
    """The curve had value labels at min and max only, no gridlines, and one legend colour
    for train and eval of the same reward."""
    from trainer.visuals import reward_figure
    fig = reward_figure(*reward_series(_curve_rows()))
    fig.canvas.draw() if hasattr(fig.canvas, "draw") else None
    top, bottom = fig.axes
    for ax in (top, bottom):
        assert all(line.get_visible() for line in ax.get_ygridlines())
        assert len(ax.get_ygridlines()) >= 4 and len(ax.get_xgridlines()) >= 4
        assert len([t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]) >= 4
    lines = {line.get_label(): line for line in bottom.get_lines()}
    assert set(lines) == {"train ocr", "eval ocr", "train pickscore", "eval pickscore"}
    legend = [t.get_text() for t in bottom.get_legend().get_texts()]
    assert sorted(legend) == sorted(lines)
    for name in ("ocr", "pickscore"):
        train, evals = lines[f"train {name}"], lines[f"eval {name}"]
        assert train.get_color() == evals.get_color()           # one colour per reward
        assert train.get_linestyle() != evals.get_linestyle()   # train and eval drawn apart
        assert evals.get_marker() == "o"
    assert lines["train ocr"].get_color() != lines["train pickscore"].get_color()
    assert {line.get_label() for line in top.get_lines()} == {"train (weighted)",
                                                             "eval (weighted)"}


OCR_PROMPT = ('A weathered wooden sign hanging above the door of a seaside bakery, hand '
              'painted letters reading "FRESH SOURDOUGH EVERY MORNING"')
GENEVAL_PROMPT = "a photo of a purple backpack and a yellow umbrella"


def test_captions_keep_the_quoted_text_and_every_object():
    """Captions were cut to three lines: OCR prompts lost the quoted text the reward reads,
    GenEval prompts their second object."""
    from trainer.visuals import caption_lines
    texts = captions([OCR_PROMPT, GENEVAL_PROMPT], [0.8125, 0.5])
    for text in texts:
        lines = caption_lines(text, 192)
        assert " ".join(lines) == text, lines           # whole: nothing cut
    assert "EVERY MORNING" in " ".join(caption_lines(texts[0], 192))
    toy = torch.full((2, 32, 32, 3), 90, dtype=torch.uint8)
    grid = captioned_grid(toy, texts, ncol=2)
    lines = caption_lines(texts[0], 192)
    strip = grid[4 + 192:, 4:4 + 192]
    assert strip.shape[0] >= len(lines) * 11
    last_line = strip[2 + (len(lines) - 1) * 11:2 + len(lines) * 13]
    assert (last_line < 128).any()                      # the last line is drawn, not cut
    cut = caption_lines("word " * 400, 192)
    assert cut[-1].endswith("\u2026")                    # only a caption too long to fit is cut


def test_training_grid_shows_several_prompts_not_one_groups_candidates():
    from trainer.visuals import pick_samples
    prompts = [p for p in ("a cat", "a dog", "a fox", "an owl") for _ in range(4)]
    picked = pick_samples(prompts, 8)
    assert picked == [0, 1, 4, 5, 8, 9, 12, 13]
    assert len({prompts[i] for i in pick_samples(prompts, 4)}) == 4
    assert pick_samples(prompts, 0) == [] and pick_samples(prompts, 99) == list(range(16))


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
    assert grid.shape[1] == 4 * (192 + 4) + 4  # four captioned tiles in a row
    total, _ = reward_series([json.loads(x) for x in (run / "metrics.jsonl").read_text()
                              .splitlines()])
    assert [s for s, _ in total["eval"]] == [0, 1, 2] and [s for s, _ in total["train"]] == [1, 2]
    tags = {k for _, data in fake_wandb.logged for k in data}
    assert {"eval/samples", "train/samples", "reward_curve", "reward/mean"} <= tags
    err = capsys.readouterr().err
    assert "2/2" in err and "run" in err and "eval" in err


def test_real_wandb_offline_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)
    from trainer.config import load_config
    from trainer.metrics import MetricsLogger
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "tiny"  # the run's name starts with its directory's
    cfg = load_config("tiny", [f"logging.run_dir={run_dir}"])
    ids = []
    for step in (1, 2):
        logger = MetricsLogger(run_dir, tensorboard=False, wandb=True, config=cfg.to_dict())
        ids.append(logger._wandb.id)
        assert logger._wandb.name == "tiny-toy-full-toycomposition"
        logger.log(step, {"reward/mean": 0.5}, console=False)
        logger.image("eval/samples", step, np.zeros((8, 8, 3), dtype=np.uint8))
        logger.close()
    assert ids[0] == ids[1] == (run_dir / "wandb_run_id").read_text().strip()


def test_wandb_gets_captioned_per_sample_images(fake_wandb, tmp_path):
    """W&B got one grid per step, the captions burnt into it."""
    from trainer.metrics import MetricsLogger
    from trainer.visuals import log_samples
    logger = MetricsLogger(tmp_path, tensorboard=False, wandb=True, config={})
    images = torch.zeros(3, 16, 16, 3, dtype=torch.uint8)
    prompts = [OCR_PROMPT, GENEVAL_PROMPT, "a cat"]
    log_samples(logger, "eval/samples", 4, images, prompts, [0.5, 0.25, 1.0],
                path=tmp_path / "eval" / "grid.png")
    logger.close()
    step, data = fake_wandb.logged[-1]
    assert step == 4 and isinstance(data["eval/samples"], list)
    shown = data["eval/samples"]
    assert [image.caption for image in shown] == captions(prompts, [0.5, 0.25, 1.0])
    assert all(image.data.shape == (16, 16, 3) for image in shown)
    assert (tmp_path / "eval" / "grid.png").is_file()


def test_real_wandb_offline_honours_wandb_dir_and_logs_captioned_samples(tmp_path, monkeypatch):
    """WANDB_DIR was ignored (W&B's files always went into the run directory)."""
    import wandb  # a test dependency: the W&B path is tested against the real package
    from trainer.metrics import MetricsLogger
    from trainer.visuals import log_samples
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "scratch"))
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, tensorboard=False, wandb=True, config={})
    images = torch.stack([torch.full((8, 8, 3), v, dtype=torch.uint8) for v in (0, 200)])
    log_samples(logger, "eval/samples", 1, images, [OCR_PROMPT, GENEVAL_PROMPT], [0.5, 0.25])
    logger.close()
    assert wandb.run is None
    offline = list((tmp_path / "scratch" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and not (run_dir / "wandb").exists()
    media = list(offline[0].rglob("media/images/eval/samples_*.png"))
    assert len(media) == 2, sorted(p.name for p in offline[0].rglob("*"))
