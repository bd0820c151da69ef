"""lab/toy/toy_soft_count.py: the experiment scorer's soft count, and its hard components equal
to the shipped scorer's."""
import numpy as np
import torch

import toy_soft_count
from trainer.toy import world
from trainer.toy.reward import ToyCompositionScorer

SPEC = {"objects": [{"count": 2, "color": "red", "shape": "circle"}], "relation": None}


def test_fragments_count_as_a_fraction_of_an_object():
    two = [("red", 30.0, 5, 5), ("red", 20.0, 20, 20)]
    assert toy_soft_count.soft_count(SPEC, two) == 1.0
    # a 4 px speck: 1/4 of an object too many, where the hard count ignores it (< 6 px)
    assert toy_soft_count.soft_count(SPEC, two + [("red", 4.0, 28, 3)]) == 0.5 ** 0.25
    # a half-size second object: k = 1.5
    assert toy_soft_count.soft_count(SPEC, two[:1] + [("red", 8.0, 20, 20)]) == 0.5 ** 0.5
    assert toy_soft_count.soft_count(SPEC, [("blue", 30.0, 5, 5)]) == 0.0   # no red at all


def test_hard_components_equal_the_shipped_scorer_on_rendered_scenes():
    records = world.make_prompt_records(12, seed=3)
    rng = np.random.default_rng(0)
    images = torch.from_numpy(np.stack([world.render(r["metadata"]["spec"], 32, rng)
                                        for r in records]))
    prompts = [r["prompt"] for r in records]
    metadata = [r["metadata"] for r in records]
    got = toy_soft_count.SoftCountScorer().score(images, prompts, metadata)
    want = ToyCompositionScorer().score(images, prompts, metadata)
    assert set(got) == {"color", "count", "position", "count_soft"}
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    # rendered truth: the hard count is exact; the soft one nearly, since the smallest
    # rendered objects (about 10 px) are under the 16 px of a whole object
    assert torch.all(got["count"] == 1.0)
    assert got["count_soft"].min() > 0.85 and (got["count_soft"] == 1.0).float().mean() > 0.8
