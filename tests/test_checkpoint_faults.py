"""Checkpoint faults: content checksums and the fallback to the newest checkpoint that
verifies, damaged markers and sidecars, a disk that fills up during a save, rotation that
keeps another timeline's checkpoints, and metrics cut back at a resume.

CPU, the tiny ``nn.Module`` of test_checkpoint_harness (no engine, no rewards).
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import subprocess

import pytest
import torch

import test_checkpoint_harness as h
from trainer.checkpoint import layout, load_checkpoint, save_checkpoint


class Recorder:
    """The one MetricsLogger call a failed save makes."""

    def __init__(self):
        self.rows = []

    def log(self, step, metrics, console=True):
        self.rows.append((step, dict(metrics)))


@pytest.fixture
def model_dir(tmp_path):
    return h.save_tinynet(tmp_path / "model", dim=32)


def _two_saves(model_dir, root):
    trainer = h.make_trainer(model_dir, root, lora=False)
    weights = {}
    for step in (1, 2):
        h.train_step(trainer)
        weights[step] = h.trainable_weights(trainer)
        assert save_checkpoint(trainer, step) is not None
    return weights


def _shard(iter_dir):
    return sorted((iter_dir / layout.FSDP_DIR).glob("*.distcp"))[0]


def _assert_resumed_from(model_dir, root, weights, step, caplog, reason):
    fresh = h.make_trainer(model_dir, root, lora=False)
    with caplog.at_level(logging.WARNING, "trainer.checkpoint"):
        got = load_checkpoint(fresh, root)
    assert got.name == layout.iter_name(step)
    assert fresh.next_rollout == step
    for name, t in h.trainable_weights(fresh).items():
        assert torch.equal(t, weights[step][name]), name
    assert f"{layout.iter_name(step + 1)} skipped" in caplog.text and reason in caplog.text
    return fresh


def test_same_size_corruption_falls_back_to_the_previous_checkpoint(model_dir, tmp_path,
                                                                    caplog):
    root = tmp_path / "ckpt"
    weights = _two_saves(model_dir, root)
    newest = root / "t2i" / layout.iter_name(2)
    marker = json.loads((newest / layout.COMMITTED).read_text())
    assert all(e["hash"].startswith(("xxh3_128:", "sha256:")) for e in marker["files"].values())
    shard = _shard(newest)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64  # same size, other contents
    shard.write_bytes(bytes(data))
    assert layout.commit_problems(newest) == []             # sizes alone do not see it
    _assert_resumed_from(model_dir, root, weights, 1, caplog, "content checksum")
    # the rejected iteration is set aside, so the next save does not see another timeline
    assert [n for n, _ in layout.iteration_dirs(root / "t2i")] == [1]
    assert [p.name for p in (root / "t2i").glob("iter_0000002.rejected-*")]


@pytest.mark.parametrize("damage", ["trainer_state", "metadata", "no_marker", "bad_marker"])
def test_damaged_sidecars_and_markers_are_a_logged_fallback(model_dir, tmp_path, caplog,
                                                            damage):
    root = tmp_path / "ckpt"
    weights = _two_saves(model_dir, root)
    newest = root / "t2i" / layout.iter_name(2)
    if damage == "trainer_state":
        p = newest / layout.TRAINER_STATE
        p.write_bytes(b"\x00" * p.stat().st_size)
        reason = "trainer_state.json: content checksum"
    elif damage == "metadata":
        p = newest / layout.FSDP_DIR / ".metadata"
        p.write_bytes(os.urandom(p.stat().st_size))
        reason = "fsdp/.metadata: content checksum"
    elif damage == "no_marker":
        (newest / layout.COMMITTED).unlink()
        reason = "no COMMITTED marker"
    else:
        (newest / layout.COMMITTED).write_text("{not json")
        reason = "unreadable COMMITTED marker"
    _assert_resumed_from(model_dir, root, weights, 1, caplog, reason)


def test_format1_marker_without_checksums_still_catches_unparsable_sidecars(model_dir, tmp_path,
                                                                           caplog):
    """A marker written before checksums existed (sizes only): same-size garbage in the
    sidecars or the DCP metadata is still found by parsing them before anything loads."""
    root = tmp_path / "ckpt"
    weights = _two_saves(model_dir, root)
    newest = root / "t2i" / layout.iter_name(2)
    marker = json.loads((newest / layout.COMMITTED).read_text())
    marker["files"] = {k: v["size"] for k, v in marker["files"].items()}
    marker["format"] = 1
    (newest / layout.COMMITTED).write_text(json.dumps(marker))
    p = newest / layout.FSDP_DIR / ".metadata"
    p.write_bytes(b"\x00" * p.stat().st_size)
    _assert_resumed_from(model_dir, root, weights, 1, caplog, ".metadata does not load")


def test_nothing_verifies_is_one_error_naming_each_iteration(model_dir, tmp_path):
    root = tmp_path / "ckpt"
    _two_saves(model_dir, root)
    for n in (1, 2):
        (root / "t2i" / layout.iter_name(n) / layout.COMMITTED).unlink()
    with pytest.raises(layout.CheckpointError) as e:
        load_checkpoint(h.make_trainer(model_dir, root, lora=False), root)
    assert "iter_0000001: no COMMITTED" in str(e.value)
    assert "iter_0000002: no COMMITTED" in str(e.value)


def _fill_the_disk_unless(mounted: bool, monkeypatch) -> None:
    """From now on saves hit ENOSPC: the real tmpfs fills by itself; where mounting was refused,
    the DCP write raises it instead (the same path from there on)."""
    if mounted:
        return
    import trainer.checkpoint.save as save_mod

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "simulated")
    monkeypatch.setattr(save_mod, "write_shards", full)


@contextlib.contextmanager
def _small_disk(path, size: str):
    """A tmpfs of ``size`` at ``path`` (root only); yields False when mounting is refused."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def _saved_once_then_disk_full(tmp_path, monkeypatch):
    """A trainer that committed iteration 1 on a 2 MiB tmpfs (one checkpoint, ~1.2 MB, fits;
    two do not) and trained one more step: its next save hits ENOSPC. Yields (trainer, save
    root, model dir, the trainable weights of iteration 1)."""
    model_dir = h.save_tinynet(tmp_path / "model", dim=128)
    with _small_disk(tmp_path / "disk", "2m") as mounted:
        root = tmp_path / "disk" / "ckpt"
        trainer = h.make_trainer(model_dir, root, lora=False)
        trainer.metrics = Recorder()
        h.train_step(trainer)
        first = h.trainable_weights(trainer)
        assert save_checkpoint(trainer, 1) is not None
        _fill_the_disk_unless(mounted, monkeypatch)
        h.train_step(trainer)
        yield trainer, root, model_dir, first


def test_disk_full_save_is_counted_cleaned_and_training_continues(tmp_path, caplog,
                                                                  monkeypatch):
    """A 2 MiB tmpfs holds one checkpoint (~1.2 MB) but not two: the second save hits ENOSPC
    inside DCP (a CheckpointException, a BaseException): logged with the OS error, counted,
    its partial directory removed, and the first checkpoint still loads. Without permission
    to mount, ENOSPC is raised from the DCP write instead (same path from there on)."""
    with _saved_once_then_disk_full(tmp_path, monkeypatch) as (trainer, root, model_dir, first):
        with caplog.at_level(logging.WARNING, "trainer.checkpoint"):
            assert save_checkpoint(trainer, 2) is None      # no exception: training goes on
        assert "ENOSPC" in caplog.text and "No space left on device" in caplog.text
        assert trainer.checkpoint_failures == 1
        assert trainer.metrics.rows == [(2, {"train/checkpoint_failures": 1.0})]
        assert not (root / "t2i" / layout.iter_name(2)).exists()
        assert not [p for p in (root / "t2i").iterdir() if p.name.startswith(".trash")]
        h.train_step(trainer)                                # the run trains on
        fresh = h.make_trainer(model_dir, root, lora=False)
        assert load_checkpoint(fresh, root).name == layout.iter_name(1)
        for name, t in h.trainable_weights(fresh).items():
            assert torch.equal(t, first[name]), name


def test_failed_final_save_raises_naming_the_os_error(tmp_path, caplog, monkeypatch):
    """The run's final save hits ENOSPC on a 2 MiB tmpfs: no later save can retry it, so it
    raises CheckpointError naming the OS error and the newest committed checkpoint (after
    the same logging, counting and clean-up as any failed save)."""
    with _saved_once_then_disk_full(tmp_path, monkeypatch) as (trainer, root, _, _):
        with caplog.at_level(logging.WARNING, "trainer.checkpoint"):
            with pytest.raises(layout.CheckpointError) as e:
                save_checkpoint(trainer, 2, final=True)
        msg = str(e.value)
        assert "final checkpoint (step 2) was not saved" in msg
        assert "rank 0 (OSError ENOSPC: No space left on device" in msg
        assert f"newest committed checkpoint is {root / 't2i' / layout.iter_name(1)}" in msg
        assert "this was the run's final save" in caplog.text
        assert trainer.checkpoint_failures == 1
        assert trainer.metrics.rows == [(2, {"train/checkpoint_failures": 1.0})]
        assert not (root / "t2i" / layout.iter_name(2)).exists()


def test_rotation_keeps_another_timelines_checkpoints_unless_overwrite(model_dir, tmp_path,
                                                                       caplog):
    """A second run into the same --save without --load: its first save refuses to delete
    the first run's committed checkpoints; with --overwrite it replaces them, logged."""
    root = tmp_path / "ckpt"
    _two_saves(model_dir, root)
    again = h.make_trainer(model_dir, root, lora=False)
    h.train_step(again)
    with pytest.raises(layout.CheckpointError, match=r"\['iter_0000001', 'iter_0000002'\]"):
        save_checkpoint(again, 1)
    assert [n for n, _ in layout.committed_iterations(root / "t2i")] == [1, 2]
    told = h.make_trainer(model_dir, root, lora=False, extra=["checkpoint.overwrite=true"])
    h.train_step(told)
    with caplog.at_level(logging.WARNING, "trainer.checkpoint"):
        assert save_checkpoint(told, 1) is not None
    assert "deleting committed checkpoint" in caplog.text and "iter_0000002" in caplog.text
    assert [n for n, _ in layout.committed_iterations(root / "t2i")] == [1]


def test_resume_cuts_metrics_and_tensorboard_at_the_resumed_step(model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from trainer.metrics import MetricsLogger
    root = tmp_path / "ckpt"
    run = tmp_path / "run"
    trainer = h.make_trainer(model_dir, root, lora=False)
    trainer.metrics = MetricsLogger(run, tensorboard=True)
    for step in range(1, 6):
        h.train_step(trainer)
        trainer.metrics.log(step, {"x": float(step)}, console=False)
        if step == 3:
            assert save_checkpoint(trainer, 3) is not None
    trainer.metrics.close()
    fresh = h.make_trainer(model_dir, root, lora=False)
    fresh.metrics = MetricsLogger(run, tensorboard=True)
    load_checkpoint(fresh, root)
    for step in (4, 5):
        fresh.metrics.log(step, {"x": 10.0 * step}, console=False)
    fresh.metrics.close()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["x"] for r in rows] == [1.0, 2.0, 3.0, 40.0, 50.0]
    acc = EventAccumulator(str(run / "tensorboard"), purge_orphaned_data=True)
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("x")] == \
        [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_export_verifies_checkpoint_contents(model_dir, tmp_path, caplog):
    """export resolves like --load: a corrupted newest iteration is passed over (logged),
    and an explicitly requested corrupted one is refused with the reason."""
    from trainer.checkpoint.export import ExportError, plan_export
    root = tmp_path / "ckpt"
    _two_saves(model_dir, root)
    shard = _shard(root / "t2i" / layout.iter_name(2))
    data = bytearray(shard.read_bytes())
    data[100:116] = bytes(b ^ 0xFF for b in data[100:116])
    shard.write_bytes(bytes(data))
    base = tmp_path / "base" / "transformer"  # plan_export reads only the class name
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"_class_name": "TinyNet"}))
    with caplog.at_level(logging.WARNING, "trainer.checkpoint"):
        plan = plan_export(root, tmp_path / "out", base_model_path=base.parent)
    assert plan.iter_dir.name == layout.iter_name(1)
    assert "iter_0000002 skipped" in caplog.text and "content checksum" in caplog.text
    with pytest.raises(ExportError, match="iteration 2 .* content checksum"):
        plan_export(root, tmp_path / "out", iteration=2, base_model_path=base.parent)


def test_a_shard_removed_from_the_marker_is_not_verified_or_exported(model_dir, tmp_path,
                                                                     caplog):
    """COMMITTED edited to drop a shard's entry, then that shard corrupted: the file on disk
    the marker does not list makes the iteration untrusted, so export falls back to the
    previous one and refuses the explicit request (issue 49: it exported as "verified")."""
    from trainer.checkpoint.export import ExportError, plan_export
    root = tmp_path / "ckpt"
    _two_saves(model_dir, root)
    newest = root / "t2i" / layout.iter_name(2)
    shard = _shard(newest)
    marker = json.loads((newest / layout.COMMITTED).read_text())
    del marker["files"][shard.relative_to(newest).as_posix()]
    (newest / layout.COMMITTED).write_text(json.dumps(marker))
    data = bytearray(shard.read_bytes())
    data[100:116] = bytes(b ^ 0xFF for b in data[100:116])
    shard.write_bytes(bytes(data))
    assert any("COMMITTED does not list" in p for p in layout.commit_problems(newest))
    base = tmp_path / "base" / "transformer"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"_class_name": "TinyNet"}))
    with caplog.at_level(logging.WARNING, "trainer.checkpoint"):
        plan = plan_export(root, tmp_path / "out", base_model_path=base.parent)
    assert plan.iter_dir.name == layout.iter_name(1)
    with pytest.raises(ExportError, match="iteration 2 .*does not list"):
        plan_export(root, tmp_path / "out", iteration=2, base_model_path=base.parent)
