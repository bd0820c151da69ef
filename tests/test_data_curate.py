"""``python -m trainer data curate``: dedup, filters, deterministic hash split, named eval
subsets, media checks, and leak-free output (checked with inspect)."""
from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from trainer.data.cli import main
from trainer.data.inspect_data import inspect_files
from trainer.data.schema import split_key


def rec(prompt, sample_id, **extra):
    return {"prompt": prompt, "metadata": {"task": "t2i", "sample_id": sample_id}, **extra}


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def corpus(n=300):
    words = "red green blue small large cat dog owl fox in on the a garden city sky".split()
    return [rec(" ".join(words[(i * k) % len(words)] for k in range(1, 4 + i % 6)) + f" #{i}",
                f"pickapic_{i:07d}") for i in range(n)]


def test_pickapic_preset_files_split_and_nesting(tmp_path):
    raw = write(tmp_path / "raw.jsonl", corpus())
    out = tmp_path / "processed"
    assert main(["curate", "--input", raw, "--out-dir", str(out), "--prefix", "pickapic_",
                 "--min-prompt-words", "6", "--eval-size", "40", "--eval-subset-sizes", "8", "16",
                 "--no-check-media"]) == 0
    assert sorted(os.listdir(out)) == ["pickapic_eval.jsonl", "pickapic_eval16.jsonl",
                                       "pickapic_eval8.jsonl", "pickapic_train.jsonl"]
    train, evals = read(out / "pickapic_train.jsonl"), read(out / "pickapic_eval.jsonl")
    e8, e16 = read(out / "pickapic_eval8.jsonl"), read(out / "pickapic_eval16.jsonl")
    kept = [r for r in corpus() if len(r["prompt"].split()) >= 6]
    assert len(train) + len(evals) == len(kept) and len(evals) == 40
    assert (len(e8), len(e16)) == (8, 16)
    ids = lambda rs: [r["metadata"]["sample_id"] for r in rs]  # noqa: E731
    # eval = the 40 smallest sample_id hashes; subsets nested; input order kept in every file
    by_key = sorted(ids(kept), key=split_key)
    assert set(ids(evals)) == set(by_key[:40]) and set(ids(e8)) == set(by_key[:8])
    assert set(ids(e8)) < set(ids(e16)) < set(ids(evals))
    assert not set(ids(train)) & set(ids(evals))
    order = {s: i for i, s in enumerate(ids(kept))}
    for records in (train, evals, e8, e16):
        assert [order[s] for s in ids(records)] == sorted(order[s] for s in ids(records))
    findings, _ = inspect_files(train=str(out / "pickapic_train.jsonl"),
                                evals=[str(out / "pickapic_eval.jsonl"), str(out / "pickapic_eval16.jsonl")])
    assert findings == []


def test_rerun_and_reordered_input_give_identical_files(tmp_path):
    records = corpus(120)
    a = write(tmp_path / "a.jsonl", records)
    for run in ("one", "two"):
        assert main(["curate", "--input", a, "--out-dir", str(tmp_path / run),
                     "--eval-size", "12", "--eval-subset-sizes", "5", "--no-check-media"]) == 0
    for name in ("train.jsonl", "eval.jsonl", "eval5.jsonl"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    # the split depends on sample ids only, not on input order
    b = write(tmp_path / "b.jsonl", records[::-1])
    assert main(["curate", "--input", b, "--out-dir", str(tmp_path / "rev"), "--eval-size", "12",
                 "--no-check-media"]) == 0
    ids = lambda p: sorted(r["metadata"]["sample_id"] for r in read(p))  # noqa: E731
    assert ids(tmp_path / "rev" / "eval.jsonl") == ids(tmp_path / "one" / "eval.jsonl")
    # a different salt draws a different split
    assert main(["curate", "--input", a, "--out-dir", str(tmp_path / "salt"), "--eval-size", "12",
                 "--no-check-media", "--split-salt", "x"]) == 0
    assert ids(tmp_path / "salt" / "eval.jsonl") != ids(tmp_path / "one" / "eval.jsonl")


def test_fraction_split_without_prefix(tmp_path):
    records = corpus(400)
    raw = write(tmp_path / "raw.jsonl", records)
    assert main(["curate", "--input", raw, "--out-dir", str(tmp_path / "o"),
                 "--eval-fraction", "0.1", "--no-check-media"]) == 0
    assert sorted(os.listdir(tmp_path / "o")) == ["eval.jsonl", "train.jsonl"]
    evals = {r["metadata"]["sample_id"] for r in read(tmp_path / "o" / "eval.jsonl")}
    assert evals == {r["metadata"]["sample_id"] for r in records
                     if split_key(r["metadata"]["sample_id"]) < 0.1}
    assert 20 < len(evals) < 60


def test_dedup_by_content_and_media_check(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(media / "a.png")  # curate decodes images
    records = [
        rec("a  red panda in a teacup", "s1"),
        rec("a red panda in a teacup ", "s2"),            # same prompt up to whitespace
        rec("A red panda in a teacup", "s3"),             # case differs: kept
        rec("<image> make it blue", "s4", images=["media/a.png"]),
        rec("<image> make it blue", "s5", images=["media/../media/a.png"]),  # same file
        rec("<image> make it blue", "s6", images=["media/missing.png"]),
    ]
    raw = write(tmp_path / "raw.jsonl", records)
    out = tmp_path / "out"
    assert main(["curate", "--input", raw, "--out-dir", str(out), "--eval-size", "1"]) == 0
    kept = read(out / "train.jsonl") + read(out / "eval.jsonl")
    assert sorted(r["metadata"]["sample_id"] for r in kept) == ["s1", "s3", "s4"]
    with_media = next(r for r in kept if r["metadata"]["sample_id"] == "s4")
    assert with_media["images"] == [os.path.join("..", "media", "a.png")]  # relative to out/
    assert os.path.isfile(os.path.join(out, with_media["images"][0]))
    # --no-check-media keeps the record whose file is missing
    assert main(["curate", "--input", raw, "--out-dir", str(tmp_path / "o2"), "--eval-size", "1",
                 "--no-check-media"]) == 0
    kept = read(tmp_path / "o2" / "train.jsonl") + read(tmp_path / "o2" / "eval.jsonl")
    assert "s6" in {r["metadata"]["sample_id"] for r in kept}


def test_bad_records_fail_with_locations_and_nothing_is_written(tmp_path, capsys):
    raw = write(tmp_path / "raw.jsonl", [rec("fine prompt here", "s1"), {"prompt": "no meta"},
                                         rec("other prompt", "s1"), rec("x", "s2")])
    with open(raw, "a") as f:
        f.write("{broken\n")
    out = tmp_path / "out"
    assert main(["curate", "--input", raw, "--out-dir", str(out), "--no-check-media"]) == 1
    err = capsys.readouterr().err
    assert f"{raw}:2: missing required key 'metadata'" in err
    assert f"{raw}:3: sample_id 's1' already used by a different record at {raw}:1" in err
    assert f"{raw}:5: invalid JSON" in err and "3 bad record(s), nothing written" in err
    assert not out.exists()


def test_option_errors_are_reported_together(tmp_path, capsys):
    raw = write(tmp_path / "raw.jsonl", corpus(10))
    assert main(["curate", "--input", raw, str(tmp_path / "nope.jsonl"), "--out-dir",
                 str(tmp_path / "o"), "--eval-size", "4", "--eval-fraction", "0.5",
                 "--eval-subset-sizes", "2", "8", "--min-prompt-words", "-1"]) == 1
    err = capsys.readouterr().err
    for part in ("not both", "subset size 8 must be in [1, --eval-size]",
                 "--min-prompt-words -1", "nope.jsonl"):
        assert part in err
    assert main(["curate", "--input", raw, "--out-dir", str(tmp_path / "o"), "--eval-size", "10",
                 "--no-check-media"]) == 1
    assert "leaves no training records" in capsys.readouterr().err
