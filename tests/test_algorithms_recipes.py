"""Each one-GPU variant of a reference recipe (``*-1gpu``) is its parent in every key but
``launch.nproc`` and the run's paths, so that the two cannot drift apart. That every recipe,
these included, loads and passes the static preflight without a warning at its own launch
size is tests/test_preflight.py's test_shipped_recipes_load_and_pass."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "trainer" / "config"
                                  / "recipes").glob("*.toml"))
ONE_GPU = [name for name in RECIPES if name.endswith("-1gpu")]


def test_the_reference_recipes_each_have_a_one_gpu_variant():
    assert ONE_GPU == sorted(f"{n}-1gpu" for n in RECIPES
                             if n.startswith("sd3-flowgrpo") and not n.endswith("-1gpu"))


def _flat(cfg) -> dict:
    out = {}
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        if dataclasses.is_dataclass(value):
            for key, item in dataclasses.asdict(value).items():
                out[f"{section.name}.{key}"] = item
        else:
            out[section.name] = value
    return out


@pytest.mark.parametrize("name", ONE_GPU)
def test_a_one_gpu_variant_is_its_parent_on_one_rank(name):
    from trainer.config import load_config

    one, parent = _flat(load_config(name, [])), _flat(load_config(name[:-len("-1gpu")], []))
    differ = {k for k in one.keys() | parent.keys() if one.get(k) != parent.get(k)}
    assert differ == {"launch.nproc", "logging.run_dir", "checkpoint.save"}, differ
    assert (one["launch.nproc"], parent["launch.nproc"]) == (1, 8)
    assert one["rollout.global_batch_size"] == parent["rollout.global_batch_size"]
    assert one["logging.run_dir"] == parent["logging.run_dir"] + "-1gpu"
