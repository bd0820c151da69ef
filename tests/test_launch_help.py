"""Help and checks that tell the truth about the run being launched: ``--config X --help``
shows X's values, a hub id as ``--model-path`` is found in the local Hugging Face cache (or
the error says how to download it), and a CUDA recipe asks this machine for its GPUs."""
from __future__ import annotations

import json

import pytest

from trainer.launch import main, resolve


def _help(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _listed(text, key):
    line = next(line for line in text.splitlines() if line.strip().startswith(key + ":"))
    return line.split("=", 1)[1].strip()


def test_help_with_a_recipe_shows_its_values_as_the_defaults(capsys):
    """``launch --config sd3-t2i-lora --help`` listed the global defaults (toy adapter,
    rank 0), not the recipe's."""
    recipe, _ = resolve(["--config", "sd3-t2i-lora"])
    text = _help(capsys, "--config", "sd3-t2i-lora")
    assert _listed(text, "model.adapter_path") == \
        f"{recipe.model.adapter_path!r}  (recipe)"
    assert _listed(text, "lora.rank") == f"{recipe.lora.rank}  (recipe)"
    assert recipe.lora.rank > 0 and recipe.model.adapter_path != "trainer.toy.ToyAdapter"
    assert _listed(text, "launch.nproc") == "8  (recipe)"
    assert _listed(text, "launch.colocate") == "true"  # same as the built-in default: unmarked
    plain = _help(capsys, "--config=toy")
    assert "'trainer.models.sd3.SD3Adapter'" not in plain
    broken = _help(capsys, "--config", "no-such-recipe")
    assert "does not load, built-in defaults shown" in broken


def _fake_hub_cache(root, repo_id):
    """The layout huggingface_hub's own download writes (models--org--name/refs/main and
    snapshots/<commit>/), written by hand: no network here, and the lookup under test is
    huggingface_hub's, reading it."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text(json.dumps({"_class_name": "Pipeline"}))
    return snapshot


def test_a_hub_id_is_found_in_the_local_cache_or_the_error_says_how_to_get_it(
        tmp_path, monkeypatch, capsys):
    """A hub id as --model-path got "is not a directory" with no hint."""
    import huggingface_hub.constants as hub_constants
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo_id = "stabilityai/stable-diffusion-3.5-medium"
    argv = ["--config", "toy", "--set", f"logging.run_dir={tmp_path / 'run'}",
            "--model-path", repo_id, "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{repo_id}' is not a directory; it reads as a Hugging Face hub id" in err
    assert f"hf download {repo_id}" in err and f"huggingface-cli download {repo_id}" in err
    snapshot = _fake_hub_cache(tmp_path / "hub", repo_id)
    cfg, _ = resolve(argv)
    assert cfg.model.model_path == str(snapshot)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "local").mkdir()
    monkeypatch.chdir(tmp_path)  # a relative folder that reads like an id stays a folder
    assert resolve(["--config", "toy", "--model-path", "org/local"])[0].model.model_path \
        == "org/local"


def test_a_cuda_recipe_checks_the_gpus_of_the_machine_it_runs_on(tmp_path, capsys):
    """An 8-GPU CUDA recipe's --dry-run passed on a machine with no GPU."""
    import torch
    assert not torch.cuda.is_available()  # this test's premise: CI has no GPU
    folder = tmp_path / "ocr"
    folder.mkdir()
    (folder / "train.txt").write_text('A sign reading "OPEN"\n')
    (folder / "test.txt").write_text('A banner that says "HELLO"\n')
    (tmp_path / "model").mkdir()
    (tmp_path / "pickscore").mkdir()
    argv = ["--config", "sd3-t2i-lora", "--dry-run", "--model-path", str(tmp_path / "model"),
            "--reward-model-path", str(tmp_path / "pickscore"), "--prompt-data", str(folder),
            "--set", f"logging.run_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "launch.device='cuda' with launch.nproc (--nproc)=8 needs 8 CUDA GPUs" in err
    assert "this machine has no CUDA GPU" in err and "--set launch.device=cpu" in err
    assert err.count("\n  - ") == 1, err  # the recipe is otherwise fine: that is the reason


def test_the_gpu_rule_counts_the_gpus_it_is_given():
    from trainer.preflight.machine import device_problems
    assert device_problems(device="cuda", nproc=8, nproc_given=True, gpu_count=8) == []
    assert device_problems(device="cpu", nproc=8, nproc_given=True, gpu_count=0) == []
    [problem] = device_problems(device="cuda", nproc=8, nproc_given=True, gpu_count=4)
    assert "needs 8 CUDA GPUs on each node, and this machine has 4 visible CUDA GPU(s)" in problem
