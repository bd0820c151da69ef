"""The rule-based toy reward: ~1 on rendered truth, and each component falls on its own error."""
from __future__ import annotations

import copy
from collections import deque

import numpy as np
import pytest
import torch

from trainer.toy import world
from trainer.toy.reward import ToyCompositionScorer, connected_components

# one intra-op thread: tiny models gain nothing from more (see tests/conftest.py)
pytestmark = pytest.mark.usefixtures("torch_single_thread")

SIZE = 32


def _render(specs, seed=0):
    return torch.from_numpy(np.stack([world.render(s, SIZE, np.random.default_rng(seed + i))
                                      for i, s in enumerate(specs)]))


@pytest.fixture(scope="module")
def records():
    return world.make_prompt_records(96, seed=11, split="train")


@pytest.fixture(scope="module")
def scorer():
    return ToyCompositionScorer()


def _score(scorer, images, records):
    return scorer.score(images, [r["prompt"] for r in records], [r["metadata"] for r in records])


def test_interface_matches_the_reward_scorer_contract(scorer, records):
    assert ToyCompositionScorer.components == ("color", "count", "position")
    assert ToyCompositionScorer.required_tracks == ("image",)
    out = _score(scorer, _render([r["metadata"]["spec"] for r in records[:4]]), records[:4])
    assert set(out) == set(scorer.components)
    for v in out.values():
        assert v.dtype == torch.float32 and v.shape == (4,)


def test_rendered_ground_truth_scores_one_on_every_component(scorer, records):
    out = _score(scorer, _render([r["metadata"]["spec"] for r in records]), records)
    for name, v in out.items():
        assert torch.all(v == 1.0), (name, v)
    # without metadata the spec is parsed from the prompt: same scores
    again = scorer.score(_render([r["metadata"]["spec"] for r in records]),
                         [r["prompt"] for r in records])
    for name in out:
        assert torch.equal(out[name], again[name])


def _pairs(records):
    return [r for r in records if r["metadata"]["spec"]["relation"] is not None]


def test_wrong_colour_lowers_colour_only(scorer, records):
    wrong = []
    for r in records:
        spec = copy.deepcopy(r["metadata"]["spec"])
        used = {g["color"] for g in spec["objects"]}
        spec["objects"][-1]["color"] = next(c for c in world.COLORS if c not in used)
        wrong.append(spec)
    out = _score(scorer, _render(wrong), records)
    assert torch.all(out["color"] <= 0.5 + 1e-6), out["color"]
    assert torch.all(out["count"] == 1.0) and torch.all(out["position"] == 1.0)
    singles = torch.tensor([r["metadata"]["spec"]["relation"] is None for r in records])
    assert torch.all(out["color"][singles] == 0.0)


def test_wrong_count_lowers_count_only(scorer, records):
    wrong = []
    for r in records:
        spec = copy.deepcopy(r["metadata"]["spec"])
        spec["objects"][0]["count"] = spec["objects"][0]["count"] % 3 + 1
        wrong.append(spec)
    out = _score(scorer, _render(wrong), records)
    assert torch.all(out["count"] < 1.0) and torch.all(out["count"] > 0.0)
    assert torch.all(out["color"] == 1.0) and torch.all(out["position"] == 1.0)


def test_wrong_relation_lowers_position_only(scorer, records):
    pairs = _pairs(records)
    wrong = []
    for r in pairs:
        spec = copy.deepcopy(r["metadata"]["spec"])
        spec["relation"] = world.OPPOSITE_RELATION[spec["relation"]]
        wrong.append(spec)
    out = _score(scorer, _render(wrong), pairs)
    assert torch.all(out["position"] == 0.0)
    assert torch.all(out["color"] == 1.0) and torch.all(out["count"] == 1.0)


def test_extra_object_in_another_colour_costs_colour_purity(scorer):
    prompt = "a red circle"
    spec = world.parse_prompt("a red circle left of a blue square")
    out = scorer.score(_render([spec]), [prompt])
    assert 0.0 < out["color"].item() < 1.0
    assert out["count"].item() == 1.0 and out["position"].item() == 1.0


def test_noise_and_blank_images_score_low(scorer, records):
    prompts = [r["prompt"] for r in records]
    gen = torch.Generator().manual_seed(0)
    noise = ((torch.randn(len(records), 3, SIZE, SIZE, generator=gen).clamp(-1, 1) + 1)
             * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    blank = torch.zeros(len(records), SIZE, SIZE, 3, dtype=torch.uint8)
    for images in (noise, blank):
        out = scorer.score(images, prompts)
        for name, v in out.items():
            assert v.mean() < 0.1, (name, v.mean())
    assert all(torch.all(v == 0) for v in scorer.score(blank, prompts).values())


def test_count_credit_halves_per_object_off(scorer):
    one = _render([world.parse_prompt("a blue circle")])
    three = _render([world.parse_prompt("three blue circles")])
    assert scorer.score(one, ["three blue circles"])["count"].item() == pytest.approx(0.25)
    assert scorer.score(three, ["two blue circles"])["count"].item() == pytest.approx(0.5)
    assert scorer.score(three, ["a blue circle"])["count"].item() == pytest.approx(0.25)
    pair = _render([world.parse_prompt("two red squares above a blue circle")])
    out = scorer.score(pair, ["a red square above three blue circles"])["count"].item()
    assert out == pytest.approx((0.5 + 0.25) / 2)


def test_bad_input_names_every_problem_at_once(scorer):
    images = torch.zeros(2, SIZE, SIZE, 3, dtype=torch.float32)
    with pytest.raises(ValueError) as exc:
        scorer.score(images, ["a red circle", "a purple circle", "x"],
                     [{"spec": None}, {}, {"spec": {"objects": [], "relation": None}}])
    msg = str(exc.value)
    assert "uint8" in msg and "3 prompts for 2 images" in msg
    assert "3 metadata entries" in msg and "sample 1" in msg and "sample 2" in msg
    with pytest.raises(ValueError, match="min_blob_fraction.*max_color_distance"):
        ToyCompositionScorer(min_blob_fraction=2.0, max_color_distance=-1.0)


def _bfs_labels(mask: np.ndarray) -> np.ndarray:
    """Oracle: 8-connected components by breadth-first search."""
    h, w = mask.shape
    out = np.zeros((h, w), dtype=np.int64)
    n = 0
    for y in range(h):
        for x in range(w):
            if mask[y, x] and not out[y, x]:
                n += 1
                out[y, x] = n
                queue = deque([(y, x)])
                while queue:
                    cy, cx = queue.popleft()
                    for dy in (-1, 0, 1):
                        for dx in (-1, 0, 1):
                            ny, nx = cy + dy, cx + dx
                            if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not out[ny, nx]:
                                out[ny, nx] = n
                                queue.append((ny, nx))
    return out


def test_connected_components_match_a_bfs_oracle():
    gen = torch.Generator().manual_seed(3)
    masks = torch.rand(6, 19, 23, generator=gen) < torch.tensor(
        [0.1, 0.3, 0.45, 0.6, 0.8, 1.0]).view(-1, 1, 1)
    labels = connected_components(masks)
    for m, lab in zip(masks.numpy(), labels.numpy()):
        ref = _bfs_labels(m)
        assert np.array_equal(lab > 0, m)
        # same partition: a bijection between label ids
        pairs = set(zip(lab[m].tolist(), ref[m].tolist()))
        assert len(pairs) == len(set(lab[m].tolist())) == len(set(ref[m].tolist()))
    # a long snake needs many propagation rounds
    snake = torch.zeros(1, 15, 15, dtype=torch.bool)
    snake[0, ::2, :] = True
    snake[0, 1::4, -1] = True
    snake[0, 3::4, 0] = True
    assert connected_components(snake)[0][snake[0]].unique().numel() == 1


def test_scorer_runs_through_the_reward_manager(records):
    from trainer.rewards import RewardScorer, build_reward_manager, clear_reward_manager_cache
    assert issubclass(ToyCompositionScorer, RewardScorer)
    clear_reward_manager_cache()
    manager = build_reward_manager(scorer_path="trainer.toy.reward.ToyCompositionScorer",
                                   model_path=None, runtime="cpu")
    images = _render([r["metadata"]["spec"] for r in records[:8]])
    components, metrics = manager.score(images, [r["prompt"] for r in records[:8]],
                                        [r["metadata"] for r in records[:8]])
    assert set(components) == {"color", "count", "position"}
    assert all(torch.all(v == 1.0) for v in components.values())
    assert metrics["reward/score_time"] > 0
    clear_reward_manager_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reward_on_cuda_equals_cpu():
    recs = world.make_prompt_records(256, seed=5, split="eval")
    truth = _render([r["metadata"]["spec"] for r in recs])
    gen = torch.Generator().manual_seed(1)
    noisy = (truth.float() + 40 * torch.randn(truth.shape, generator=gen)).clamp(0, 255).byte()
    scorer = ToyCompositionScorer()
    for images in (truth, noisy):
        cpu = _score(scorer, images, recs)
        gpu = _score(scorer, images.cuda(), recs)
        for name in cpu:
            assert gpu[name].is_cuda and torch.equal(cpu[name], gpu[name].cpu()), name
