"""The embedded engine, in-process: determinism per sample id, recorded log-prob == replay,
the sampling loop against a reference loop (diffusers' scheduler for ODE steps), request
validation, release/resume, weight loading, LoRA names, and a real adapter (Qwen-Image)."""
from __future__ import annotations

import pytest
import torch

import flowgrpo_kernels as kernels
from engine_fixtures import (ADAPTER_PATH, FixtureAdapter, build_fixture_model_dir,
                             make_request)
from trainer.engine import EngineStateError, RequestError, launch_embedded_engine
from trainer.engine.embedded.request import parse_generate_request
from trainer.models.geometry import Geometry

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPTS = ["a red panda"] * 3 + ["a teacup"] * 3
IDS = [f"prompt:{g}:sample:{s}" for g in (7, 9) for s in range(3)]


def _launch(model_dir, **kw):
    return launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                  adapter_options=None, device="cpu", dtype="fp32",
                                  lora=kw.pop("lora", None), in_process=True, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_fixture_model_dir(tmp_path_factory.mktemp("fixture_model"))


@pytest.fixture(scope="module")
def adapter(model_dir):
    return FixtureAdapter(str(model_dir))


@pytest.fixture(scope="module")
def engine(model_dir):
    client = _launch(model_dir)
    yield client
    client.close()


def _core(client):
    return client._transport.core


def _assert_same(a, b):
    assert a["sample_ids"] == b["sample_ids"]
    assert torch.equal(a["dit_trajectory"]["latents"], b["dit_trajectory"]["latents"])
    assert torch.equal(a["rollout_log_probs"], b["rollout_log_probs"])
    assert torch.equal(a["images"], b["images"])


def test_same_sample_id_same_result_across_runs_and_engines(engine, model_dir, adapter):
    request = make_request(adapter, PROMPTS, IDS)
    first, again = engine.generate(request), engine.generate(request)
    other = _launch(model_dir)
    try:
        elsewhere = other.generate(request)
    finally:
        other.close()
    _assert_same(first, again)
    _assert_same(first, elsewhere)
    lat = first["dit_trajectory"]["latents"]
    assert lat.shape == (6, 3, 2, *adapter.latent_shape(Geometry(32, 32))) and lat.dtype == torch.float32
    # different candidates of one group (and of different groups) differ
    for i in range(6):
        for j in range(i + 1, 6):
            assert not torch.equal(lat[i], lat[j]), (i, j)
    # another seed changes every candidate
    reseeded = engine.generate(make_request(adapter, PROMPTS, IDS, seed=99))
    assert not torch.equal(reseeded["dit_trajectory"]["latents"][0], lat[0])


def test_recorded_log_prob_equals_replay_exactly(engine, adapter):
    request = make_request(adapter, PROMPTS, IDS)
    batch = adapter.pack_trajectory(engine.generate(request), request)
    actor_model = adapter.load_train_model(dtype=torch.float32)  # the actor's own copy, from disk
    for k in range(len(batch.sde_indices)):
        with torch.no_grad():
            v = adapter.replay_velocity(actor_model, batch, k)
        replayed = kernels.sde_log_prob(batch.latents[:, k], v, batch.next_latents[:, k],
                                        batch.sigmas[:, k], batch.sigmas_next[:, k],
                                        eta=batch.eta, sde_type=batch.sde_type)
        assert torch.equal(replayed, batch.log_probs[:, k]), k


def test_sampler_matches_reference_loop(engine, adapter):
    """SDE (kernels.sde_step with the adapter's step noise) only at the indices, diffusers'
    FlowMatchEulerDiscreteScheduler step everywhere else, x_T from the adapter's recipe."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    request = make_request(adapter, PROMPTS, IDS)
    response = engine.generate(request)
    extra = request["extra_sampling_params"]
    sigmas = extra["sigmas"]
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0)
    sched.set_timesteps(sigmas=sigmas[:-1], device="cpu")
    assert torch.equal(sched.sigmas, torch.tensor(sigmas))
    core = _core(engine)
    cond = adapter.encode_prompts(core.frozen, PROMPTS)
    x = adapter.initial_latents(IDS, Geometry(32, 32), seed=extra["initial_noise_seed"])
    sde = request["rollout_sde_step_indices"]
    pairs, logps = [], []
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            v = adapter.velocity(core.transformer, x, torch.full((6,), sigmas[i]), cond, Geometry(32, 32))
            if i in sde:
                noise = adapter.step_noise(IDS, i, adapter.latent_shape(Geometry(32, 32)), seed=extra["initial_noise_seed"])
                out = kernels.sde_step(x, v, sigmas[i], sigmas[i + 1], eta=0.7, sde_type="sde", noise=noise)
                pairs.append(torch.stack([x, out.prev_sample], 1))
                logps.append(out.log_prob)
                x = out.prev_sample
            else:
                x = sched.step(v, t, x).prev_sample
            sched._step_index = i + 1  # we stepped outside the scheduler on SDE steps
    assert torch.equal(response["dit_trajectory"]["latents"], torch.stack(pairs, 1))
    assert torch.equal(response["rollout_log_probs"], torch.stack(logps, 1))
    assert torch.equal(response["images"], adapter.decode(core.frozen, x, Geometry(32, 32)))
    assert response["dit_trajectory"]["sigmas"].tolist() == pytest.approx(sigmas, abs=0)
    assert torch.equal(response["denoising_env"]["prompt_embeds"], cond["prompt_embeds"])


def test_ode_request_matches_diffusers_scheduler_loop(engine, adapter):
    from diffusers import FlowMatchEulerDiscreteScheduler

    request = make_request(adapter, PROMPTS[:2], IDS[:2])
    request["rollout"] = False
    response = engine.generate(request)
    assert response["sde_indices"] == [] and response["rollout_log_probs"].shape == (2, 0)
    sigmas = request["extra_sampling_params"]["sigmas"]
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0)
    sched.set_timesteps(sigmas=sigmas[:-1], device="cpu")
    core = _core(engine)
    cond = adapter.encode_prompts(core.frozen, PROMPTS[:2])
    x = adapter.initial_latents(IDS[:2], Geometry(32, 32), seed=request["seed"])
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            v = adapter.velocity(core.transformer, x, torch.full((2,), sigmas[i]), cond, Geometry(32, 32))
            x = sched.step(v, t, x).prev_sample
    assert torch.equal(response["images"], adapter.decode(core.frozen, x, Geometry(32, 32)))


def test_request_validation_lists_every_problem(adapter):
    good = make_request(adapter, PROMPTS, IDS)
    assert parse_generate_request(adapter, good).sde_indices == [1, 3, 4]
    bad = dict(good, prompt=PROMPTS[:5], height=30, guidance_scale=0.5, rollout_noise_level=-1,
               rollout_sde_step_indices=[4, 1, 9], rollout_sde_type="euler",
               extra_sampling_params=dict(good["extra_sampling_params"], noise_recipe="other",
                                          sigmas=[1.0, 0.5, 0.7]))
    with pytest.raises(RequestError) as info:
        parse_generate_request(adapter, bad)
    text = "\n".join(info.value.problems)
    for fragment in ("6 sample ids for 5 prompts", "multiples of 16", "guidance_scale",
                     "rollout_noise_level must be", "sorted and unique", "outside [0, 6)",
                     "rollout_sde_type must be", "noise_recipe", "sigmas has 3 values"):
        assert fragment in text, fragment
    shared = dict(good, extra_sampling_params=dict(good["extra_sampling_params"],
                                                   initial_noise_ids=[IDS[0]] * len(IDS)))
    assert parse_generate_request(adapter, shared).initial_noise_ids == [IDS[0]] * len(IDS)
    for ids, why in (([IDS[0]], "must be 6 non-empty strings"), ([""] * 6, "non-empty strings")):
        bad_ids = dict(good, extra_sampling_params=dict(good["extra_sampling_params"],
                                                        initial_noise_ids=ids))
        with pytest.raises(RequestError, match=why):
            parse_generate_request(adapter, bad_ids)
    sde0 = dict(good, rollout_sde_step_indices=[0, 2])
    with pytest.raises(RequestError, match="singular at sigma == 1"):
        parse_generate_request(adapter, sde0)
    with pytest.raises(RequestError, match="must be a JSON object"):
        parse_generate_request(adapter, ["not", "a", "dict"])


def test_release_resume_and_health(engine, adapter):
    assert engine.health()["status"] == "ok"
    info = engine.release()
    assert info["success"] and engine.health()["status"] == "released"
    with pytest.raises(EngineStateError, match="resume"):
        engine.generate(make_request(adapter, PROMPTS[:1], IDS[:1]))
    assert engine.resume()["success"] and engine.health()["released"] is False
    assert engine.generate(make_request(adapter, PROMPTS[:1], IDS[:1]))["images"].shape == (1, 32, 32, 3)


def test_update_weights_from_disk(engine, adapter, model_dir, tmp_path):
    from ipc import weights_checksum

    request = make_request(adapter, PROMPTS[:2], IDS[:2])
    before, checksum0 = engine.generate(request), engine.checksum()
    model = adapter.load_train_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    model.save_pretrained(tmp_path / "transformer")
    try:
        result = engine.update_weights_from_disk(str(tmp_path))
        assert result["success"] and result["tensors"] == len(list(model.parameters()))
        assert engine.checksum() == weights_checksum(dict(model.named_parameters())) != checksum0
        assert not torch.equal(engine.generate(request)["images"], before["images"])
        with pytest.raises(ValueError, match="no \\*.safetensors"):
            engine.update_weights_from_disk(str(tmp_path / "missing"))
    finally:  # restore the module-scoped engine
        engine.update_weights_from_disk(str(model_dir))
    assert engine.checksum() == checksum0


def test_lora_engine_names_match_the_trainers(model_dir, adapter):
    from peft import LoraConfig, get_peft_model

    lora = {"rank": 4, "alpha": 8, "target_modules": ["attn.to_q", "attn.to_v"]}
    client = _launch(model_dir, lora=lora)
    try:
        core = _core(client)
        trainer_model = get_peft_model(adapter.load_train_model(), LoraConfig(
            r=4, lora_alpha=8, target_modules=["attn.to_q", "attn.to_v"], init_lora_weights=True))
        trainer_names = [n for n, _ in trainer_model.named_parameters()]
        mapped = adapter.weight_name_map(trainer_names)
        assert set(core.params) == set(mapped.values())
        assert set(core.modes["adapter"]) == {mapped[n] for n in trainer_names if "lora_" in n}
        assert core.modes["adapter"] and set(core.modes["merge"]).isdisjoint(core.modes["adapter"])
        # B == 0 at init: the LoRA engine samples exactly what the base engine samples
        request = make_request(adapter, PROMPTS[:2], IDS[:2])
        base = _launch(model_dir)
        try:
            _assert_same(client.generate(request), base.generate(request))
        finally:
            base.close()
    finally:
        client.close()


def test_launch_arguments_checked_together(tmp_path):
    with pytest.raises(ValueError) as info:
        launch_embedded_engine(adapter_path="nodots", model_path=str(tmp_path / "nope"),
                               adapter_options=None, device="cuda:7" if not torch.cuda.is_available()
                               else "tpu", dtype="fp16", lora={"rank": 0, "dropout": 0.1, "x": 1},
                               http_port=-1, in_process=True)
    text = str(info.value)
    for fragment in ("adapter_path", "is not a directory", "dtype must be", "device", "lora.rank",
                     "unknown keys", "lora.dropout"):
        assert fragment in text, fragment


@pytest.mark.slow
def test_real_qwen_image_adapter_through_the_engine(tiny_model_dir):
    """The same contract with the real Qwen-Image adapter on its tiny random checkpoint."""
    from tiny_models import ADAPTER_PATHS, TINY_HEIGHT, TINY_WIDTH
    from trainer.models.qwen_image import QwenImageAdapter

    path = tiny_model_dir("qwen_image")
    client = launch_embedded_engine(adapter_path=ADAPTER_PATHS["qwen_image"], model_path=str(path),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    in_process=True)
    try:
        adapter = QwenImageAdapter(str(path))
        sampling = {"height": TINY_HEIGHT, "width": TINY_WIDTH, "num_inference_steps": 4, "eta": 0.7,
                    "sde_type": "sde", "sde_indices": [1, 2]}
        prompts, ids = ["a red panda in a teacup"] * 2, ["prompt:a:sample:0", "prompt:a:sample:1"]
        request = adapter.build_rollout_request(prompts, ids, sampling, rollout_id=3, seed=5)
        response = client.generate(request)
        batch = adapter.pack_trajectory(response, request)  # validates every field
        assert batch.images.shape == (2, TINY_HEIGHT, TINY_WIDTH, 3)
        assert not torch.equal(batch.latents[0], batch.latents[1])
        _assert_same(response, client.generate(request))
        model = adapter.load_train_model(dtype=torch.float32)
        for k in range(2):
            with torch.no_grad():
                v = adapter.replay_velocity(model, batch, k)
            replayed = kernels.sde_log_prob(batch.latents[:, k], v, batch.next_latents[:, k],
                                            batch.sigmas[:, k], batch.sigmas_next[:, k],
                                            eta=batch.eta, sde_type=batch.sde_type)
            assert torch.equal(replayed, batch.log_probs[:, k])
    finally:
        client.close()
