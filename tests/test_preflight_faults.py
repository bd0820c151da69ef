"""Preflight cases of issue 49 ("nothing lost", second pass): what used to pass preflight and
fail later, or with a raw traceback: a non-finite number in a recipe, prompts longer than the
toy model's text window, a run dir under a regular file."""
from __future__ import annotations

import pytest

from trainer.config import ConfigError, load_config
from trainer.config.load import RECIPES_DIR
from trainer.preflight import preflight


def _recipe_with(tmp_path, line: str, replaces: str):
    """The shipped toy recipe with one line replaced (TOML reads ``inf`` and ``nan``: a
    --set or a flag refuses them at parse time, a recipe file does not)."""
    text = (RECIPES_DIR / "toy.toml").read_text()
    lines = text.splitlines()
    hits = [i for i, l in enumerate(lines) if l.split("#")[0].strip().startswith(replaces)]
    assert hits, replaces
    lines[hits[0]] = line
    path = tmp_path / "recipe.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("line,key", [("lr = inf", "train.lr (--lr)=inf"),
                                      ("lr = nan", "train.lr (--lr)=nan")])
def test_a_non_finite_number_in_a_recipe_is_refused_naming_the_key(tmp_path, line, key):
    cfg = load_config(_recipe_with(tmp_path, line, "lr ="),
                      [f"logging.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert sum(key in p for p in e.value.problems) == 1, e.value.problems


def test_a_nan_that_passes_every_range_rule_is_refused(tmp_path):
    """lora.alpha = nan passes "alpha >= 0"'s own rule (nan < 0 is False)."""
    cfg = load_config("toy", [f"logging.run_dir={tmp_path / 'run'}"])
    object.__setattr__(cfg.lora, "alpha", float("nan"))
    with pytest.raises(ConfigError, match=r"lora.alpha \(--lora-alpha\)=nan must be a finite"):
        preflight(cfg)


def test_prompts_longer_than_the_toy_text_window_are_named_file_and_line(tmp_path):
    """The toy adapter refuses a prompt longer than its text window at the first generate;
    preflight now names each such line, counting tokens as the adapter's tokenizer does."""
    from trainer.toy import weights_dir
    from trainer.toy.adapter import ToyAdapter
    long = "a red cube and a blue ball left of a green cone above a yellow sphere"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"a red cube\n{long}\na blue ball\n{long} twice\n")
    cfg = load_config("toy", [f"logging.run_dir={tmp_path / 'run'}",
                              f"data.prompt_data={prompts}", "data.eval_prompt_data=none"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    msg = str(e.value)
    assert f"{prompts}:2: the prompt has" in msg and f"{prompts}:4: the prompt has" in msg
    assert f"{prompts}:1:" not in msg and f"{prompts}:3:" not in msg
    adapter = ToyAdapter(weights_dir())              # the adapter's own count agrees
    tokenizer = adapter._load_tokenizer("tokenizer")
    adapter.tokenize(tokenizer, ["a red cube", "a blue ball"])
    with pytest.raises(ValueError, match="longer than 12 tokens"):
        adapter.tokenize(tokenizer, [long])
    n = len(tokenizer([long], truncation=False)["input_ids"][0])
    assert f"has {n} tokens" in msg


def test_a_run_dir_under_a_regular_file_is_one_config_error(tmp_path, capsys):
    """run_dir inside a file: launch exits 2 with one error naming it, no traceback."""
    from trainer.launch import main
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    rc = main(["--config", "toy", "--set", f"logging.run_dir={blocker / 'run'}",
               "--set", f"checkpoint.save={blocker / 'ckpt'}", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"logging.run_dir (--run-dir)='{blocker / 'run'}' cannot be created: {blocker} is " \
           f"a file" in err
    assert "checkpoint.save (--save)" in err and "Traceback" not in err
