"""Editing prompt records: reference images by path (relative to the prompt file) or inline
(base64 ``data:`` URIs), decoded lazily by PIL; read by the trainer's reader, checked by
``data inspect`` / ``data curate`` and by preflight (``file:line``), text-to-image unchanged."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainer.config import ConfigError, load_config
from trainer.data.cli import main
from trainer.data.prompt_files import read_numbered, read_prompt_file
from trainer.media import (ImageRef, MediaError, as_arrays, batch_sources, conditioning_images,
                           image_problem, inline_entry)
from trainer.preflight import preflight


def _png(path, colour=(200, 10, 10), size=(24, 16)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def _png_bytes(colour=(0, 0, 255), size=(12, 10)):
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_paths_resolve_against_the_prompt_file_and_inline_bytes_decode(tmp_path):
    _png(tmp_path / "data" / "src" / "001.png")
    inline = inline_entry(_png_bytes())
    path = _jsonl(tmp_path / "data" / "edits.jsonl", [
        {"prompt": "make the car blue", "images": ["src/001.png"],
         "metadata": {"sample_id": "e1"}},
        {"prompt": "combine <image> and <image>", "images": ["src/001.png", inline]},
        {"prompt": "a plain text-to-image prompt"}])
    records = read_prompt_file(path)
    first = conditioning_images(records[0])
    assert first == (ImageRef(str(tmp_path / "data" / "src" / "001.png")),)
    pixels = first[0].decode()
    assert pixels.dtype == np.uint8 and pixels.shape == (16, 24, 3)
    assert tuple(pixels[0, 0]) == (200, 10, 10)
    second = conditioning_images(records[1])
    assert len(second) == 2 and second[1].entry == inline
    assert second[1].decode().shape == (10, 12, 3)
    assert tuple(second[1].decode()[3, 3]) == (0, 0, 255)
    # text-to-image records are exactly what they were: no images key, no sources
    assert records[2] == {"prompt": "a plain text-to-image prompt",
                          "metadata": {"task": "t2i", "sample_id": "edits_0000002"}}
    assert conditioning_images(records[2]) == ()
    assert batch_sources([records[2]]) is None
    assert [len(s) for s in batch_sources(records)] == [1, 2, 0]


def test_image_ref_reports_missing_undecodable_and_too_small(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    _png(tmp_path / "tiny.png", size=(4, 30))
    assert "no file" in image_problem(ImageRef(str(tmp_path / "nope.png")))
    assert "does not decode" in image_problem(ImageRef(str(tmp_path / "bad.png")))
    assert "too small" in image_problem(ImageRef(str(tmp_path / "tiny.png")))
    assert "base64" in image_problem(ImageRef("data:image/png;base64,@@@"))
    assert "does not decode" in image_problem(ImageRef.from_bytes(b"\x89PNG broken"))
    assert image_problem(ImageRef.from_bytes(_png_bytes())) is None
    with pytest.raises(MediaError, match="uint8"):
        as_arrays([np.zeros((4, 4, 3), np.float32)])


def test_placeholders_are_optional_but_must_match_when_written(tmp_path):
    _png(tmp_path / "a.png")
    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "make it blue", "images": ["a.png"]},
        {"prompt": "<image> <image> make it blue", "images": ["a.png"]}])
    with pytest.raises(ValueError) as e:
        read_prompt_file(path)
    assert f"{path}:2: 2 <image> placeholder(s) in the prompt but 1 entry" in str(e.value)
    assert f"{path}:1" not in str(e.value)


def _cfg(tmp_path, *sets):
    return load_config("toy", [f"logging.run_dir={tmp_path / 'run'}", *sets])


def test_preflight_refuses_source_images_for_a_task_that_takes_none(tmp_path):
    _png(tmp_path / "ok.png")
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": "a cat"},
                                              {"prompt": "make it blue", "images": ["ok.png"]}])
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, f"data.prompt_data={train}", "data.eval_prompt_data=none"))
    assert (f"1 record(s) carry source images (first at {train}:2) but model.task='t2i' takes "
            f"no conditioning media") in str(e.value)


def test_preflight_names_every_missing_or_broken_source_as_file_line(tmp_path, monkeypatch):
    # t2i made a conditioned task here: the toy model (loaded by every other preflight check)
    # declares only t2i, and the media check is the same for every conditioned task
    monkeypatch.setattr("trainer.preflight.data_rules.CONDITIONED_TASKS", ("t2i",))
    _png(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    train = _jsonl(tmp_path / "train.jsonl", [
        {"prompt": "make it blue", "images": ["ok.png"]},
        {"prompt": "make it green", "images": ["gone.png"]},
        {"prompt": "make it pink", "images": ["ok.png", "broken.png"]},
        {"prompt": "make it grey", "images": ["data:image/png;base64,AAAA"]}])
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, f"data.prompt_data={train}", "data.eval_prompt_data=none"))
    msg = str(e.value)
    assert f"{train}:2: images[0]: no file {tmp_path / 'gone.png'}" in msg
    assert f"{train}:3: images[1]: {tmp_path / 'broken.png'} does not decode" in msg
    assert f"{train}:4: images[0]: inline image" in msg
    assert f"{train}:1" not in msg
    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": "make it blue", "images": ["ok.png"]}])
    preflight(_cfg(tmp_path, f"data.prompt_data={good}", "data.eval_prompt_data=none"))


def test_inspect_decodes_inline_always_and_checks_sizes_with_the_flag(tmp_path, capsys):
    _png(tmp_path / "ok.png")
    _png(tmp_path / "sliver.png", size=(3, 40))
    train = _jsonl(tmp_path / "train.jsonl", [
        {"prompt": "make it blue", "images": ["ok.png"], "metadata": {"sample_id": "a"}},
        {"prompt": "make it red", "images": [inline_entry(b"garbage")],
         "metadata": {"sample_id": "b"}},
        {"prompt": "make it gold", "images": ["sliver.png"], "metadata": {"sample_id": "c"}},
        {"prompt": "make it teal", "images": [inline_entry(_png_bytes())],
         "metadata": {"sample_id": "d"}}])
    assert main(["inspect", "--train", str(train)]) == 1
    out = capsys.readouterr()
    out = out.out + out.err
    assert f"{train}:2: [decode] images entry (inline): inline image" in out
    assert f"{train}:3:" not in out  # sizes only with --decode-media
    assert main(["inspect", "--train", str(train), "--decode-media"]) == 1
    out = capsys.readouterr()
    out = out.out + out.err
    assert f"{train}:3: [decode] images entry 'sliver.png':" in out and "too small" in out
    assert f"{train}:4:" not in out and f"{train}:1:" not in out


def test_curate_drops_undecodable_sources_keeps_inline_ones_and_splits(tmp_path):
    _png(tmp_path / "in" / "src" / "a.png")
    (tmp_path / "in" / "src" / "bad.png").write_bytes(b"nope")
    inline = inline_entry(_png_bytes())
    rows = [{"prompt": f"make object number {i} blue", "images": ["src/a.png"],
             "metadata": {"task": "t2i", "sample_id": f"s{i}"}} for i in range(6)]
    rows += [{"prompt": "make the broken one blue", "images": ["src/bad.png"],
              "metadata": {"task": "t2i", "sample_id": "bad"}},
             {"prompt": "make the inline one blue", "images": [inline],
              "metadata": {"task": "t2i", "sample_id": "inl"}}]
    src = _jsonl(tmp_path / "in" / "edits.jsonl", rows)
    out = tmp_path / "out"
    assert main(["curate", "--input", str(src), "--out-dir", str(out), "--eval-size", "2"]) == 0
    kept = [json.loads(line) for name in ("train.jsonl", "eval.jsonl")
            for line in (out / name).read_text().splitlines()]
    ids = {r["metadata"]["sample_id"] for r in kept}
    assert ids == {f"s{i}" for i in range(6)} | {"inl"}
    inl = next(r for r in kept if r["metadata"]["sample_id"] == "inl")
    assert inl["images"] == [inline]  # bytes are not a path: never rewritten
    # relocated paths still resolve from the output files, through the trainer's reader
    for name in ("train.jsonl", "eval.jsonl"):
        for _, record in read_numbered(out / name):
            assert all(image_problem(ref) is None for ref in conditioning_images(record))


def test_prepare_keeps_relative_sources_pointing_at_the_same_files(tmp_path):
    _png(tmp_path / "in" / "src" / "a.png")
    inline = inline_entry(_png_bytes())
    src = _jsonl(tmp_path / "in" / "edits.jsonl", [
        {"prompt": "make it blue", "images": ["src/a.png"]},
        {"prompt": "make it red", "images": [inline, str(tmp_path / "in" / "src" / "a.png")]}])
    out = tmp_path / "out" / "prepared.jsonl"
    assert main(["prepare", "--source", "prompts", "--input", str(src), "--output", str(out)]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written[0]["images"] == [str(Path("..") / "in" / "src" / "a.png")]
    assert written[1]["images"] == [inline, str(tmp_path / "in" / "src" / "a.png")]
    for _, record in read_numbered(out):
        assert all(image_problem(ref) is None for ref in conditioning_images(record))


def test_parquet_binary_image_columns_are_read_as_inline_images(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    jpeg = io.BytesIO()
    Image.new("RGB", (20, 10), (250, 0, 0)).save(jpeg, format="JPEG")
    table = pa.table({"prompt": ["make it blue"], "images": [[jpeg.getvalue()]]})
    pq.write_table(table, tmp_path / "edits.parquet")
    (record,) = read_prompt_file(tmp_path / "edits.parquet")
    (ref,) = conditioning_images(record)
    assert ref.entry.startswith("data:image/jpeg;base64,")
    pixels = ref.decode()
    assert pixels.shape == (10, 20, 3) and pixels[5, 10, 0] > 200 and pixels[5, 10, 2] < 60


def test_a_source_many_records_share_is_decoded_once(tmp_path, monkeypatch):
    from trainer import media
    _png(tmp_path / "shared.png")
    opened = []
    real_open = media.ImageRef.open
    monkeypatch.setattr(media.ImageRef, "open", lambda self: opened.append(self) or
                        real_open(self))
    seen = {}
    records = [{"prompt": f"edit {i}", "metadata": {}, "images": [str(tmp_path / "shared.png")]}
               for i in range(5)]
    assert all(media.record_media_problems(r, seen) == [] for r in records)
    assert len(opened) == 1
