"""Checkpoint discovery, the COMMITTED marker, the base-model hash and the adapter contract
(no model, no training: files only)."""
import json
import logging

import pytest

from trainer.checkpoint import layout
from trainer.checkpoint.contract import base_model_hash, contract_mismatches


def fake_checkpoint(task_dir, n, *, commit=True, payload=b"x" * 100):
    d = task_dir / layout.iter_name(n)
    (d / layout.FSDP_DIR).mkdir(parents=True)
    (d / layout.FSDP_DIR / "__0_0.distcp").write_bytes(payload)
    (d / layout.TRAINER_STATE).write_text("{}")
    if commit:
        layout.write_commit_marker(d, n, 1)
    return d


def test_latest_committed_skips_uncommitted_and_damaged(tmp_path, caplog):
    task = tmp_path / "t2i"
    fake_checkpoint(task, 10)
    good = fake_checkpoint(task, 20)
    damaged = fake_checkpoint(task, 30)
    fake_checkpoint(task, 40, commit=False)
    (damaged / layout.FSDP_DIR / "__0_0.distcp").write_bytes(b"short")
    (task / ".trash-iter_0000050-1-2").mkdir()
    with caplog.at_level(logging.WARNING, "trainer.checkpoint"):
        assert layout.latest_committed(tmp_path) == good
    assert "iter_0000030" in caplog.text and "COMMITTED says 100" in caplog.text
    assert layout.latest_committed(task) == good          # the task dir works too
    assert layout.latest_committed(good) == good          # and an iter dir itself
    assert layout.latest_committed(task / "iter_0000040") is None
    assert [n for n, _ in layout.committed_iterations(task)] == [10, 20]
    assert layout.resolve_checkpoint(tmp_path, "t2i", iteration=10).name == "iter_0000010"


def test_resolve_explains_what_it_found(tmp_path):
    fake_checkpoint(tmp_path / "t2i", 5, commit=False)
    with pytest.raises(layout.CheckpointError) as e:
        layout.resolve_checkpoint(tmp_path, "t2i")
    assert "iter_0000005: no COMMITTED marker" in str(e.value)
    with pytest.raises(layout.CheckpointError, match="iteration 7 .* no such directory"):
        layout.resolve_checkpoint(tmp_path, "t2i", iteration=7)
    with pytest.raises(layout.CheckpointError, match="does not exist"):
        layout.resolve_checkpoint(tmp_path / "nowhere")


def test_rotation_plan(tmp_path):
    task = tmp_path / "t2i"
    for n in (1, 2, 3, 4):
        fake_checkpoint(task, n)
    fake_checkpoint(task, 5, commit=False)
    fake_checkpoint(task, 9)                    # a newer iteration of another timeline
    with pytest.raises(layout.CheckpointError, match=r"iter_0000009.*--overwrite"):
        layout.rotate(task, keep=3, new_iteration=6)
    assert [n for n, _ in layout.iteration_dirs(task)] == [1, 2, 3, 4, 5, 9]  # nothing deleted
    removed = layout.rotate(task, keep=3, new_iteration=6, overwrite=True)
    assert sorted(p.name for p in removed) == ["iter_0000001", "iter_0000002", "iter_0000005",
                                               "iter_0000009"]
    # iter_6: the directory about to be written, holding only this process's writer tag
    assert [n for n, _ in layout.iteration_dirs(task)] == [3, 4, 6]
    assert [p.name for p in (task / "iter_0000006").iterdir()] == [layout.WRITER_TAG]
    assert not [p for p in task.iterdir() if p.name.startswith(".trash-")]
    layout.rotate(task, keep=0, new_iteration=7)  # keep <= 0 keeps every committed one
    assert [n for n, _ in layout.iteration_dirs(task)] == [3, 4, 7]


def test_base_model_hash_is_content_not_location(tmp_path):
    a, b = tmp_path / "a" / "transformer", tmp_path / "b" / "transformer"
    for d in (a, b):
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"_class_name": "X"}))
        (d / "w.safetensors").write_bytes(bytes(range(256)) * 12_000)  # > 1 MiB: sampled
        (d / ".cache").mkdir()
        (d / ".cache" / "junk").write_text(str(d))   # hidden files do not count
    assert base_model_hash(tmp_path / "a") == base_model_hash(tmp_path / "b")
    assert base_model_hash(tmp_path / "a") == base_model_hash(a)
    assert base_model_hash(tmp_path / "a") != base_model_hash(tmp_path / "a", revision="v2")
    data = bytearray((b / "w.safetensors").read_bytes())
    data[10] ^= 1
    (b / "w.safetensors").write_bytes(bytes(data))
    assert base_model_hash(tmp_path / "a") != base_model_hash(tmp_path / "b")


def test_contract_mismatches_name_every_difference():
    saved = {"mode": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.0, "task": "t2i",
             "target_modules": ["to_q", "to_v"], "task_type": None,
             "base_model_hash": "sha256:aa", "base_model_path": "/m/a",
             "weight_sync_mode": "merge"}
    assert contract_mismatches(saved, dict(saved, weight_sync_mode="adapter")) == []
    current = dict(saved, alpha=16.0, target_modules=["to_q"], base_model_hash="sha256:bb",
                   base_model_path="/m/b")
    problems = contract_mismatches(saved, current)
    assert len(problems) == 3
    assert any(p.startswith("alpha: checkpoint has 8.0, current config has 16.0") and
               "silently rescales" in p for p in problems)
    assert any(p.startswith("target_modules") for p in problems)
    assert any(p.startswith("base_model_hash") and "/m/a" in p for p in problems)
    full = dict(saved, mode="full", rank=0, alpha=0.0, target_modules=None)
    # a full checkpoint carries every weight: a different base does not matter
    assert contract_mismatches(full, dict(full, base_model_hash="sha256:cc")) == []
    assert contract_mismatches(full, saved)[0].startswith("mode: checkpoint has 'full'")


def test_a_same_size_edit_between_samples_needs_the_full_base_hash(tmp_path):
    """What the sampled base hash guarantees and what not (README's fault table): an edit of
    bytes between its samples, size unchanged, is invisible to it; checkpoint.base_hash=full
    sees it. A contract recorded in one mode is checked in that mode (issue 49)."""
    from trainer.checkpoint.contract import base_hash_matches
    a, b = tmp_path / "a" / "transformer", tmp_path / "b" / "transformer"
    for d in (a, b):
        d.mkdir(parents=True)
        (d / "w.safetensors").write_bytes(bytes(range(256)) * 16_384)   # 4 MiB
    data = bytearray((b / "w.safetensors").read_bytes())
    gap = 64 << 10                                     # just past the first 64 KiB sample
    data[gap:gap + 4096] = bytes(x ^ 0xFF for x in data[gap:gap + 4096])  # one tensor's bytes
    (b / "w.safetensors").write_bytes(bytes(data))
    assert base_model_hash(a) == base_model_hash(b)                        # not guaranteed
    full_a = base_model_hash(a, full=True)
    assert full_a.startswith("sha256-full:") and full_a != base_model_hash(b, full=True)
    assert base_hash_matches(a, None, full_a) and not base_hash_matches(b, None, full_a)
    assert base_hash_matches(b, None, base_model_hash(a))                  # sampled: same
    saved = {"mode": "lora", "base_model_hash": full_a, "base_model_path": str(a)}
    assert contract_mismatches(saved, dict(saved, base_model_hash=base_model_hash(a))) == []
    edited = dict(saved, base_model_hash=base_model_hash(b), base_model_path=str(b))
    assert [p.split(":")[0] for p in contract_mismatches(saved, edited)] == ["base_model_hash"]
