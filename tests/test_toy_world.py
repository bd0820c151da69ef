"""The toy world: grammar round trip, split disjointness, seeded determinism, the renderer."""
from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.toy import world


def test_every_spec_round_trips_through_its_prompt():
    specs = world.all_specs()
    assert len(specs) == 36 + 36 * 27 * 4
    prompts = [world.spec_to_prompt(s) for s in specs]
    assert len(set(prompts)) == len(prompts)
    for spec, prompt in zip(specs, prompts):
        assert world.parse_prompt(prompt) == spec
        assert world.validate_spec(spec) == []
        assert set(prompt.split()) <= set(world.vocabulary())


def test_grammar_covers_counts_colours_shapes_relations():
    specs = world.all_specs()
    groups = [g for s in specs for g in s["objects"]]
    assert {g["count"] for g in groups} == {1, 2, 3}
    assert {g["color"] for g in groups} == set(world.COLORS) and len(world.COLORS) in (3, 4)
    assert {g["shape"] for g in groups} == set(world.SHAPES) and len(world.SHAPES) in (2, 3)
    assert {s["relation"] for s in specs} == {None, *world.RELATIONS}
    assert world.parse_prompt("two red circles left of a blue square") == {
        "objects": [{"count": 2, "color": "red", "shape": "circle"},
                    {"count": 1, "color": "blue", "shape": "square"}],
        "relation": "left of"}


@pytest.mark.parametrize("bad", ["two red circle", "a red circles", "four red circles",
                                 "a purple circle", "a red circle left of a red square",
                                 "a red circle near a blue square", ""])
def test_parse_prompt_rejects_text_outside_the_grammar(bad):
    with pytest.raises(ValueError, match="not a toy-world prompt"):
        world.parse_prompt(bad)


def test_validate_spec_names_every_problem_at_once():
    problems = world.validate_spec({"objects": [{"count": 5, "color": "pink", "shape": "star"},
                                                {"count": 1, "color": "red", "shape": "circle"}],
                                    "relation": "near"})
    text = " ".join(problems)
    for needle in ("count=5", "color='pink'", "shape='star'", "relation='near'"):
        assert needle in text
    same = world.validate_spec({"objects": [{"count": 1, "color": "red", "shape": "circle"}] * 2,
                                "relation": "above"})
    assert any("different colours" in p for p in same)


def test_train_and_eval_splits_are_disjoint_and_cover_the_world():
    train = [world.spec_to_prompt(s) for part in world.split_specs("train") for s in part]
    evals = [world.spec_to_prompt(s) for part in world.split_specs("eval") for s in part]
    assert not set(train) & set(evals)
    assert len(train) + len(evals) == len(world.all_specs())
    # both kinds of prompt are held out, and the held-out share is near EVAL_FRACTION
    assert all(len(part) > 0 for part in world.split_specs("eval"))
    assert abs(len(evals) / len(world.all_specs()) - world.EVAL_FRACTION) < 0.03
    rec_train = {r["prompt"] for r in world.make_prompt_records(500, seed=1, split="train")}
    rec_eval = {r["prompt"] for r in world.make_prompt_records(500, seed=1, split="eval")}
    assert rec_train <= set(train) and rec_eval <= set(evals)
    with pytest.raises(ValueError, match="split"):
        world.make_prompt_records(3, seed=0, split="test")


def test_records_are_deterministic_per_seed_and_follow_the_schema():
    a = world.make_prompt_records(64, seed=7, split="train")
    assert a == world.make_prompt_records(64, seed=7, split="train")
    assert [r["prompt"] for r in a] != [r["prompt"] for r in
                                        world.make_prompt_records(64, seed=8, split="train")]
    # a longer list extends a shorter one: record i depends on (seed, split, i) only
    assert world.make_prompt_records(80, seed=7, split="train")[:64] == a
    ids = [r["metadata"]["sample_id"] for r in a]
    assert len(set(ids)) == len(ids)
    for r in a:
        assert set(r) == {"prompt", "metadata"}
        assert r["metadata"]["task"] == "t2i"
        assert world.parse_prompt(r["prompt"]) == r["metadata"]["spec"]
        assert json.loads(json.dumps(r)) == r   # one JSONL line
    n_single = sum(r["metadata"]["spec"]["relation"] is None for r in a)
    assert 0 < n_single < len(a)
    # a small eval set has no repeated prompt until its pool of a kind runs out
    ev = [r["prompt"] for r in world.make_prompt_records(40, seed=0, split="eval")
          if r["metadata"]["spec"]["relation"] is not None]
    assert len(set(ev)) == len(ev)


def test_render_is_seeded_and_draws_the_requested_palette():
    spec = world.parse_prompt("three green triangles below two yellow circles")
    a = world.render(spec, 32, np.random.default_rng(5))
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, world.render(spec, 32, np.random.default_rng(5)))
    assert not np.array_equal(a, world.render(spec, 32, np.random.default_rng(6)))
    colors = a.reshape(-1, 3).astype(int)
    lit = colors[colors.sum(1) > 120]
    palette = np.array([world.COLORS["green"], world.COLORS["yellow"], world.COLORS["red"],
                        world.COLORS["blue"]])
    nearest = np.argmin(((lit[:, None] - palette[None]) ** 2).sum(-1), axis=1)
    assert set(nearest.tolist()) == {0, 1}     # green and yellow only
    assert (colors.sum(1) == 0).mean() > 0.5   # mostly background


def test_render_places_groups_on_the_named_side():
    for rel in world.RELATIONS:
        spec = {"objects": [{"count": 2, "color": "red", "shape": "square"},
                            {"count": 3, "color": "blue", "shape": "circle"}], "relation": rel}
        for seed in range(5):
            img = world.render(spec, 32, np.random.default_rng(seed)).astype(int)
            red = np.argwhere((img[..., 0] > 150) & (img[..., 2] < 100))
            blue = np.argwhere((img[..., 2] > 150) & (img[..., 0] < 100))
            axis = 1 if rel in ("left of", "right of") else 0
            if rel in ("left of", "above"):
                assert red[:, axis].max() < blue[:, axis].min()
            else:
                assert red[:, axis].min() > blue[:, axis].max()


def test_render_rejects_bad_specs_with_every_problem():
    with pytest.raises(ValueError) as exc:
        world.render({"objects": [{"count": 0, "color": "red", "shape": "hexagon"}],
                      "relation": None}, 32, np.random.default_rng(0))
    assert "count=0" in str(exc.value) and "shape='hexagon'" in str(exc.value)


def test_corrupt_spec_changes_each_fact_at_its_rate_and_stays_valid():
    spec = world.parse_prompt("two red circles left of a blue square")
    rng = np.random.default_rng(0)
    assert world.corrupt_spec(spec, 0.0, rng) == spec
    n, changed = 3000, {"count": 0, "color": 0, "relation": 0}
    for _ in range(n):
        c = world.corrupt_spec(spec, 0.3, rng)
        assert world.validate_spec(c) == []  # colours stay distinct, counts in range
        assert [g["shape"] for g in c["objects"]] == ["circle", "square"]
        changed["count"] += c["objects"][0]["count"] != 2
        changed["color"] += c["objects"][1]["color"] != "blue"
        changed["relation"] += c["relation"] != "left of"
    for fact, k in changed.items():
        assert abs(k / n - 0.3) < 0.03, (fact, k / n)
    assert spec == world.parse_prompt("two red circles left of a blue square")  # not mutated


def test_corrupt_spec_touches_only_the_facts_named():
    spec = world.parse_prompt("two red circles left of a blue square")
    rng = np.random.default_rng(1)
    for _ in range(50):
        c = world.corrupt_spec(spec, 1.0, rng, ("color",))
        assert [g["count"] for g in c["objects"]] == [2, 1] and c["relation"] == "left of"
        assert c["objects"][0]["color"] != "red" and c["objects"][1]["color"] != "blue"
        assert world.validate_spec(c) == []
