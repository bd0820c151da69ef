"""``python -m trainer data inspect``: every error class, with file and line, non-zero exit."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from trainer.data.cli import main
from trainer.data.inspect_data import ERROR_CLASSES, inspect_files


def rec(prompt, sample_id, task="t2i", **extra):
    return {"prompt": prompt, "metadata": {"task": task, "sample_id": sample_id}, **extra}


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return str(path)


@pytest.fixture
def media(tmp_path):
    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "good.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a real video")
    return tmp_path


def test_clean_files_pass(tmp_path, media, capsys):
    train = write_lines(tmp_path / "train.jsonl",
                        [rec("a cat", "s1"), rec("<image> in blue", "s2", images=["good.png"])])
    evals = write_lines(tmp_path / "eval.jsonl", [rec("a dog", "s3")])
    assert main(["inspect", "--train", train, "--eval", evals, "--decode-media"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: 3 records in 2 file(s), 1 media entries")


def test_every_error_class_is_reported_with_its_line(tmp_path, media, capsys):
    train = write_lines(tmp_path / "train.jsonl", [
        rec("a cat on a mat", "t1"),                                   # 1
        "{oops",                                                       # 2 parse
        {"metadata": {"task": "t2i", "sample_id": "t3"}},              # 3 schema: no prompt
        rec("a dog", "t4", task="t2a"),                                # 4 task
        rec("two <image> <image>", "t5", images=["good.png"]),         # 5 placeholder
        rec("<image> x", "t6", images=["missing.png"]),                # 6 media
        rec("<image> y", "t7", images=["corrupt.png"]),                # 7 decode
        rec("a bird", "t1"),                                           # 8 duplicate_id
        {"prompt": "", "metadata": {"sample_id": 5}},                  # 9 schema x2 (the task
                                                                       # is filled, as launch does)
    ])
    evals = write_lines(tmp_path / "eval.jsonl", [
        rec("an owl", "t1"),                                           # 1 leak by id
        rec("a  cat on a mat", "e2"),                                  # 2 leak by content
        rec("a fresh prompt", "e3"),                                   # 3 fine
    ])
    assert main(["inspect", "--train", train, "--eval", evals, "--decode-media"]) == 1
    err = capsys.readouterr().err
    expected = [
        f"{train}:2: [parse] invalid JSON",
        f"{train}:3: [schema] missing required key 'prompt'",
        f"{train}:4: [task] unknown task 't2a'",
        f"{train}:5: [placeholder] 2 <image> placeholder(s) in the prompt but 1 entry in 'images'",
        f"{train}:6: [media] images entry 'missing.png': no file",
        f"{train}:7: [decode] cannot decode image",
        f"{train}:8: [duplicate_id] sample_id 't1' already at {train}:1",
        f"{train}:9: [schema] 'prompt' must be a non-empty string",
        f"{train}:9: [schema] 'metadata.sample_id' must be a non-empty string, got 5",
        f"{evals}:1: [leak] sample_id 't1' is also in train at {train}:1",
        f"{evals}:2: [leak] same prompt and media as the train record at {train}:1",
    ]
    for line in expected:
        assert line in err, line
    assert f"{evals}:3" not in err
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("FAILED: 11 error(s) (parse=1, schema=3, task=1, placeholder=1, "
                              "media=1, decode=1, duplicate_id=1, leak=2)")
    assert {f.kind for f in inspect_files(train=train, evals=[evals], decode_media=True)[0]} \
        == set(ERROR_CLASSES)


def test_decode_only_with_the_flag_and_video_without_decoder(tmp_path, media):
    train = write_lines(tmp_path / "t.jsonl", [rec("<image> a", "a", images=["corrupt.png"]),
                                               rec("<video> b", "b", videos=["clip.mp4"])])
    findings, _ = inspect_files(train=train)
    assert findings == []  # files exist; nothing decoded
    findings, _ = inspect_files(train=train, decode_media=True)
    kinds = [(f.where, f.kind) for f in findings]
    assert kinds == [(f"{train}:1", "decode"), (f"{train}:2", "decode")]
    assert "clip.mp4" in findings[1].message  # no decoder here, or a decoder that rejects it


def test_parquet_files_are_inspected_by_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["ok prompt", "bad task"],
                             "metadata": [json.dumps({"task": "t2i", "sample_id": "a"}),
                                          json.dumps({"task": "nope", "sample_id": "b"})]}), path)
    findings, stats = inspect_files(train=str(path))
    assert [str(f) for f in findings] == [
        f"{path}:2: [task] unknown task 'nope' (known: t2i, edit, t2v, i2v)"]
    assert stats["records"] == 2


def test_inspect_needs_a_file(capsys):
    assert main(["inspect"]) == 2
    assert "give --train and/or --eval" in capsys.readouterr().err


FLOW_GRPO_OCR = ['The word "Flow-GRPO" written on a chalkboard', 'A neon sign reading "OPEN 24/7"']
GENEVAL = [{"tag": "two_object", "include": [{"class": "cat", "count": 1},
                                             {"class": "dog", "count": 1}],
            "prompt": "a photo of a cat and a dog"},
           {"tag": "counting", "include": [{"class": "cup", "count": 3}],
            "prompt": "a photo of three cups"}]


def test_inspect_accepts_every_format_launch_trains_on(tmp_path, capsys):
    """.txt lists and GenEval's metadata.jsonl were refused on every line ("invalid JSON",
    "missing required key 'metadata'") although launch trains on both."""
    txt = tmp_path / "prompts.txt"
    txt.write_text("\n".join(FLOW_GRPO_OCR) + "\n\n")
    geneval = write_lines(tmp_path / "metadata.jsonl", GENEVAL)
    assert main(["inspect", "--train", str(txt), "--eval", geneval]) == 0
    assert capsys.readouterr().out.startswith("OK: 4 records in 2 file(s)")
    bad = write_lines(tmp_path / "bad_metadata.jsonl", [GENEVAL[0], {"tag": "x", "prompt": 3}])
    assert main(["inspect", "--train", bad]) == 1
    assert f"{bad}:2: [schema] 'prompt' must be a non-empty string" in capsys.readouterr().err


def test_inspect_takes_a_flow_grpo_dataset_folder_and_checks_its_split(tmp_path, capsys):
    folder = tmp_path / "ocr"
    folder.mkdir()
    (folder / "train.txt").write_text("\n".join(FLOW_GRPO_OCR) + "\n")
    (folder / "test.txt").write_text("A sign reading \"EXIT\"\n" + FLOW_GRPO_OCR[1] + "\n")
    assert main(["inspect", "--train", str(folder)]) == 1
    err = capsys.readouterr().err
    assert f"{folder}/test.txt:2: [leak] same prompt and media as the train record at " \
           f"{folder}/train.txt:2" in err
    (folder / "test.txt").write_text("A sign reading \"EXIT\"\n")
    assert main(["inspect", "--train", str(folder)]) == 0
    assert capsys.readouterr().out.startswith("OK: 3 records in 2 file(s)")
    (tmp_path / "loose").mkdir()
    assert main(["inspect", "--train", str(tmp_path / "loose")]) == 1
    assert "not a dataset folder: it needs train.txt + test.txt" in capsys.readouterr().err
