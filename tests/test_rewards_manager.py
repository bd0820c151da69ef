"""The reward manager: configuration errors, caching, custom reward functions by dotpath,
validation of what scorers return, and scoring-input checks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer.rewards import (RewardError, RewardScorer, build_reward_manager,
                             clear_reward_manager_cache)

B = 4
IMAGES = torch.arange(B * 8 * 8 * 3, dtype=torch.int64).remainder(251).to(torch.uint8).view(B, 8, 8, 3)
PROMPTS = ["a cat", "a dog sitting", "a", "two red balls on a table"]
META = [{"sample_id": f"s{i}"} for i in range(B)]


# ---- custom reward functions, found by dotpath f"{__name__}.<name>" -----------------------
def prompt_words(images, prompts, metadata):
    return [len(p.split()) for p in prompts]


def dict_reward(images, prompts, metadata):
    return {"mean_pixel": images.float().mean(dim=(1, 2, 3)),
            "has_id": np.array([1.0 if "sample_id" in m else 0.0 for m in metadata])}


dict_reward.components = ("mean_pixel", "has_id")


def undeclared_dict(images, prompts, metadata):
    return {"a": [1.0] * len(prompts), "b": [2.0] * len(prompts)}


def one_number(images, prompts, metadata):
    return 3.0


def short_list(images, prompts, metadata):
    return [1.0] * (len(prompts) - 1)


def with_gaps(images, prompts, metadata):
    return [1.0, None, float("nan"), 2.0]


with_gaps.component = "gappy"


class NeedsAudio(RewardScorer):
    components = ("motion",)
    required_tracks = ("image", "audio")

    def score(self, images, prompts, metadata):
        raise AssertionError("never built")


class LiesAboutComponents(RewardScorer):
    components = ("declared",)

    def __init__(self, *, device=None, scale: float = 1.0):
        self.scale = scale

    def score(self, images, prompts, metadata):
        return {"declared": torch.ones(B) * self.scale, "surprise": torch.zeros(B)}


def here(name: str) -> str:
    return f"{__name__}.{name}"


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_reward_manager_cache()
    yield
    clear_reward_manager_cache()


def test_custom_list_function_names_its_component_after_the_function():
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path=here("prompt_words"))
    assert manager.components == ("prompt_words",)
    scores, _ = manager.score(IMAGES, PROMPTS, META)
    assert scores["prompt_words"].tolist() == [2.0, 3.0, 1.0, 6.0]
    assert scores["prompt_words"].dtype == torch.float32


def test_custom_function_next_to_a_scorer_and_dict_returns():
    manager = build_reward_manager(scorer_path="trainer.rewards.jpeg.JpegCompressibilityScorer",
                                   model_path=None, runtime="cpu",
                                   custom_reward_path=here("dict_reward"))
    assert manager.components == ("jpeg_compressibility", "mean_pixel", "has_id")
    scores, metrics = manager.score(IMAGES, PROMPTS, META)
    torch.testing.assert_close(scores["mean_pixel"], IMAGES.float().mean(dim=(1, 2, 3)))
    assert scores["has_id"].tolist() == [1.0] * B and (scores["jpeg_compressibility"] < 0).all()
    assert set(metrics) == {"reward/score_time", "reward/score_samples_per_s"}


def test_none_and_nan_from_a_function_become_nan():
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path=here("with_gaps"))
    scores, _ = manager.score(IMAGES, PROMPTS, META)
    values = scores["gappy"]
    assert values[0] == 1.0 and values[3] == 2.0 and math.isnan(values[1]) and math.isnan(values[2])


@pytest.mark.parametrize("name,message", [
    ("undeclared_dict", "undeclared_dict.components = ('a', 'b')"),
    ("one_number", "returned one number for a batch of 4"),
    ("short_list", "expected shape [4], got [3]"),
])
def test_bad_custom_function_returns(name, message):
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path=here(name))
    with pytest.raises(RewardError) as err:
        manager.score(IMAGES, PROMPTS, META)
    assert message in str(err.value)


def test_scorer_returning_undeclared_component_is_refused():
    manager = build_reward_manager(scorer_path=here("LiesAboutComponents"), model_path=None,
                                   runtime="cpu")
    with pytest.raises(RewardError, match="undeclared component 'surprise'"):
        manager.score(IMAGES, PROMPTS, META)


def test_cache_is_per_configuration():
    a = build_reward_manager(scorer_path=here("LiesAboutComponents"), model_path=None,
                             runtime="cpu", scale=2.0)
    assert build_reward_manager(scorer_path=here("LiesAboutComponents"), model_path=None,
                                runtime="cpu", scale=2.0) is a
    b = build_reward_manager(scorer_path=here("LiesAboutComponents"), model_path=None,
                             runtime="cpu", scale=3.0)
    assert b is not a and b.scorers[0].scale == 3.0
    clear_reward_manager_cache()
    assert build_reward_manager(scorer_path=here("LiesAboutComponents"), model_path=None,
                                runtime="cpu", scale=2.0) is not a


def test_configuration_errors_are_reported_together():
    with pytest.raises(ValueError) as err:
        build_reward_manager(scorer_path=None, model_path="/models/x", runtime="remote")
    message = str(err.value)
    assert "needs an endpoint" in message and "loads no local model" in message
    with pytest.raises(ValueError) as err:
        build_reward_manager(scorer_path=None, model_path=None, runtime="gpu",
                             endpoint="http://x/", quality=3)
    message = str(err.value)
    assert "'gpu' is not one of" in message and "endpoint is set" in message \
        and "needs --reward-scorer-path" in message and "no scorer path" in message
    with pytest.raises(ValueError, match="runtime 'cpu' with device='cuda:0'"):
        build_reward_manager(scorer_path=here("LiesAboutComponents"), model_path=None,
                             runtime="cpu", device="cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_colocate_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="CUDA is not available; use runtime 'cpu'"):
        build_reward_manager(scorer_path="trainer.rewards.jpeg.JpegCompressibilityScorer",
                             model_path=None, runtime="colocate")


def test_scorer_path_and_constructor_errors():
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        build_reward_manager(scorer_path="no_such_module.Scorer", model_path=None, runtime="cpu")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        build_reward_manager(scorer_path="trainer.rewards.jpeg.Nope", model_path=None,
                             runtime="cpu")
    with pytest.raises(ValueError, match="not a scorer class"):
        build_reward_manager(scorer_path=here("prompt_words"), model_path=None, runtime="cpu")
    with pytest.raises(ValueError) as err:
        build_reward_manager(scorer_path="trainer.rewards.jpeg.JpegCompressibilityScorer",
                             model_path="/models/jpeg", runtime="cpu", qualty=90)
    assert "takes no model_path" in str(err.value) and "no option(s) ['qualty']" in str(err.value)
    with pytest.raises(ValueError, match="needs a model path"):
        build_reward_manager(scorer_path="trainer.rewards.pickscore.PickScoreScorer",
                             model_path=None, runtime="cpu")
    with pytest.raises(ValueError, match=r"needs media tracks \['audio'\]"):
        build_reward_manager(scorer_path=here("NeedsAudio"), model_path=None, runtime="cpu")


def test_two_sources_of_one_component_is_an_error():
    with pytest.raises(ValueError, match="'prompt_words' produced by both"):
        from trainer.rewards.function import FunctionScorer
        from trainer.rewards.manager import RewardManager
        RewardManager([FunctionScorer(prompt_words), FunctionScorer(prompt_words)],
                      runtime="cpu", device=None)


def test_scoring_input_errors_are_reported_together():
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path=here("prompt_words"))
    with pytest.raises(ValueError) as err:
        manager.score(IMAGES.float(), PROMPTS[:3], META[:2])
    message = str(err.value)
    assert "must be uint8" in message and "3 prompts for 4 images" in message \
        and "2 metadata entries for 4 images" in message
    with pytest.raises(ValueError, match=r"must be \[B, H, W, 3\]"):
        manager.score(IMAGES[..., :1], PROMPTS, META)


class WithWeights(RewardScorer):
    components = ("w",)

    def __init__(self, *, device=None):
        self.device = device
        self.net = torch.nn.Linear(3, 1)

    def score(self, images, prompts, metadata):
        return {"w": self.net(images.float().mean(dim=(1, 2)).to(self.device)).squeeze(-1)}


def test_manager_to_moves_local_weights():
    manager = build_reward_manager(scorer_path=here("WithWeights"), model_path=None,
                                   runtime="cpu", custom_reward_path=here("prompt_words"))
    scorer = manager.scorers[0]
    assert manager.score(IMAGES, PROMPTS, META)[0]["w"].shape == (B,)
    assert manager.to("meta") is manager
    assert scorer.net.weight.device.type == "meta" and scorer.device == torch.device("meta")
    # (meta is the only second device on a CPU-only box; nothing comes back from it)
