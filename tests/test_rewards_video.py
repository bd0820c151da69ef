"""Rewards on video batches uint8 [B, F, H, W, 3]: image scorers per frame under each
aggregation (against sums done by hand), the temporal-consistency term, custom video
functions, the config surface and its preflight errors, and a one-frame video scored exactly
as the image it is."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.media import MediaError, as_video, spread_indices
from trainer.preflight import preflight
from trainer.preflight.imports import check_imports
from trainer.rewards import (RewardError, build_reward_manager, build_reward_manager_from_config,
                             clear_reward_manager_cache)
from trainer.rewards.base import RewardScorer
from trainer.rewards.video import FrameRule, TemporalConsistencyScorer
from test_rewards_scorers import IMAGE, reference_clip_embeds, tiny_clip_dir  # noqa: F401

B, F, H, W = 3, 7, 6, 10
PROMPTS = ["a cat", "a dog", "a cup"]
META = [{"sample_id": f"s{i}"} for i in range(B)]
# frame f of video b is a flat grey of LEVELS[b, f]: a brightness scorer reads it back exactly
LEVELS = torch.tensor([[10, 200, 30, 40, 50, 60, 70],
                       [90, 80, 70, 5, 50, 40, 30],
                       [0, 255, 0, 255, 0, 255, 0]], dtype=torch.uint8)
VIDEO = LEVELS.view(B, F, 1, 1, 1).expand(B, F, H, W, 3).contiguous()
SEEN: list = []


class Brightness(RewardScorer):
    """Mean pixel value / 255 of each image; records every batch it is given."""

    components = ("brightness",)

    def __init__(self, *, device=None, nan_at: int | None = None) -> None:
        self.nan_at = nan_at

    def score(self, images, prompts, metadata):
        SEEN.append((tuple(images.shape), list(prompts)))
        values = images.float().mean(dim=(1, 2, 3)) / 255.0
        if self.nan_at is not None:
            values[self.nan_at] = math.nan
        return {"brightness": values}


@pytest.fixture(autouse=True)
def _fresh():
    clear_reward_manager_cache()
    SEEN.clear()
    yield
    clear_reward_manager_cache()


def tiny(*sets):
    return load_config("tiny", ["reward.component_weights={}", "reward.required_components=[]",
                                *sets])


def manager_with(table: str):
    return build_reward_manager_from_config(
        tiny(f'reward.scorers={{"b": {{"path": "test_rewards_video.Brightness", {table}}}}}')
        .reward)


def by_hand(levels: torch.Tensor) -> torch.Tensor:
    return levels.double() / 255.0


@pytest.mark.parametrize("table, k, expected", [
    ('"weight": 1', F, by_hand(LEVELS).mean(dim=1)),                          # the default
    ('"frame_aggregation": "mean"', F, by_hand(LEVELS).mean(dim=1)),
    ('"frame_aggregation": "min"', F, by_hand(LEVELS).min(dim=1).values),
    ('"frame_aggregation": "sampled", "frames": 3', 3,
     by_hand(LEVELS[:, [0, 3, 6]]).mean(dim=1)),
    ('"frame_aggregation": "sampled", "frames": 1', 1, by_hand(LEVELS[:, 3])),
])
def test_each_frame_aggregation_matches_the_hand_computation(table, k, expected):
    scores, _ = manager_with(table).score(VIDEO, PROMPTS, META)
    torch.testing.assert_close(scores["brightness"].double(), expected, rtol=0, atol=1e-6)
    (shape, prompts), = SEEN  # one scorer call: every video's frames in one image batch
    assert shape == (B * k, H, W, 3)
    assert prompts == [p for p in PROMPTS for _ in range(k)]


def test_sampled_frames_are_spread_evenly_and_always_the_same():
    assert spread_indices(7, 3) == [0, 3, 6] and spread_indices(81, 4) == [0, 27, 53, 80]
    assert spread_indices(7, 1) == [3] and spread_indices(3, 8) == [0, 1, 2]
    assert FrameRule("sampled", 4).indices(81) == FrameRule("sampled", 4).indices(81)


def test_a_frame_not_scored_leaves_its_video_not_scored_under_every_rule():
    for rule in ("mean", "min"):
        clear_reward_manager_cache()
        manager = manager_with(f'"frame_aggregation": "{rule}", "nan_at": {F + 2}')
        values = manager.score(VIDEO, PROMPTS, META)[0]["brightness"]
        assert math.isnan(values[1]) and not values[[0, 2]].isnan().any()  # frame 2 of video 1


def test_a_one_frame_video_is_scored_exactly_as_the_image_it_is():
    manager = manager_with('"frame_aggregation": "min"')
    images = VIDEO[:, 2]
    from_video, _ = manager.score(VIDEO[:, 2:3], PROMPTS, META)
    from_images, _ = manager.score(images, PROMPTS, META)
    assert torch.equal(from_video["brightness"], from_images["brightness"])
    assert SEEN[0] == SEEN[1] == ((B, H, W, 3), PROMPTS)  # the scorer saw an image batch


def test_an_image_scorer_called_directly_still_refuses_a_video():
    from trainer.rewards.edit import ImageSimilarityScorer
    with pytest.raises(ValueError, match=r"images must be \[B, H, W, 3\], got shape \[3, 7"):
        ImageSimilarityScorer().score(VIDEO, PROMPTS, META, sources=None)


# ---- temporal consistency --------------------------------------------------------------
def smooth_video(frames: int = 6) -> torch.Tensor:
    """A bright square sliding one pixel per frame over a dark background."""
    video = torch.full((1, frames, 12, 16, 3), 20, dtype=torch.uint8)
    for f in range(frames):
        video[0, f, 3:9, 2 + f:8 + f] = 230
    return video


def test_temporal_consistency_is_one_for_a_still_video_and_falls_when_frames_are_shuffled():
    scorer = TemporalConsistencyScorer()
    still = VIDEO[:, :1].expand(B, F, H, W, 3)
    assert scorer.score(still, PROMPTS, META)["temporal_consistency"].tolist() == [1.0] * B
    smooth = smooth_video()
    shuffled = smooth[:, [0, 5, 1, 4, 2, 3]]
    one = scorer.score(smooth, ["p"], [{}])["temporal_consistency"]
    other = scorer.score(shuffled, ["p"], [{}])["temporal_consistency"]
    assert 0.0 < other < one < 1.0
    # by hand: each slide changes one pixel column at each edge of the square (12 pixels of
    # 192, 3 channels each, by 210 of 255), the same for every pair
    assert one.item() == pytest.approx(1 - (2 * 6 * 210) / (12 * 16 * 255), abs=1e-6)


def test_temporal_consistency_by_hand_on_a_flickering_video_and_box_averaged_frames():
    scorer = TemporalConsistencyScorer()
    values = scorer.score(VIDEO, PROMPTS, META)["temporal_consistency"].double()
    steps = (LEVELS[:, 1:].double() - LEVELS[:, :-1].double()).abs() / 255.0
    torch.testing.assert_close(values, (1 - steps).mean(dim=1), rtol=0, atol=1e-6)
    # size 1: every frame averaged to one pixel, so a checkerboard is its own grey
    board = (torch.arange(16).view(4, 4) % 2 * 255).to(torch.uint8)
    flip = torch.stack([board, 255 - board]).view(1, 2, 4, 4, 1).expand(1, 2, 4, 4, 3)
    assert TemporalConsistencyScorer(size=1).score(flip, ["p"], [{}])[
        "temporal_consistency"].item() == pytest.approx(1.0)
    assert TemporalConsistencyScorer(size=4).score(flip, ["p"], [{}])[
        "temporal_consistency"].item() == pytest.approx(0.0)


def test_temporal_consistency_of_an_image_batch_is_one():
    scores = TemporalConsistencyScorer().score(VIDEO[:, 0], PROMPTS, META)
    assert scores["temporal_consistency"].tolist() == [1.0] * B


def test_temporal_consistency_on_clip_features_is_the_cosine_of_consecutive_frames(
        tiny_clip_dir):  # noqa: F811
    g = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (2, 3, IMAGE, IMAGE, 3), dtype=torch.uint8, generator=g)
    scorer = TemporalConsistencyScorer(model_path=tiny_clip_dir)
    values = scorer.score(video, ["a", "b"], [{}, {}])["temporal_consistency"]
    embeds, _, _ = reference_clip_embeds(tiny_clip_dir, video.reshape(6, IMAGE, IMAGE, 3),
                                         ["x"] * 6)
    embeds = embeds.view(2, 3, -1)
    expected = (embeds[:, 1:] * embeds[:, :-1]).sum(-1).mean(dim=1)
    torch.testing.assert_close(values, expected, rtol=0, atol=1e-5)


def test_temporal_consistency_is_a_built_in_beside_a_per_frame_scorer():
    manager = build_reward_manager_from_config(tiny(
        'reward.scorers={"temporal_consistency": {"weight": 0.5}, '
        '"b": {"path": "test_rewards_video.Brightness", "frame_aggregation": "min"}}').reward)
    scores, _ = manager.score(VIDEO, PROMPTS, META)
    assert manager.weights == {"temporal_consistency": 0.5, "brightness": 1.0}
    torch.testing.assert_close(scores["brightness"].double(), by_hand(LEVELS).min(dim=1).values,
                               rtol=0, atol=1e-6)
    assert scores["temporal_consistency"].shape == (B,) and SEEN[0][0] == (B * F, H, W, 3)


# ---- custom video functions ------------------------------------------------------------
def motion(videos, prompts, metadata):
    """A video function: mean absolute change between consecutive frames, per video."""
    SEEN.append(tuple(videos.shape))
    v = videos.float()
    if v.shape[1] == 1:
        return [0.0] * len(prompts)
    return (v[:, 1:] - v[:, :-1]).abs().mean(dim=(1, 2, 3, 4))


motion.media = "video"


def motion_factory():
    """The factory form, declaring several components."""
    def fn(videos, prompts, metadata):
        return {"frames": [float(videos.shape[1])] * len(prompts),
                "first_red": videos[:, 0, ..., 0].float().mean(dim=(1, 2))}
    return fn


motion_factory.media = "video"
motion_factory.components = ("frames", "first_red")


def video_with_float_layout(videos, prompts, metadata):
    return [0.0] * len(prompts)


video_with_float_layout.media = "video"
video_with_float_layout.image_layout = "float_bchw"


def test_a_custom_video_function_gets_the_whole_video_batch():
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path="test_rewards_video.motion")
    scores, _ = manager.score(VIDEO, PROMPTS, META)
    assert SEEN == [(B, F, H, W, 3)]
    steps = (LEVELS[:, 1:].double() - LEVELS[:, :-1].double()).abs().mean(dim=1)
    torch.testing.assert_close(scores["motion"].double(), steps, rtol=0, atol=1e-4)
    manager.score(VIDEO[:, 0], PROMPTS, META)  # an image batch: one-frame videos
    assert SEEN[-1] == (B, 1, H, W, 3)


def test_a_video_factory_declares_its_components_and_an_image_function_goes_per_frame():
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                   custom_reward_path="test_rewards_video.motion_factory")
    scores, _ = manager.score(VIDEO, PROMPTS, META)
    assert scores["frames"].tolist() == [F] * B
    torch.testing.assert_close(scores["first_red"].double(), LEVELS[:, 0].double())
    clear_reward_manager_cache()
    # an image function (no media attribute) on a video: per frame, then the mean
    per_frame = build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                                     custom_reward_path="test_rewards_custom_forms.star_args")
    assert per_frame.score(VIDEO, PROMPTS, META)[0]["star_args"].tolist() == [1.0] * B


def test_a_video_function_asking_for_an_image_layout_is_refused():
    with pytest.raises(ValueError, match="a video function .* sets image_layout='float_bchw'"):
        build_reward_manager(scorer_path=None, model_path=None, runtime="cpu",
                             custom_reward_path="test_rewards_video.video_with_float_layout")


def test_preflight_calls_a_video_function_on_a_dummy_video():
    check_imports(load_config("tiny", [
        "reward.scorer_path=none", "reward.required_components=[]",
        "reward.component_weights={}", "reward.custom_reward_path=test_rewards_video.motion"]))
    assert len(SEEN) == 1 and len(SEEN[0]) == 5 and SEEN[0][1] == 2


# ---- configuration and preflight -------------------------------------------------------
@pytest.mark.parametrize("table, expected", [
    ('"frame_aggregation": "median"',
     "reward.scorers.b.frame_aggregation='median' is not one of ['mean', 'min', 'sampled']"),
    ('"frame_aggregation": "sampled"',
     "reward.scorers.b.frames=None: frame_aggregation = \"sampled\" needs frames = K"),
    ('"frame_aggregation": "sampled", "frames": 0', "reward.scorers.b.frames=0"),
    ('"frames": 4', "reward.scorers.b.frames=4 applies to frame_aggregation = \"sampled\" only"),
])
def test_bad_frame_options_are_one_static_preflight_error(table, expected):
    sets = [f'reward.scorers={{"b": {{"path": "test_rewards_video.Brightness", {table}}}}}']
    with pytest.raises(ConfigError) as err:
        preflight(tiny(*sets), world_size=1)
    assert expected in str(err.value)
    with pytest.raises(ValueError, match="reward configuration: "):
        build_reward_manager_from_config(tiny(*sets).reward)


def test_a_frame_rule_on_a_scorer_that_reads_videos_is_an_import_stage_error():
    cfg = tiny('reward.scorers={"temporal_consistency": {"frame_aggregation": "min"}}')
    with pytest.raises(ConfigError) as err:
        check_imports(cfg)
    assert "reward.scorers.temporal_consistency.frame_aggregation: " \
           "trainer.rewards.video.TemporalConsistencyScorer reads whole videos" in str(err.value)
    with pytest.raises(ValueError, match="reads whole videos"):
        build_reward_manager_from_config(cfg.reward)


def test_frame_options_are_not_passed_to_the_scorers_constructor():
    manager = manager_with('"frame_aggregation": "sampled", "frames": 2')
    assert manager.scorers[0].frame_rule == FrameRule("sampled", 2)


# ---- the layout boundary ---------------------------------------------------------------
def test_channel_first_layouts_convert_to_ours_and_a_wrong_one_is_named():
    ours = torch.randint(0, 256, (2, 3, 4, 5, 3), dtype=torch.uint8)
    assert torch.equal(as_video(ours.permute(0, 4, 1, 2, 3), "bcfhw"), ours)
    assert torch.equal(as_video(ours.permute(0, 1, 4, 2, 3), "bfchw"), ours)
    assert np.array_equal(as_video(ours.permute(0, 4, 1, 2, 3).numpy(), "bcfhw"), ours.numpy())
    with pytest.raises(MediaError, match="3 channels at axis 1"):
        as_video(VIDEO, "bcfhw")
    with pytest.raises(MediaError, match="must be uint8"):
        as_video(ours.float(), "bfhwc")
    with pytest.raises(MediaError, match="not one of"):
        as_video(ours, "bhwc")


class VideoTrackWithoutTakesVideo(RewardScorer):
    components = ("motion",)
    required_tracks = ("video",)

    def score(self, images, prompts, metadata):
        raise AssertionError("never built")


def test_a_scorer_needing_video_that_does_not_take_videos_is_refused_when_built():
    with pytest.raises(ValueError, match="needs the video track but does not set takes_video"):
        build_reward_manager(scorer_path="test_rewards_video.VideoTrackWithoutTakesVideo",
                             model_path=None, runtime="cpu")


def test_a_frame_rule_on_a_remote_scorer_belongs_to_its_server():
    cfg = tiny("reward.runtime=remote", "reward.endpoint=http://127.0.0.1:9/",
               'reward.scorers={"b": {"path": "test_rewards_video.Brightness", '
               '"frame_aggregation": "min"}}')
    with pytest.raises(ConfigError) as err:
        check_imports(cfg)
    assert "reward.scorers.b.frame_aggregation: with runtime 'remote' the reward server " \
           "scores the frames" in str(err.value)


def test_an_edit_scorer_compares_every_frame_with_its_videos_own_source():
    manager = build_reward_manager_from_config(tiny(
        'reward.scorers={"image_similarity": {"frame_aggregation": "min"}}').reward)
    sources = [(np.full((8, 8, 3), level, np.uint8),) for level in (0, 100, 255)]
    scores, _ = manager.score(VIDEO, PROMPTS, META, sources=sources)
    src = torch.tensor([0.0, 100.0, 255.0]).view(B, 1)
    expected = (1 - (LEVELS.double() - src.double()).abs() / 255).min(dim=1).values
    torch.testing.assert_close(scores["image_similarity"].double(), expected, rtol=0, atol=1e-6)
