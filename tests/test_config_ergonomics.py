"""Config from the command line: nested --set into tables, global_batch_size re-derived when
a factor changes, every key's own flag (old names as aliases), --help with type and default
of every field."""
from __future__ import annotations

import dataclasses

import pytest

from trainer.config import Config, ConfigError, cli_flag, load_config
from trainer.config.sections import _field_types, _type_name
from trainer.config.overrides import default_text
from trainer.launch import parse_args, resolve
from trainer.preflight import preflight


def test_nested_set_reaches_every_table():
    cfg = load_config("tiny", ["rollout.sampling.height=64", "rollout.sampling.sde_type=dance",
                               "reward.scorers.ocr.weight=0.5",
                               "reward.scorers.ocr.engine=pkg.make_ocr",
                               'model.adapter_options.extra={"a": [1, 2]}'])
    s = cfg.rollout.sampling
    assert (s.height, s.width, s.sde_type, s.num_inference_steps) == \
        (64, 32, "dance", 8)  # the rest of the recipe's table is kept
    assert cfg.reward.scorers == {"ocr": {"weight": 0.5, "engine": "pkg.make_ocr"}}
    assert cfg.model.adapter_options == {"extra": {"a": [1, 2]}}
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["train.lr.x=1", "rollout.nope.a=1", "rollout.sampling.height.x=2"])
    message = str(err.value)
    assert "train.lr is not a table" in message and "unknown key rollout.nope" in message
    assert "'height' holds 32, not a table" in message


def test_global_batch_size_follows_changed_factors():
    cfg, _ = resolve(["--config", "tiny", "--rollout-batch-size", "4"])
    assert cfg.rollout.global_batch_size == 16
    preflight(cfg, world_size=1)
    cfg = load_config("tiny", ["rollout.n_samples_per_prompt=2"])
    assert cfg.rollout.global_batch_size == 4
    stated = load_config("tiny", ["rollout.n_samples_per_prompt=2",
                                  "rollout.global_batch_size=8"])
    with pytest.raises(ConfigError, match="global_batch_size"):
        preflight(stated, world_size=1)  # given on the command line: checked, not overridden
    assert load_config("tiny").rollout.global_batch_size == 8
    either_order = load_config("tiny", ["rollout.global_batch_size=8",
                                        "rollout.n_samples_per_prompt=2"])
    assert either_order.rollout.global_batch_size == 8
    assert load_config() == load_config(None, ["rollout.rollout_batch_size=4"])  # None stays


def test_each_key_has_its_own_flag_and_old_names_still_work():
    assert cli_flag("train", "num_rollouts") == "--train-num-rollouts"
    assert cli_flag("rollout", "rollout_batch_size") == "--rollout-batch-size"
    assert cli_flag("model", "model_path") == "--model-path"
    new, _ = resolve(["--config", "tiny", "--train-num-rollouts", "5", "--lora-rank=4",
                      "--logging-wandb"])
    old, _ = resolve(["--config", "tiny", "--num-rollout", "5", "--lora-rank", "4",
                      "--use-wandb"])
    assert new == old and new.train.num_rollouts == 5 and new.logging.wandb is True
    with pytest.raises(ConfigError, match="unknown argument '--num-rollots'"):
        parse_args(["--config", "tiny", "--num-rollots", "5"])


def test_help_shows_type_default_and_flags_of_every_field(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for section in dataclasses.fields(Config):
        cls = section.default_factory
        hints = _field_types(cls)
        for f in dataclasses.fields(cls):
            default = default_text(f)
            head = f"{section.name}.{f.name}: {_type_name(hints[f.name])} = "
            assert head + (default if len(default) <= 60 else default[:57]) in out, head
            assert cli_flag(section.name, f.name) in out and f.metadata["flag"] in out
    assert "train.num_rollouts: int = 10" in out
    assert "--train-num-rollouts (alias --num-rollout)" in out
    assert "--set rollout.sampling.height=512" in out
