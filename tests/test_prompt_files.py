"""Prompt files as users bring them (.txt lists, GenEval's metadata.jsonl, JSONL with bad
lines), read by ``--prompt-data`` directly, by ``data prepare``, and checked in preflight
with every problem as ``file:line``; and one error for every problem of a launch."""
from __future__ import annotations

import json

import pytest

from trainer.config import ConfigError, load_config
from trainer.data.prepare import prepare
from trainer.data.prompt_files import PromptFileError, read_prompt_file
from trainer.preflight import preflight
from trainer.prompts import load_records

GENEVAL = [
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}],
     "prompt": "a photo of a bench"},
    {"tag": "counting", "include": [{"class": "cat", "count": 2}],
     "exclude": [{"class": "cat", "count": 3}], "prompt": "a photo of two cats"},
]


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_txt_prompt_file_loads_directly(tmp_path):
    path = _write(tmp_path / "prompts.txt", ["a red cube", "", "  a blue ball  ", "   "])
    records = load_records(str(path))
    assert [r["prompt"] for r in records] == ["a red cube", "a blue ball"]
    assert [r["metadata"]["sample_id"] for r in records] == ["prompts_0000000",
                                                             "prompts_0000001"]
    assert all(r["metadata"]["task"] == "t2i" for r in records)


def test_geneval_metadata_fields_are_kept_for_rewards(tmp_path):
    path = _write(tmp_path / "metadata.jsonl", [json.dumps(r) for r in GENEVAL])
    direct = load_records(str(path))
    assert direct[1]["prompt"] == "a photo of two cats"
    assert direct[1]["metadata"]["tag"] == "counting"
    assert direct[1]["metadata"]["include"] == [{"class": "cat", "count": 2}]
    assert direct[1]["metadata"]["exclude"] == [{"class": "cat", "count": 3}]
    out = tmp_path / "prepared.jsonl"
    assert prepare(source="prompts", input_path=str(path), output=str(out))["written"] == 2
    prepared = [json.loads(line) for line in out.read_text().splitlines()]
    assert prepared[1]["metadata"]["include"] == [{"class": "cat", "count": 2}]
    assert prepared[0]["metadata"]["tag"] == "single_object"
    assert load_records(str(out))[1]["metadata"]["exclude"] == [{"class": "cat", "count": 3}]
    txt = _write(tmp_path / "list.txt", ["one prompt", "two prompt"])
    assert prepare(source="prompts", input_path=str(txt),
                   output=str(tmp_path / "from_txt.jsonl"))["written"] == 2


def test_bad_lines_are_all_named_file_and_line_and_long_values_are_cut(tmp_path):
    huge = "word " * 40_000
    path = _write(tmp_path / "bad.jsonl", [
        json.dumps({"prompt": "fine"}),
        '{"prompt": "unterminated',
        json.dumps({"prompt": 7}),
        json.dumps({"prompt": huge, "metadata": "not an object " * 1000}),
        json.dumps(["a list"]),
    ])
    with pytest.raises(PromptFileError) as e:
        load_records(str(path))                         # not a bare JSONDecodeError
    msg = str(e.value)
    for line in (2, 3, 4, 5):
        assert f"{path}:{line}:" in msg
    assert f"{path}:1:" not in msg
    assert "invalid JSON" in msg and "characters)" in msg
    assert len(msg) < 2000, len(msg)


def test_empty_file_is_an_error_naming_it(tmp_path):
    path = _write(tmp_path / "empty.txt", ["", "  "])
    with pytest.raises(PromptFileError, match="empty.txt: holds no prompt"):
        read_prompt_file(path)


def _cfg(tmp_path, *sets):
    return load_config("toy", [f"logging.run_dir={tmp_path / 'run'}", *sets])


def test_preflight_parses_prompt_files_and_refuses_overlap(tmp_path):
    train = _write(tmp_path / "train.txt", ["a cat", "a dog", "a  bird"])
    evals = _write(tmp_path / "eval.jsonl", [json.dumps({"prompt": "a bird"}),
                                             json.dumps({"prompt": "a fish"})])
    empty = _write(tmp_path / "empty.jsonl", [])
    broken = _write(tmp_path / "broken.jsonl", ['{"prompt": "x"', json.dumps({"prompt": "y"})])
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, f"data.prompt_data={train}", f"data.eval_prompt_data={evals}"))
    msg = str(e.value)
    assert "1 of the 2 eval prompts are also training prompts" in msg
    assert f"{evals}:1 = {train}:3" in msg
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, f"data.prompt_data={empty}", f"data.eval_prompt_data={broken}"))
    msg = str(e.value)
    assert "data.prompt_data (--prompt-data)" in msg and "holds no prompt" in msg
    assert f"{broken}:1: invalid JSON" in msg
    preflight(_cfg(tmp_path, f"data.prompt_data={train}", "data.eval_prompt_data=none"))


def test_launch_reports_type_errors_with_every_later_problem(capsys):
    """A type error in one --set does not hide the other stages' problems: one error, exit 2,
    naming all of them."""
    from trainer.launch import main
    rc = main(["--config", "toy", "--set", "train.lr=fast", "--set",
               "rollout.n_samples_per_prompt=-1", "--set", "fsdp.trainable_mode=bogus",
               "--no-such-flag", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "train.lr: cannot parse 'fast' as float" in err
    assert "unknown argument '--no-such-flag'" in err
    assert "rollout.n_samples_per_prompt (--n-samples-per-prompt)=-1" in err
    assert "fsdp.trainable_mode (--fsdp-trainable-mode)='bogus'" in err
    assert err.count("invalid configuration") == 1


def _flow_grpo_folder(tmp_path, layout):
    folder = tmp_path / "dataset" / layout
    folder.mkdir(parents=True)
    if layout == "ocr":
        (folder / "train.txt").write_text('A sign reading "OPEN"\nA mug printed with "hi"\n')
        (folder / "test.txt").write_text('A banner that says "WELCOME"\n')
    else:
        (folder / "train_metadata.jsonl").write_text(json.dumps(GENEVAL[0]) + "\n")
        (folder / "test_metadata.jsonl").write_text(json.dumps(GENEVAL[1]) + "\n")
    return folder


@pytest.mark.parametrize("layout", ["ocr", "geneval"])
def test_a_flow_grpo_dataset_folder_is_prompt_data_and_keeps_its_split(tmp_path, layout):
    """``--prompt-data dataset/ocr`` was refused ("is not a file"); now it trains on the
    folder's train file and evaluates on its test file, unless eval data is given."""
    from trainer.launch import resolve
    folder = _flow_grpo_folder(tmp_path, layout)
    train_name, test_name = (("train.txt", "test.txt") if layout == "ocr"
                             else ("train_metadata.jsonl", "test_metadata.jsonl"))
    run = f"logging.run_dir={tmp_path / 'run'}"
    cfg, _ = resolve(["--config", "toy", "--set", run, "--prompt-data", str(folder)])
    assert cfg.data.prompt_data == str(folder / train_name)
    assert cfg.data.eval_prompt_data == str(folder / test_name)
    preflight(cfg)
    train, evals = load_records(cfg.data.prompt_data), load_records(cfg.data.eval_prompt_data)
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in evals)
    if layout == "geneval":
        assert evals[0]["metadata"]["include"] == [{"class": "cat", "count": 2}]
    other = _write(tmp_path / "held_out.txt", ["a lighthouse at dusk"])
    cfg, _ = resolve(["--config", "toy", "--set", run, "--prompt-data", str(folder),
                      "--eval-prompt-data", str(other)])
    assert (cfg.data.prompt_data, cfg.data.eval_prompt_data) == (str(folder / train_name),
                                                                 str(other))
    cfg, _ = resolve(["--config", "toy", "--set", run, "--set",
                      f"data.eval_prompt_data={folder}"])
    assert cfg.data.eval_prompt_data == str(folder / test_name)


def test_a_folder_that_is_no_dataset_folder_is_one_clear_error(tmp_path):
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "prompts.txt").write_text("a cat\n")
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, f"data.prompt_data={tmp_path / 'loose'}")
    assert "not a dataset folder: it needs train.txt + test.txt" in str(e.value)
    assert "prompts.txt" in str(e.value)


def test_launch_help_lists_the_prompt_formats(capsys):
    from trainer.launch import main
    with pytest.raises(SystemExit):
        main(["--config", "toy", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for words in (".txt", "GenEval", "metadata.jsonl", "parquet", "train.txt + test.txt"):
        assert words in out, words


def test_invalid_utf8_is_named_file_and_line_in_text_and_jsonl(tmp_path):
    """Issue 49: a byte that is not UTF-8 was reported as an offset into the file (or a read
    buffer); now as file:line with its column, every such line, the rest still checked."""
    txt = tmp_path / "bad.txt"
    txt.write_bytes(b"a red cube\nzwei B\xe4lle\nok\n\xff\xfe\n")
    with pytest.raises(PromptFileError) as e:
        load_records(str(txt))
    msg = str(e.value)
    assert f"{txt}:2: not UTF-8 text" in msg and "column 7" in msg and "0xe4" in msg
    assert f"{txt}:4: not UTF-8 text" in msg and f"{txt}:1:" not in msg
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n{"prompt": 3}\n')
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(tmp_path, f"data.prompt_data={jsonl}"))
    msg = str(e.value)
    assert f"{jsonl}:3: 'prompt' must be a non-empty string" in msg
    with pytest.raises(PromptFileError) as e:  # preflight's message cuts long paths
        load_records(str(jsonl))
    msg = str(e.value)
    assert f"{jsonl}:2: not UTF-8 text" in msg and "0xe9" in msg
    assert f"{jsonl}:3: 'prompt' must be a non-empty string" in msg


def test_training_prompts_are_held_as_offsets_not_records(tmp_path):
    """Issue 49: every rank held the whole prompt file as dicts (13x its size at 1M lines).
    Measured with tracemalloc on 20,000 JSONL lines: what the loop keeps (load_records) is a
    small fraction of the file, and of the old list of records; the records read back equal
    the eager reader's."""
    import tracemalloc
    from trainer.prompts import PromptSampler
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"a photo of {i} small red cubes on a table",
                                        "tag": "counting"}) + "\n" for i in range(20_000)))
    size = path.stat().st_size

    def retained(load):
        tracemalloc.start()
        held = load()
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return held, current, peak

    eager, eager_bytes, eager_peak = retained(lambda: read_prompt_file(path))
    lazy, lazy_bytes, lazy_peak = retained(lambda: load_records(str(path)))
    print(f"file {size} B; list of records {eager_bytes} B ({eager_bytes / size:.1f}x, peak "
          f"{eager_peak} B); offsets {lazy_bytes} B ({lazy_bytes / size:.2f}x, peak "
          f"{lazy_peak} B)")
    assert lazy_bytes < size / 2 and lazy_bytes * 10 < eager_bytes
    assert lazy_peak * 5 < eager_peak
    assert len(lazy) == len(eager) == 20_000
    assert [lazy[i] for i in (0, 7, 19_999, -1)] == [eager[i] for i in (0, 7, 19_999, -1)]
    assert lazy[5:8] == eager[5:8]
    sampler = PromptSampler(lazy, seed=3)
    assert sampler.groups_for_rollout(4, 8) == PromptSampler(eager, 3).groups_for_rollout(4, 8)
