"""``python -m trainer data prepare``: the pickapic and prompts converters."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.data.cli import main
from trainer.data.schema import TASKS, record_problems

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_tasks_mirror_the_adapter_contract():
    from trainer.models.base import GENERATION_TASKS
    assert TASKS == GENERATION_TASKS


def test_pickapic_reads_only_captions_across_sorted_shards(tmp_path):
    shards = tmp_path / "pickapic"
    shards.mkdir()
    # Pick-a-Pic shards carry image bytes next to the caption; only the caption is read.
    pq.write_table(pa.table({"caption": ["a cat in a hat", "", "  a dog  "],
                             "jpg_0": [b"\xff" * 10] * 3}), shards / "train-00001.parquet")
    pq.write_table(pa.table({"caption": ["an owl at night", None],
                             "jpg_0": [b"\x00" * 10] * 2}), shards / "train-00000.parquet")
    out = tmp_path / "raw.jsonl"
    assert main(["prepare", "--source", "pickapic", "--input", str(shards), "--task", "t2i",
                 "--output", str(out)]) == 0
    records = read_jsonl(out)
    assert records == [
        {"prompt": "an owl at night", "metadata": {"task": "t2i", "sample_id": "pickapic_0000001"}},
        {"prompt": "a cat in a hat", "metadata": {"task": "t2i", "sample_id": "pickapic_0000003"}},
        {"prompt": "a dog", "metadata": {"task": "t2i", "sample_id": "pickapic_0000005"}},
    ]  # ids count source rows (the empty ones too), so they point back at them
    assert all(record_problems(r) == [] for r in records)


@pytest.mark.parametrize("kind", ["parquet-prompt", "parquet-caption", "jsonl", "text"])
def test_prompts_converter_formats(tmp_path, kind):
    prompts = ["first prompt", "second prompt", "third prompt"]
    if kind.startswith("parquet"):
        src = tmp_path / "set.parquet"
        pq.write_table(pa.table({kind.split("-")[1]: prompts, "other": [1, 2, 3]}), src)
    elif kind == "jsonl":
        src = tmp_path / "set.jsonl"
        src.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts) + "\n")
    else:
        src = tmp_path / "set.txt"
        src.write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["prepare", "--source", "prompts", "--input", str(src), "--output", str(out)]) == 0
    records = read_jsonl(out)
    assert [r["prompt"] for r in records] == prompts
    assert [r["metadata"]["sample_id"] for r in records] == [f"set_000000{i}" for i in (1, 2, 3)]
    assert {r["metadata"]["task"] for r in records} == {"t2i"}


def test_prompts_jsonl_keeps_metadata_and_media(tmp_path):
    src = tmp_path / "edit.jsonl"
    src.write_text(json.dumps({"prompt": "<image> make it blue", "images": ["a.png"],
                               "metadata": {"sample_id": "mine_1", "style": "x"}}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["prepare", "--source", "prompts", "--input", str(src), "--output", str(out),
                 "--id-prefix", "p_"]) == 0
    assert read_jsonl(out) == [{"prompt": "<image> make it blue",
                                "metadata": {"sample_id": "mine_1", "style": "x", "task": "t2i"},
                                "images": ["a.png"]}]


def test_prepare_reports_every_bad_line_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "fine"}\n{not json\n{"caption": "no prompt"}\n'
                   '{"prompt": "x", "metadata": 3}\n')
    out = tmp_path / "out.jsonl"
    assert main(["prepare", "--source", "prompts", "--input", str(src), "--output", str(out)]) == 1
    err = capsys.readouterr().err
    # the trainer's own reader's messages: launch would refuse the same lines
    assert f"{src}:2: invalid JSON" in err and f"{src}:3: missing required key 'prompt'" in err \
        and f"{src}:4: 'metadata' must be an object, got 3" in err and "3 problem(s)" in err
    assert not out.exists()


def test_prepare_missing_column_and_input(tmp_path, capsys):
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["a"]}), src)
    assert main(["prepare", "--source", "prompts", "--input", str(src),
                 "--output", str(tmp_path / "o.jsonl")]) == 1
    assert "no column 'prompt / caption'" in capsys.readouterr().err
    assert main(["prepare", "--source", "pickapic", "--input", str(tmp_path / "nope"),
                 "--output", str(tmp_path / "o.jsonl")]) == 1
    assert "no such file or directory" in capsys.readouterr().err


def test_dispatcher_reaches_the_data_cli(tmp_path):
    src = tmp_path / "p.txt"
    src.write_text("one prompt\n")
    out = tmp_path / "o.jsonl"
    done = subprocess.run([sys.executable, "-m", "trainer", "data", "prepare", "--source",
                           "prompts", "--input", str(src), "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert read_jsonl(out)[0]["prompt"] == "one prompt"


def test_prepare_keeps_a_flow_grpo_dataset_folders_split(tmp_path, capsys):
    """A dataset folder (train.txt + test.txt) was merged into one file, losing its split."""
    folder = tmp_path / "ocr"
    folder.mkdir()
    (folder / "train.txt").write_text('A sign reading "OPEN"\n\nA mug printed with "hello"\n')
    (folder / "test.txt").write_text('A banner that says "WELCOME HOME"\n')
    out = tmp_path / "prepared"
    assert main(["prepare", "--source", "prompts", "--input", str(folder),
                 "--output", str(out)]) == 0
    train, test = read_jsonl(out / "train.jsonl"), read_jsonl(out / "test.jsonl")
    assert [r["prompt"] for r in train] == ['A sign reading "OPEN"', 'A mug printed with "hello"']
    assert [r["metadata"]["sample_id"] for r in train] == ["ocr_train_0000001",
                                                           "ocr_train_0000003"]
    assert test == [{"prompt": 'A banner that says "WELCOME HOME"',
                     "metadata": {"task": "t2i", "sample_id": "ocr_test_0000001"}}]
    assert main(["prepare", "--source", "prompts", "--input", str(folder),
                 "--output", str(tmp_path / "merged.jsonl")]) == 1
    assert "--output must be a folder" in capsys.readouterr().err
    assert main(["inspect", "--train", str(out)]) == 0  # the written folder is a dataset folder


def test_every_data_cli_option_is_documented():
    from trainer.data.cli import _parser
    parser = _parser()
    subparsers = next(a for a in parser._actions if a.choices and "prepare" in a.choices)
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, (name, action.option_strings)
        assert "txt" in sub.format_help() or name == "curate", name
