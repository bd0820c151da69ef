"""The conditioning contract: a task's geometry and its reference images travel from the
prompt record through the request (plain JSON), the engine, the response, the RolloutBatch,
the replay, the rewards and the artifacts; the text-to-image path is untouched by it.

The family here is ``engine_fixtures.EditFixtureAdapter`` (a real tiny Qwen-Image
transformer, reference images as extra attended tokens): it stands in for the editing
families only to keep these path checks fast; tests/test_family_qwen_image_edit.py runs the
same path with diffusers' own Qwen-Image-Edit parts."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import flowgrpo_kernels as kernels
from engine_fixtures import (ADAPTER_PATH, EDIT_ADAPTER_PATH, SAMPLING, EditFixtureAdapter,
                             FixtureAdapter, build_fixture_model_dir)
from trainer.engine import RequestError, launch_embedded_engine
from trainer.media import ImageRef
from trainer.models.geometry import Geometry
from trainer.rewards.base import RewardScorer
from trainer.rewards.manager import RewardManager
from trainer.rollout.artifacts import load_group_sidecar
from trainer.rollout.driver import RolloutDriver

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _png(path, colour) -> ImageRef:
    Image.fromarray(np.full((24, 40, 3), colour, dtype=np.uint8)).save(path)
    return ImageRef(str(path))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("edit_fixture")
    model_dir = build_fixture_model_dir(root / "model")
    engine = launch_embedded_engine(adapter_path=EDIT_ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    in_process=True)
    refs = {name: _png(root / f"{name}.png", colour)
            for name, colour in (("red", (220, 30, 30)), ("blue", (30, 30, 220)),
                                 ("green", (30, 200, 40)))}
    yield EditFixtureAdapter(str(model_dir)), engine, refs, model_dir
    engine.close()


def test_geometry_is_a_checked_value_and_an_image_request_names_no_frames():
    assert Geometry(32, 48).request_fields() == {"height": 32, "width": 48}
    assert Geometry(32, 48, 9).request_fields() == {"height": 32, "width": 48, "num_frames": 9}
    assert Geometry.from_request({"height": 8, "width": 16}) == Geometry(8, 16, 1)
    with pytest.raises(ValueError) as err:
        Geometry(0, 8.5, True)
    assert all(name in str(err.value) for name in ("height", "width", "frames"))


def test_a_text_to_image_request_is_what_it_was(setup):
    """No images (None, or an empty list per candidate) adds nothing to the request; a
    text-to-image family refuses reference images instead of dropping them."""
    _, _, refs, model_dir = setup
    t2i = FixtureAdapter(str(model_dir))
    args = (["a", "a"], ["s0", "s1"], SAMPLING)
    plain = t2i.build_rollout_request(*args, rollout_id=0, seed=1)
    assert t2i.build_rollout_request(*args, rollout_id=0, seed=1, images=[(), ()]) == plain
    assert "condition_images" not in plain["extra_sampling_params"] and "num_frames" not in plain
    with pytest.raises(ValueError, match="takes at most 0"):
        t2i.build_rollout_request(*args, rollout_id=0, seed=1, images=[(refs["red"],), ()])


def test_bad_reference_images_are_one_error_naming_each(setup):
    adapter, engine, refs, _ = setup
    images = [(), (refs["red"], refs["blue"], refs["green"])]
    with pytest.raises(ValueError) as err:
        adapter.build_rollout_request(["a", "b"], ["s0", "s1"], SAMPLING, rollout_id=0, seed=1,
                                      images=images)
    assert "candidate 0 has no reference image" in str(err.value)
    assert "candidate 1 has 3 reference images" in str(err.value)
    request = adapter.build_rollout_request(["a"], ["s0"], SAMPLING, rollout_id=0, seed=1,
                                            images=[(refs["red"],)])
    request["extra_sampling_params"]["condition_images"] = [["x"], ["y"]]
    with pytest.raises(RequestError, match="condition_images must be 1 lists"):
        engine.generate(request)


def test_the_reference_images_condition_the_sample_and_the_replay_sees_what_it_saw(setup):
    """Same prompt and sample ids: another source image gives another trajectory, the same
    one the same (over JSON as in-process); the replay's log-probs from the batch equal the
    recorded ones bit for bit, and the batch carries the sources in candidate order."""
    adapter, engine, refs, _ = setup
    ids = ["prompt:0:sample:0", "prompt:0:sample:1", "prompt:1:sample:0", "prompt:1:sample:1"]

    def request(first, second):
        return adapter.build_rollout_request(["make it pop"] * 4, ids, SAMPLING, rollout_id=0,
                                             seed=3, group_index=[0, 0, 1, 1],
                                             images=[first, first, second, second])

    red_blue = request((refs["red"],), (refs["blue"], refs["green"]))
    assert red_blue["extra_sampling_params"]["condition_images"][2] == \
        [refs["blue"].entry, refs["green"].entry]
    over_json = json.loads(json.dumps(red_blue))
    first, again = engine.generate(red_blue), engine.generate(over_json)
    assert torch.equal(first["dit_trajectory"]["latents"], again["dit_trajectory"]["latents"])
    blue_blue = engine.generate(request((refs["blue"],), (refs["blue"], refs["green"])))
    lat, other = first["dit_trajectory"]["latents"], blue_blue["dit_trajectory"]["latents"]
    assert not torch.equal(lat[:2], other[:2]) and torch.equal(lat[2:], other[2:])

    batch = adapter.pack_trajectory(first, red_blue)
    assert batch.sources == [(refs["red"],)] * 2 + [(refs["blue"], refs["green"])] * 2
    assert batch.geometry == Geometry(32, 32) and batch.conditions["image_mask"].tolist() == \
        [[1, 0], [1, 0], [1, 1], [1, 1]]
    model = adapter.load_train_model()
    for k in range(len(batch.sde_indices)):
        with torch.no_grad():
            v = adapter.replay_velocity(model, batch, k)
        replayed = kernels.sde_log_prob(batch.latents[:, k], v, batch.next_latents[:, k],
                                        batch.sigmas[:, k], batch.sigmas_next[:, k],
                                        eta=batch.eta, sde_type=batch.sde_type)
        assert torch.equal(replayed, batch.log_probs[:, k]), k
    assert batch.select([3, 0]).sources == [batch.sources[3], batch.sources[0]]


def test_the_guided_negative_keeps_the_reference_images(setup):
    """CFG: the empty prompt's half is encoded with the same reference images (an edit's
    negative), so it too depends on them."""
    adapter, engine, refs, _ = setup
    sampling = {**SAMPLING, "guidance_scale": 3.0}
    response = engine.generate(adapter.build_rollout_request(
        ["a", "a"], ["s0", "s1"], sampling, rollout_id=0, seed=1,
        images=[(refs["red"],), (refs["blue"],)]))
    negative = response["denoising_env"]["neg:image_embeds"]
    assert torch.equal(negative, response["denoising_env"]["image_embeds"])
    assert not torch.equal(negative[0], negative[1])


class _SourceColour(RewardScorer):
    """Reward: how close the result's mean colour is to its first source's (a toy judge)."""

    components = ("source_colour",)
    wants_sources = True

    def score(self, images, prompts, metadata, *, sources):
        got = images.float().mean((1, 2))
        want = torch.tensor(np.stack([s[0].reshape(-1, 3).mean(0) for s in sources])).float()
        return {"source_colour": -(got - want).abs().mean(1)}


def test_the_driver_carries_record_images_to_the_batch_rewards_and_sidecars(setup, tmp_path):
    adapter, engine, refs, _ = setup
    records = [{"prompt": "recolour", "images": [refs["red"].entry], "metadata": {"prompt_id": "a"}},
               {"prompt": "recolour", "images": [refs["blue"].entry, refs["green"].entry],
                "metadata": {"prompt_id": "b"}}]
    driver = RolloutDriver(adapter, [engine], sampling=SAMPLING, seed=5, task="edit",
                           artifact_root=str(tmp_path))
    batch = driver.generate(records, 2, rollout_id=0, policy_version=0)
    assert batch.sources == [(refs["red"],)] * 2 + [(refs["blue"], refs["green"])] * 2
    manager = RewardManager([_SourceColour()], runtime="cpu", device=torch.device("cpu"))
    components, _ = manager.score(batch.images, batch.prompts, batch.metadata,
                                  sources=batch.sources)
    red, blue = (torch.tensor(refs[c].decode().reshape(-1, 3).mean(0)).float() for c in ("red", "blue"))
    mean = batch.images.float().mean((1, 2))
    assert torch.allclose(components["source_colour"][0], -(mean[0] - red).abs().mean())
    assert torch.allclose(components["source_colour"][3], -(mean[3] - blue).abs().mean())
    rows = load_group_sidecar(tmp_path / "edit" / "rollout_0000000" / "group_00000001.safetensors")
    assert rows.sources == [(refs["blue"], refs["green"])] * 2
    for key, value in batch.select([2, 3]).conditions.items():
        assert torch.equal(rows.conditions[key], value), key


def test_a_text_to_image_sidecar_names_no_sources(setup, tmp_path):
    _, _, _, model_dir = setup
    engine = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    in_process=True)
    try:
        driver = RolloutDriver(FixtureAdapter(str(model_dir)), [engine], sampling=SAMPLING,
                               seed=5, task="t2i", artifact_root=str(tmp_path))
        batch = driver.generate([{"prompt": "a cat"}], 2, rollout_id=0, policy_version=0)
        assert batch.sources is None and batch.frames == 1
        rows = load_group_sidecar(tmp_path / "t2i" / "rollout_0000000" / "group_00000000.safetensors")
        assert rows.sources is None
    finally:
        engine.close()


def test_preflight_refuses_records_without_sources_for_the_edit_task(tmp_path):
    from trainer.config import ConfigError, load_config
    from trainer.preflight import preflight

    _png(tmp_path / "ok.png", (200, 20, 20))
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "make it blue", "images": ["ok.png"]}) + "\n"
                     + json.dumps({"prompt": "a cat"}) + "\n")
    cfg = load_config("toy", [f"logging.run_dir={tmp_path / 'run'}", "model.task=edit",
                              f"data.prompt_data={train}", "data.eval_prompt_data=none"])
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    assert (f"1 record(s) carry no source images (first at {train}:2) but "
            "model.task='edit' edits them") in str(err.value)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_http_engine_carries_the_reference_images(setup):
    """The engine in its own process, asked over HTTP (the request's JSON as it is): the
    same trajectory and conditions as in-process."""
    from trainer.engine import SGLangEngineClient

    adapter, engine, refs, model_dir = setup
    request = adapter.build_rollout_request(
        ["make it pop"] * 2, ["s0", "s1"], SAMPLING, rollout_id=0, seed=3,
        images=[(refs["red"],), (refs["blue"], refs["green"])])
    spawned = launch_embedded_engine(adapter_path=EDIT_ADAPTER_PATH, model_path=str(model_dir),
                                     adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                     http_port=0)
    try:
        over_http = SGLangEngineClient(spawned.http_url).generate(request)
    finally:
        spawned.close()
    here = engine.generate(request)
    assert torch.equal(over_http["dit_trajectory"]["latents"], here["dit_trajectory"]["latents"])
    for key in ("image_embeds", "image_mask"):
        assert torch.equal(over_http["denoising_env"][key], here["denoising_env"][key]), key


def test_an_image_family_refuses_frames_in_the_request_and_at_the_engine(setup):
    adapter, engine, refs, _ = setup
    assert adapter.resolution_problems(Geometry(32, 32)) == []
    assert "frames must be 1, got 5" in adapter.resolution_problems(Geometry(32, 32, 5))[0]
    request = adapter.build_rollout_request(["a"], ["s0"], SAMPLING, rollout_id=0, seed=1,
                                            images=[(refs["red"],)])
    with pytest.raises(RequestError, match="frames must be 1, got 5"):
        engine.generate({**request, "num_frames": 5})
