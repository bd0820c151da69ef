"""perf/mfu/*: the peak table, the stage FLOPs (CFG doubling, 3x forward for training, the KL
and anchor forwards) and the loop's metrics of one real CPU step on the toy model."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer.compute import mfu
from trainer.models.geometry import Geometry


def test_peak_comes_from_the_device_name_the_override_wins_and_unknown_devices_give_none():
    assert mfu.peak_flops("NVIDIA H200") == 989e12
    assert mfu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert mfu.peak_flops("NVIDIA H100 PCIe") == 756e12  # not the SXM row
    assert mfu.peak_flops(None) is None and mfu.peak_flops("Some New GPU") is None
    assert mfu.peak_flops(None, override_tflops=2.0) == 2e12


class _Counted:
    """An adapter stand-in stating 10 linear + 1 attention FLOPs per sample (the real counts are
    tested in test_compute_flops.py; here only the stage arithmetic is)."""

    def forward_flops(self, geometry, *, batch, text_tokens):
        from trainer.compute.flops import FlopCount

        assert text_tokens == 7
        return FlopCount(10 * batch, 1 * batch)


def _batch(guidance):
    import torch

    conditions = {"prompt_embeds": torch.zeros(4, 7, 3)}
    if guidance != 1.0:
        conditions["neg:prompt_embeds"] = torch.zeros(4, 5, 3)
    return SimpleNamespace(sample_ids=list("abcd"), sde_indices=[1, 2], geometry=Geometry(8, 8),
                           guidance_scale=guidance, conditions=conditions)


def test_stage_flops_double_under_cfg_and_train_counts_three_forwards_plus_kl_and_anchors():
    plain = mfu.stage_flops(_Counted(), _batch(1.0), num_inference_steps=6, trained_rows_factor=0.0,
                            kl_reference=False)
    assert plain == {"rollout": 11 * 4 * 6, "train": 11 * 4 * 2 * 3}
    cfg = mfu.stage_flops(_Counted(), _batch(4.5), num_inference_steps=6,
                          trained_rows_factor=mfu.anchor_forwards("replay", 2), kl_reference=True)
    assert cfg == {"rollout": 2 * 11 * 4 * 6, "train": 2 * 11 * 4 * 2 * (3 + 1 + 0.5)}
    assert mfu.anchor_forwards("engine", 4) == 0.0 and mfu.anchor_forwards("replay", 1) == 0.0


def test_mfu_metrics_are_left_out_without_a_peak_and_divide_by_time_and_peak_with_one():
    flops = {"rollout": 6e12, "train": 3e12}
    assert mfu.mfu_metrics(flops, {"rollout": 1.0, "train": 1.0}, 3.0, None) == {}
    got = mfu.mfu_metrics(flops, {"rollout": 2.0, "train": 0.5}, 4.0, 10e12)
    assert got["perf/mfu/rollout"] == pytest.approx(0.3)
    assert got["perf/mfu/train"] == pytest.approx(0.6)
    assert got["perf/mfu/step"] == pytest.approx(9 / 40)


@pytest.mark.slow
@pytest.mark.parametrize("peak", [None, 1.0])
def test_a_cpu_step_logs_mfu_only_with_a_stated_peak_and_from_the_adapters_count(tmp_path, peak):
    from trainer.config import load_config
    from trainer.loop import Trainer

    sets = [f"logging.run_dir={tmp_path / 'run'}", "logging.progress=false",
            "logging.tensorboard=false", "train.num_rollouts=1", f"checkpoint.save={tmp_path / 'c'}"]
    if peak is not None:
        sets.append(f"logging.peak_tflops={peak}")
    cfg = load_config("tiny", sets)
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    seen = {}
    real = trainer.rollout
    trainer.rollout = lambda rid: seen.setdefault("batch", real(rid))
    try:
        metrics = trainer.train_step(0)
    finally:
        trainer.close()
    if peak is None:
        assert not any(k.startswith("perf/mfu/") for k in metrics)
        return
    batch = seen["batch"]
    one = trainer.adapter.forward_flops(batch.geometry, batch=1,
                                        text_tokens=batch.conditions["prompt_embeds"].shape[1]).total
    steps = cfg.rollout.sampling.num_inference_steps
    assert metrics["perf/mfu/rollout"] * metrics["perf/rollout_time"] * 1e12 == pytest.approx(
        one * len(batch.sample_ids) * steps)
    per_row = 3 + mfu.anchor_forwards(cfg.train.anchor, cfg.train.num_updates_per_batch)
    assert metrics["perf/mfu/train"] * metrics["perf/train_time"] * 1e12 == pytest.approx(
        one * len(batch.sample_ids) * len(batch.sde_indices) * per_row)
    assert 0 < metrics["perf/mfu/step"] < metrics["perf/mfu/rollout"] + metrics["perf/mfu/train"]


def test_bench_step_prints_the_stage_mfu_and_the_floors_own_mfu_beside_it():
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root / "bench"), str(root / "tests")]
    import bench_step

    stages = {"perf/mfu/train": 0.4, "perf/mfu/rollout": 0.3, "perf/train_time": 1.0}
    row = {"floor_ratio": 1.25, "anchor": "replay", "updates": 2.0}
    line = bench_step.mfu_line(row, stages)
    assert line[0] == str({"train": 0.4, "rollout": 0.3})
    assert line[1] == f"floor {0.4 * 1.25 * 3 / 3.5:.3f}"  # 3 forwards of 3.5 per transition
    assert bench_step.mfu_line({}, {"perf/train_time": 1.0})[0].startswith("n/a")
