"""Config loading: precedence, coercion errors all at once, resolved round trip, recipe lookup."""
from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from trainer.config.sampling import SamplingConfig

from trainer.config import (Config, ConfigError, RECIPES_DIR, cli_flag, dump_toml, field_help,
                            flag_table, load_config, resolve_recipe, write_resolved)


def write(tmp_path, text: str, name: str = "recipe.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_without_recipe():
    assert load_config() == Config()


def test_precedence_defaults_toml_flags_set(tmp_path):
    recipe = write(tmp_path, """
[train]
lr = 1e-3
num_updates_per_batch = 4
[rollout]
rollout_batch_size = 6
n_samples_per_prompt = 3
""")
    cfg = load_config(recipe, overrides=["train.lr=5e-3"],
                      flags={"--lr": "2e-3", "--rollout-batch-size": "10"})
    assert cfg.train.lr == 5e-3                     # --set beats the flag and the file
    assert cfg.rollout.rollout_batch_size == 10     # the flag beats the file
    assert cfg.rollout.n_samples_per_prompt == 3    # the file beats the default
    assert cfg.train.num_updates_per_batch == 4
    assert cfg.train.eps_clip == Config().train.eps_clip  # untouched: the default
    # Each layer alone, so the order above is not an accident of one layer.
    assert load_config(recipe).train.lr == 1e-3
    assert load_config(recipe, flags={"--lr": "2e-3"}).train.lr == 2e-3


def test_partial_sampling_table_overrides_keys_not_the_dict(tmp_path):
    recipe = write(tmp_path, "[rollout.sampling]\nheight = 256\n")
    cfg = load_config(recipe, overrides=['rollout.sampling={"eta": 0.5}'],
                      flags={"--sampling-config": '{"width": 320}'})
    s = cfg.rollout.sampling
    assert (s.height, s.width, s.eta) == (256, 320, 0.5)
    assert s.sde_pool == Config().rollout.sampling.sde_pool
    assert isinstance(s, SamplingConfig)  # the section's own type, not a dict beside it


def test_unknown_sampling_keys_are_refused_where_they_are_set(tmp_path):
    recipe = write(tmp_path, "[rollout.sampling]\nsde_indice = [2]\nheight = 256\n")
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides=['rollout.sampling={"sigma_max": 1}',
                                       "rollout.sampling.eta=0.5"])
    assert info.value.problems == [
        f"{Path(recipe).name}:rollout.sampling: unknown sampling keys ['sde_indice'] (known: "
        f"{sorted(SamplingConfig.keys())})",
        f"--set rollout.sampling: unknown sampling keys ['sigma_max'] (known: "
        f"{sorted(SamplingConfig.keys())})"]


def test_cli_values_are_coerced_to_field_types():
    cfg = load_config(overrides=["fsdp.cpu_offload=yes", "train.lr_decay_iters=100",
                                 "lora.target_modules=[\"to_q\", \"to_k\"]",
                                 "data.eval_prompt_data=none", "checkpoint.save=None",
                                 "model.task=none", "train.eps_clip=1"])
    assert cfg.fsdp.cpu_offload is True
    assert cfg.train.lr_decay_iters == 100
    assert cfg.lora.target_modules == ["to_q", "to_k"]
    assert cfg.data.eval_prompt_data is None  # str | None: "none" unsets it
    assert cfg.checkpoint.save is None
    assert cfg.model.task == "none"           # plain str: kept as text
    assert cfg.train.eps_clip == 1.0 and isinstance(cfg.train.eps_clip, float)


def test_every_coercion_error_in_one_message(tmp_path):
    recipe = write(tmp_path, """
extra = 1
[train]
lr = "fast"
num_updates_per_batch = 2.5
bogus_key = 1
[fsdp]
cpu_offload = "maybe"
[nosuchsection]
x = 1
[rollout]
sampling = [1, 2]
sglang_urls = "http://a"
""")
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides=["train.seed=abc", "noequals", "lora.rank="],
                    flags={"--micro-batch-size": "two", "--no-such-flag": "1",
                           "--model-revision": "null", "--tensorboard": "perhaps"})
    problems = info.value.problems
    expected = [
        "top-level key 'extra' must be a [section]",
        "train.lr: cannot parse 'fast' as float",
        "train.num_updates_per_batch: expected an integer, got 2.5",
        "unknown key train.bogus_key",
        "fsdp.cpu_offload: expected a boolean, got 'maybe'",
        "unknown section [nosuchsection]",
        "rollout.sampling: expected a table/dict",
        "rollout.sglang_urls: cannot parse 'http://a' as list",
        "--set train.seed: cannot parse 'abc' as int",
        "--set 'noequals': expected section.key=value",
        "--set lora.rank: cannot parse '' as int",
        "--micro-batch-size: expected an integer or 'auto', got 'two'",
        "unknown flag --no-such-flag",
        "--tensorboard: expected a boolean, got 'perhaps'",
    ]
    for e in expected:
        assert any(e in p for p in problems), (e, problems)
    assert len(problems) == len(expected)  # --model-revision null is valid (str | None)
    assert str(info.value).count("\n  - ") == len(expected)


def test_toml_syntax_error_names_the_file(tmp_path):
    recipe = write(tmp_path, "[train\nlr = 1\n", name="broken.toml")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_config(recipe)


def _odd_config() -> Config:
    """Values that stress the TOML writer: Nones over non-None defaults, None inside a table,
    non-ASCII and quotes in strings, nested dicts, tiny floats."""
    return load_config("qwen-image-t2i-full", overrides=[
        "data.eval_prompt_data=none",
        'rollout.sampling={"sde_indices": null, "sde_resample_per_rollout": false, '
        '"sde_timestep_fraction": [0.1, 0.6]}',
        'model.model_path=/models/Qwen "Image" ✓',
        'model.adapter_options={"attention": {"backend": "sdpa", "window": [512, 1024]}}',
        "train.lr_decay_iters=1000", "train.adam_eps=1e-15", "checkpoint.load=/ckpt/dir",
        'lora.target_modules=["attn.to_q", "attn.to_k"]'])


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES_DIR.glob("*.toml")) + ["odd"])
def test_resolved_config_round_trips(name, tmp_path):
    cfg = _odd_config() if name == "odd" else load_config(name)
    text = dump_toml(cfg)
    tomllib.loads(text)  # valid TOML on its own
    again = load_config(write(tmp_path, text, name="resolved.toml"))
    assert again == cfg
    assert dump_toml(again) == text


def test_write_resolved_writes_toml_and_json(tmp_path):
    cfg = _odd_config()
    path = write_resolved(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.toml"
    assert load_config(str(path)) == cfg
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == cfg.to_dict()


def test_unknown_recipe_lists_the_shipped_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config("no-such-recipe")
    message = str(info.value)
    for shipped in ("tiny", "qwen-image-t2i-lora", "qwen-image-t2i-full", "sd3-t2i-lora",
                    "flux-t2i-lora"):
        assert shipped in message
    with pytest.raises(ConfigError, match="no such TOML file"):
        load_config(str(tmp_path / "missing.toml"))


def test_recipe_lookup_by_name_and_path(tmp_path):
    assert resolve_recipe("tiny") == RECIPES_DIR / "tiny.toml"
    own = write(tmp_path, "[train]\nlr = 0.5\n", name="mine.toml")
    assert load_config(own).train.lr == 0.5


def test_every_field_has_a_unique_alias_flag_and_a_docstring():
    table = flag_table()
    fields = [(s.name, f) for s in dataclasses.fields(Config)
              for f in dataclasses.fields(s.default_factory)]
    assert len(set(table.values())) == len(fields)
    for section, f in fields:  # a flag shared by two fields would map one of them wrongly
        assert f.metadata["doc"].strip() and f.metadata["flag"].startswith("--")
        assert table[f.metadata["flag"]] == (section, f.name)  # the short alias
        assert table[cli_flag(section, f.name)] == (section, f.name)  # the key's own flag
    # Short alias names where a key has one.
    for flag, target in {"--rollout-batch-size": ("rollout", "rollout_batch_size"),
                         "--n-samples-per-prompt": ("rollout", "n_samples_per_prompt"),
                         "--num-updates-per-batch": ("train", "num_updates_per_batch"),
                         "--eps-clip": ("train", "eps_clip"),
                         "--sampling-config": ("rollout", "sampling"),
                         "--lora-rank": ("lora", "rank"),
                         "--fsdp-master-dtype": ("fsdp", "master_dtype"),
                         "--reward-component-weights": ("reward", "component_weights"),
                         "--weight-sync-wire-dtype": ("weight_sync", "wire_dtype")}.items():
        assert table[flag] == target
    assert "--fsdp-trainable-mode" in field_help()


def test_a_later_layer_mends_an_earlier_sampling_table():
    """The loader stores each layer's sampling keys unchecked; preflight judges the final
    config (a table's step 0 is fine once a later --set clamps it)."""
    from trainer.preflight import preflight

    recipe = "tiny"
    cfg = load_config(recipe, overrides=['rollout.sampling={"sde_indices": [0, 2]}',
                                         "rollout.sampling.sigma_one=clamp_to_next"])
    assert cfg.rollout.sampling.sde_indices == (0, 2)
    assert preflight(cfg) == []
    bad = load_config(recipe, overrides=["rollout.sampling.height=-4"])
    assert bad.rollout.sampling.height == -4  # kept as given, judged once by preflight
    with pytest.raises(ConfigError) as info:
        preflight(bad)
    assert "rollout.sampling.height must be a positive integer, got -4 (--sampling-config)" \
        in info.value.problems
