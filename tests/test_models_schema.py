"""Rollout request building, response validation (every rejection), packing, JSON codec,
and engine-name mapping. Uses the tiny Qwen-Image directory for its configs only: nothing here
loads weights, so these tests cost milliseconds each."""
from __future__ import annotations

import json

import pytest
import torch

from flowgrpo_kernels.sde_types import TABLE
from trainer.models import adapter_class, noise
from trainer.models.diffusers_base import engine_param_name
from trainer.models.geometry import Geometry
from trainer.models.wire import ROLLOUT_RESPONSE_FIELDS, from_jsonable, to_jsonable

H = W = 32
SAMPLING = {"height": H, "width": W, "num_inference_steps": 6, "guidance_scale": 1.0, "eta": 0.7,
            "sde_type": "sde", "sde_indices": [1, 3, 4]}
PROMPTS = ["p", "p", "q", "q"]
IDS = ["prompt:0:sample:0", "prompt:0:sample:1", "prompt:1:sample:0", "prompt:1:sample:1"]


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return adapter_class("qwen_image")(str(tiny_model_dir("qwen_image")))


def make_request(adapter, sampling=None, **kw):
    kw.setdefault("rollout_id", 5)
    kw.setdefault("seed", 42)
    return adapter.build_rollout_request(kw.pop("prompts", PROMPTS), kw.pop("sample_ids", IDS),
                                         {**SAMPLING, **(sampling or {})}, **kw)


def fake_response(adapter, request) -> dict:
    """A well-formed engine answer with random content (shapes and echoes as trainer.models.wire says)."""
    gen = torch.Generator().manual_seed(0)
    extra = request["extra_sampling_params"]
    b, s = len(request["prompt"]), len(request["rollout_sde_step_indices"])
    sigmas = torch.tensor(extra["sigmas"])
    return {
        "rollout_log_probs": torch.randn(b, s, generator=gen),
        "dit_trajectory": {
            "latents": torch.randn(b, s, 2, *extra["latent_shape"], generator=gen),
            "timesteps": adapter.timesteps_from_sigmas(sigmas),
            "sigmas": sigmas,
        },
        "denoising_env": {"prompt_embeds": torch.randn(b, 5, 32, generator=gen),
                          "prompt_embeds_mask": torch.ones(b, 5, dtype=torch.long)},
        "sde_indices": list(request["rollout_sde_step_indices"]),
        "height": request["height"], "width": request["width"],
        "sample_ids": list(extra["sample_ids"]),
        "images": torch.zeros(b, request["height"], request["width"], 3, dtype=torch.uint8),
        "policy_version": 3,
    }


# ---- request ------------------------------------------------------------------------------
def test_request_fields_follow_the_sglang_schema(adapter):
    req = make_request(adapter, sde_indices=[4, 1, 1])
    assert json.loads(json.dumps(req)) == req                      # plain JSON types only
    assert req["prompt"] == PROMPTS and req["seed"] == 42
    assert (req["height"], req["width"], req["num_inference_steps"]) == (H, W, 6)
    assert req["guidance_scale"] == 1.0 and req["rollout"] is True
    assert req["rollout_sde_type"] == "sde" and req["rollout_noise_level"] == 0.7
    assert req["rollout_sde_step_indices"] == [1, 4]               # the keyword wins, sorted, unique
    assert req["rollout_return_dit_trajectory"] and req["rollout_return_denoising_env"]
    extra = req["extra_sampling_params"]
    assert extra["sample_ids"] == IDS and extra["group_index"] == [0, 0, 1, 1]
    assert extra["rollout_id"] == 5 and extra["model_family"] == "qwen_image"
    assert extra["latent_shape"] == list(adapter.latent_shape(Geometry(H, W))) == [64, 16]
    assert extra["init_noise_latent_shape"] == [4, 16, 16]
    assert extra["sigmas"] == adapter.scheduler_sigmas(6, Geometry(H, W)).tolist()
    assert extra["noise_recipe"] == noise.RECIPE and extra["initial_noise_seed"] == 42


def test_request_takes_sde_indices_and_groups_from_the_sampling_config(adapter):
    req = make_request(adapter, group_index=[3, 3, 7, 7])
    assert req["rollout_sde_step_indices"] == [1, 3, 4]
    assert req["extra_sampling_params"]["group_index"] == [3, 3, 7, 7]


def test_request_without_driver_sigmas_or_driver_xt(adapter):
    extra = make_request(adapter, {"driver_sigmas": False, "driver_xt": False})["extra_sampling_params"]
    assert "sigmas" not in extra and "noise_recipe" not in extra and "initial_noise_seed" not in extra


def test_dance_may_train_step_zero(adapter):
    req = make_request(adapter, {"sde_type": "dance"}, sde_indices=[0, 2])
    assert req["rollout_sde_step_indices"] == [0, 2] and req["rollout_sde_type"] == "dance"


def test_driver_keys_of_the_sampling_config_are_accepted(adapter):
    make_request(adapter, {"sde_pool": [1, 2, 3], "num_sde_steps": 2, "sde_resample_per_rollout": True,
                           "sde_timestep_fraction": [0.2, 1.0],
                           "sample_id_mode": "metadata", "init_noise_latent_shape": [4, 16, 16]})


@pytest.mark.parametrize("sampling, kwargs, message", [
    ({"guidance_scale": 0.5}, {}, "guidance_scale must be a number >= 1.0"),
    ({"guidance_scale": True}, {}, "guidance_scale must be a number >= 1.0"),
    ({}, {"sde_indices": [0, 2]}, "steps [0] (sigma == 1): " + TABLE["sde"].sigma_one_problem()),
    ({"sigma_max": 0.99}, {}, "unknown sampling keys ['sigma_max']"),
    ({"sigma_one": "clip"}, {}, "sigma_one must be one of refuse, clamp_to_next"),
    ({}, {"sde_indices": [2, 6]}, "sde_indices [6] are outside [0, 6)"),
    ({"sde_indices": None}, {}, "no SDE steps"),
    ({}, {"sde_indices": []}, "no SDE steps"),
    ({}, {"sde_indices": [1.5]}, "sde_indices must be a list of integers"),
    ({"sde_type": "ode"}, {}, "sde_type must be one of"),
    ({"eta": -0.1}, {}, "eta must be > 0"),
    ({"eta": float("nan")}, {}, "eta must be > 0"),
    ({"height": 30}, {}, "multiples of 4"),
    ({"width": 0}, {}, "width must be a positive integer"),
    ({"num_inference_steps": "12"}, {}, "num_inference_steps must be a positive integer"),
    ({"driver_xt": "yes"}, {}, "driver_xt must be true or false"),
    ({"guidence_scale": 1.0}, {}, "unknown sampling keys ['guidence_scale']"),
    ({"init_noise_latent_shape": [16, 16, 16]}, {}, "does not match this model's x_T shape [4, 16, 16]"),
    ({"init_noise_latent_shape": 4}, {}, "init_noise_latent_shape must be a list of integers"),
    ({}, {"sample_ids": IDS[:3]}, "3 sample ids for 4 prompts"),
    ({}, {"sample_ids": [IDS[0]] * 4}, "duplicate sample ids"),
    ({}, {"sample_ids": ["", *IDS[1:]]}, "not non-empty strings"),
    ({}, {"prompts": ["p", 3, "q", "q"]}, "prompts at positions [1] are not strings"),
    ({}, {"prompts": [], "sample_ids": []}, "no prompts"),
    ({}, {"seed": 1.0}, "seed must be an integer"),
    ({}, {"rollout_id": "5"}, "rollout_id must be an integer or None"),
    ({}, {"group_index": [0, 1]}, "group_index must hold 4 non-negative integers"),
])
def test_each_bad_request_is_rejected(adapter, sampling, kwargs, message):
    with pytest.raises(ValueError) as err:
        make_request(adapter, sampling, **kwargs)
    assert message in str(err.value)


def test_one_error_names_every_request_problem(adapter):
    with pytest.raises(ValueError) as err:
        make_request(adapter, {"guidance_scale": 0.7, "height": 30, "eta": -1},
                     sde_indices=[0, 9], sample_ids=[IDS[0]] * 4)
    text = str(err.value)
    for message in ("guidance_scale must be a number >= 1.0", "multiples of 4", "eta must be",
                    "duplicate sample ids",
                    "outside [0, 6)"):
        assert message in text
    with pytest.raises(ValueError, match="must be a table/dict"):
        adapter.build_rollout_request(PROMPTS, IDS, [("height", 32)], rollout_id=0, seed=0)


# ---- response -----------------------------------------------------------------------------
def test_valid_response_packs_into_a_rollout_batch(adapter):
    req = make_request(adapter)
    resp = fake_response(adapter, req)
    adapter.validate_rollout_response(resp, req)
    batch = adapter.pack_trajectory(resp, req)
    lat = resp["dit_trajectory"]["latents"]
    sig = resp["dit_trajectory"]["sigmas"]
    assert len(batch) == 4 and batch.prompts == PROMPTS and batch.sample_ids == IDS
    assert batch.group_index.tolist() == [0, 0, 1, 1] and batch.sde_indices == [1, 3, 4]
    assert torch.equal(batch.latents, lat[:, :, 0]) and torch.equal(batch.next_latents, lat[:, :, 1])
    assert torch.equal(batch.sigmas, sig[[1, 3, 4]].expand(4, 3))
    assert torch.equal(batch.sigmas_next, sig[[2, 4, 5]].expand(4, 3))
    assert torch.equal(batch.log_probs, resp["rollout_log_probs"])
    assert batch.conditions.keys() == resp["denoising_env"].keys()
    assert (batch.height, batch.width, batch.eta, batch.sde_type) == (H, W, 0.7, "sde")
    assert batch.policy_version == 3 and batch.rollout_id == 5 and batch.images.shape == (4, H, W, 3)
    part = batch.select([3, 1])
    assert part.sample_ids == [IDS[3], IDS[1]] and torch.equal(part.latents, batch.latents[[3, 1]])


def _drop(*path):
    def mutate(resp):
        target = resp
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return mutate


def _set(value, *path):
    def mutate(resp):
        target = resp
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value(target[path[-1]]) if callable(value) else value
    return mutate


@pytest.mark.parametrize("mutate, message", [
    (_drop("height"), "missing 'height'"),
    (_set(64, "width"), "'width' is 64, the request asked for 32"),
    (_drop("sde_indices"), "missing 'sde_indices'"),
    (_set([1, 3], "sde_indices"), "'sde_indices' is [1, 3]"),
    (_drop("rollout_log_probs"), "missing 'rollout_log_probs'"),
    (_set(lambda t: t[:, :2], "rollout_log_probs"), "expected [4, 3] (candidates x SDE steps)"),
    (_set(lambda t: t.index_fill(1, torch.tensor([0]), float("nan")), "rollout_log_probs"), "finite"),
    (_drop("dit_trajectory"), "missing 'dit_trajectory'"),
    (_set([1, 2], "dit_trajectory"), "'dit_trajectory' must be a dict"),
    (_drop("dit_trajectory", "latents"), "missing 'dit_trajectory.latents'"),
    (_set(lambda t: t[:, :, 0], "dit_trajectory", "latents"), "expected [4, 3, 2, 64, 16]"),
    (_set(lambda t: t[:, :, :, :32], "dit_trajectory", "latents"), "expected [4, 3, 2, 64, 16]"),
    (_set(lambda t: t * float("inf"), "dit_trajectory", "latents"), "latents' must be finite"),
    (_drop("dit_trajectory", "sigmas"), "missing 'dit_trajectory.sigmas'"),
    (_set(lambda t: t[:-1], "dit_trajectory", "sigmas"), "'dit_trajectory.sigmas' has shape [6]"),
    (_set(lambda t: t ** 0.5, "dit_trajectory", "sigmas"), "differ from the sigmas the request sent"),
    (_drop("dit_trajectory", "timesteps"), "missing 'dit_trajectory.timesteps'"),
    (_set(lambda t: t[:3], "dit_trajectory", "timesteps"), "has shape [3], expected [6]"),
    (_set(lambda t: t / 1000, "dit_trajectory", "timesteps"), "not the family's timesteps"),
    (_set("abc", "dit_trajectory", "timesteps"), "must be a tensor"),
    (_set([[0.0, 1.0], [2.0]], "rollout_log_probs"), "could not be decoded"),
    (_drop("denoising_env"), "missing 'denoising_env'"),
    (_drop("denoising_env", "prompt_embeds_mask"), "lacks ['prompt_embeds_mask']"),
    (_set(lambda t: t[:2], "denoising_env", "prompt_embeds"), "expected batch-first [4, ...]"),
    (_set(lambda ids: ids[::-1], "sample_ids"), "do not echo the request's sample ids"),
    (_set(7, "sample_ids"), "do not echo the request's sample ids"),
    (_set(lambda t: t.float(), "images"), "expected uint8 [4, 32, 32, 3]"),
    (_set("3", "policy_version"), "'policy_version' must be an integer"),
])
def test_each_bad_response_is_rejected(adapter, mutate, message):
    req = make_request(adapter)
    resp = fake_response(adapter, req)
    mutate(resp)
    with pytest.raises(ValueError) as err:
        adapter.validate_rollout_response(resp, req)
    assert message in str(err.value)
    with pytest.raises(ValueError):
        adapter.pack_trajectory(resp, req)


def test_one_error_names_every_response_problem(adapter):
    req = make_request(adapter)
    resp = fake_response(adapter, req)
    for mutate in (_drop("height"), _drop("sde_indices"), _set(lambda t: t[:1], "rollout_log_probs"),
                   _drop("dit_trajectory", "timesteps")):
        mutate(resp)
    with pytest.raises(ValueError) as err:
        adapter.validate_rollout_response(resp, req)
    text = str(err.value)
    assert "(4 problems)" in text
    for message in ("missing 'height'", "missing 'sde_indices'", "rollout_log_probs' has shape",
                    "missing 'dit_trajectory.timesteps'"):
        assert message in text
    with pytest.raises(ValueError, match="response must be a dict"):
        adapter.validate_rollout_response([resp], req)
    other = type("OtherFamily", (type(adapter),), {"family": "other"})(adapter.model_path)
    with pytest.raises(ValueError, match="built for family 'qwen_image', this adapter is 'other'"):
        other.validate_rollout_response(fake_response(adapter, req), req)


def test_undriven_sigmas_must_still_form_a_schedule(adapter):
    req = make_request(adapter, {"driver_sigmas": False})
    resp = fake_response(adapter, {**req, "extra_sampling_params": {
        **req["extra_sampling_params"], "sigmas": adapter.scheduler_sigmas(6, Geometry(H, W)).tolist()}})
    adapter.validate_rollout_response(resp, req)
    resp["dit_trajectory"]["sigmas"] = resp["dit_trajectory"]["sigmas"].flip(0)
    resp["dit_trajectory"]["timesteps"] = adapter.timesteps_from_sigmas(resp["dit_trajectory"]["sigmas"])
    with pytest.raises(ValueError, match="must decrease from <= 1.0 to 0.0"):
        adapter.validate_rollout_response(resp, req)


def test_json_round_trip_packs_the_same_batch(adapter):
    req = make_request(adapter)
    resp = fake_response(adapter, req)
    resp["dit_trajectory"]["latents"] = resp["dit_trajectory"]["latents"].to(torch.bfloat16)
    wire = json.loads(json.dumps(to_jsonable(resp)))
    assert from_jsonable(wire)["dit_trajectory"]["latents"].dtype == torch.bfloat16
    wire["rollout_log_probs"] = resp["rollout_log_probs"].tolist()      # nested lists also accepted
    wire["dit_trajectory"]["sigmas"] = resp["dit_trajectory"]["sigmas"].tolist()
    direct, via_json = adapter.pack_trajectory(resp, req), adapter.pack_trajectory(wire, req)
    for field in ("latents", "next_latents", "sigmas", "sigmas_next", "log_probs", "images"):
        assert torch.equal(getattr(direct, field), getattr(via_json, field)), field
    for key in direct.conditions:
        assert torch.equal(direct.conditions[key], via_json.conditions[key])
    assert set(ROLLOUT_RESPONSE_FIELDS) <= set(resp)


def test_request_must_come_from_build_rollout_request(adapter):
    with pytest.raises(ValueError, match="build it with build_rollout_request"):
        adapter.validate_rollout_response({}, {"prompt": ["x"]})


# ---- names and noise ----------------------------------------------------------------------
@pytest.mark.parametrize("train, engine", [
    ("transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.to_q.weight"),
    ("base_model.model.transformer_blocks.0.attn.to_q.base_layer.weight",
     "transformer_blocks.0.attn.to_q.weight"),
    ("base_model.model.transformer_blocks.0.attn.to_q.lora_A.default.weight",
     "transformer_blocks.0.attn.to_q.lora_A.weight"),
    ("transformer_blocks.1._checkpoint_wrapped_module.attn.to_out.0.lora_B.default.weight",
     "transformer_blocks.1.attn.to_out.0.lora_B.weight"),
    ("_orig_mod.transformer_blocks.2._fsdp_wrapped_module.img_mlp.net.2.bias",
     "transformer_blocks.2.img_mlp.net.2.bias"),
    ("pos_embed.pos_embed", "pos_embed.pos_embed"),
])
def test_engine_param_name(train, engine):
    assert engine_param_name(train) == engine


def test_weight_name_map_rejects_collisions(adapter):
    names = ["base_model.model.proj_out.weight", "proj_out.weight", "norm.weight"]
    with pytest.raises(ValueError, match="collide.*proj_out.weight"):
        adapter.weight_name_map(names)


def test_noise_streams_are_distinct_and_stable():
    seeds = {noise.stream_seed(1, sid, stream) for sid in ("a", "b") for stream in ("x_T", "step:1", "step:2")}
    assert len(seeds) == 6 and all(0 <= s < 2 ** 63 for s in seeds)
    assert noise.stream_seed(1, "a", "x_T") != noise.stream_seed(2, "a", "x_T")
    draw = noise.gaussian(["a", "b"], "x_T", (3, 5), seed=1, dtype=torch.float64)
    assert draw.shape == (2, 3, 5) and draw.dtype == torch.float64


def test_select_moves_the_row_index_to_each_device_once():
    """Indexing a device tensor with a host index copies the index inside every index op
    (a host-blocking copy on CUDA); select copies it once per device, so no index op gets an
    index from another device, and takes the same rows from each field."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.models.batch import RolloutBatch

    meta = torch.device("meta")
    batch = RolloutBatch(
        prompts=list("abcd"), sample_ids=list("ABCD"), group_index=torch.tensor([0, 0, 1, 1]),
        sde_indices=[0, 2], latents=torch.empty(4, 2, 5, 3, device=meta),
        next_latents=torch.empty(4, 2, 5, 3, device=meta),
        sigmas=torch.arange(8.0).view(4, 2), sigmas_next=torch.arange(8.0).view(4, 2) / 2,
        log_probs=torch.empty(4, 2, device=meta),
        conditions={"embeds": torch.empty(4, 7, 3, device=meta), "mask": torch.ones(4, 7)},
        height=8, width=8, eta=0.7, sde_type="sde")

    class IndexOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.devices: list[tuple[str, str]] = []  # (indexed tensor's, index's) per index op
            self.copies_to_meta = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten.index.Tensor:
                self.devices.append((args[0].device.type, args[1][0].device.type))
            if func is torch.ops.aten._to_copy.default and kwargs.get("device") == meta:
                self.copies_to_meta += 1
            return func(*args, **kwargs)

    with IndexOps() as ops:
        part = batch.select([3, 1])
    assert sorted(ops.devices) == [("cpu", "cpu")] * 4 + [("meta", "meta")] * 4
    assert ops.copies_to_meta == 1
    assert part.prompts == ["d", "b"] and part.group_index.tolist() == [1, 0]
    assert torch.equal(part.sigmas, batch.sigmas[[3, 1]])
    assert torch.equal(part.conditions["mask"], batch.conditions["mask"][[3, 1]])
    assert part.latents.device == meta and part.latents.shape == (2, 2, 5, 3)
    assert part.conditions["embeds"].shape == (2, 7, 3)
