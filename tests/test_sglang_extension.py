"""trainer.engine.sglang.extension loaded into SGLang's own rollout path (sglang==0.5.23) by
SGLang's hook registry, on CPU: the driver's sigmas (through SGLang's timestep stage), x_T and
step noise, ``dance``, kernels.sde_step as the sampler; inert for stock requests. The server is
SGLang's native Qwen-Image pipeline (tests/sglang_fixtures.py says what is SGLang's code); the
replay runs our diffusers transformer from the same checkpoint."""
from __future__ import annotations

import json
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from sglang_fixtures import (assert_served_and_sampled_from, policy_copy, require_sglang,
                             serve_sglang, trainer_overrides)

from trainer.engine.sglang.client import SGLangEngineClient
from trainer.models.geometry import Geometry

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

ROOT = Path(__file__).resolve().parents[1]
IDS = ["prompt:1:sample:0", "prompt:1:sample:1"]
PROMPTS = ["a red panda"] * 2


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # the plugin registered in both processes, as SGLang's loader does for SGLANG_PLUGINS=flowgrpo
    with serve_sglang(tiny_model_dir("qwen_image"), extension=True) as srv:
        yield srv


def _served(server):
    """(adapter, our diffusers transformer with the served checkpoint's weights)."""
    return server.adapter, server.adapter.load_train_model().eval()


#: A schedule SGLang's own grid for the tiny Qwen-Image at 32x32 (shifted, stretched to 0.02)
#: is not: what the driver sends must be what the loop runs.
DRIVER_SIGMAS = [1.0, 0.8, 0.5, 0.2, 0.0]


def _request(adapter, sampling_extra, sde_indices, sigmas=None):
    sampling = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                "driver_sigmas": sigmas is not None, **sampling_extra}
    request = adapter.build_rollout_request(PROMPTS, IDS, sampling, rollout_id=0, seed=7,
                                            sde_indices=sde_indices)
    if sigmas is not None:
        request["extra_sampling_params"]["sigmas"] = list(sigmas)
    return request


def test_entry_point_names_the_plugin():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["sglang.multimodal_gen.plugins"]["flowgrpo"]
    assert target == "trainer.engine.sglang.extension:register"


def test_dance_with_driver_noise_is_our_sampler(server):
    """x_T is the driver's recipe, step i's noise is adapter.step_noise, the step is
    kernels.sde_step ('dance' at sigma = 1 included), the log-prob is the replay's."""
    import flowgrpo_kernels as kernels
    from trainer.actor.replay import replay_log_probs

    adapter, transformer = _served(server)
    request = _request(adapter, {"driver_xt": True, "sde_type": "dance"}, [0, 2])
    with pytest.raises(ValueError, match="stock SGLang rejects"):
        SGLangEngineClient(server.url).generate(request)  # stock client: refused before sending
    response = SGLangEngineClient(server.url, extension=True).generate(request)
    batch = adapter.pack_trajectory(response, request)
    x_t = adapter.initial_latents(IDS, Geometry(32, 32), seed=7)
    assert torch.equal(batch.latents[:, 0], x_t)
    sigmas = response["dit_trajectory"]["sigmas"]
    for b, sid in enumerate(IDS):
        cond = {k: v[b:b + 1] for k, v in batch.conditions.items()}
        with torch.no_grad():
            v = adapter.velocity(transformer, x_t[b:b + 1], sigmas[0], cond, Geometry(32, 32))
        noise = adapter.step_noise([sid], 0, list(x_t.shape[1:]), seed=7)
        step = kernels.sde_step(x_t[b:b + 1], v, float(sigmas[0]), float(sigmas[1]), eta=0.7,
                                sde_type="dance", noise=noise)
        assert torch.allclose(batch.next_latents[b, 0], step.prev_sample[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        replay = replay_log_probs(adapter, transformer, batch, backend="torch")
    assert torch.allclose(replay, batch.log_probs, atol=2e-4, rtol=0)
    again = SGLangEngineClient(server.url, extension=True).generate(request)
    assert torch.equal(again["dit_trajectory"]["latents"], response["dit_trajectory"]["latents"])


@pytest.mark.parametrize("driver_xt", [True, False], ids=["our_sampler", "sglang_sampler"])
def test_driver_sigmas_are_the_schedule_sglang_runs(server, driver_xt):
    """SGLang's timestep stage binds the request's scheduler; the plugin's hook sets its grid
    to the driver's sigmas verbatim (SGLang alone would shift them by mu): the loop steps
    them, the trajectory echoes them, and the replay's log-prob equals the engine's, with our
    sampler (driver noise) or SGLang's (its own noise)."""
    import flowgrpo_kernels as kernels
    from trainer.actor.replay import replay_log_probs

    adapter, transformer = _served(server)
    stock = _request(adapter, {"driver_xt": False, "sde_type": "sde"}, [1, 2])
    served = SGLangEngineClient(server.url).generate(stock)["dit_trajectory"]["sigmas"]
    assert not torch.allclose(served, torch.tensor(DRIVER_SIGMAS), atol=1e-3)

    request = _request(adapter, {"driver_xt": driver_xt, "sde_type": "sde"}, [1, 2],
                       sigmas=DRIVER_SIGMAS)
    with pytest.raises(ValueError, match="stock SGLang rejects"):
        SGLangEngineClient(server.url).generate(request)
    seen = len(server.requests)
    response = SGLangEngineClient(server.url, extension=True).generate(request)
    for req in server.requests[seen:]:  # what SGLang's loop stepped
        assert torch.equal(req["sigmas"], torch.tensor(DRIVER_SIGMAS))
        assert torch.equal(req["timesteps"], req["sigmas"][:-1] * 1000)
    assert torch.equal(response["dit_trajectory"]["sigmas"], torch.tensor(DRIVER_SIGMAS))
    batch = adapter.pack_trajectory(response, request)
    if driver_xt:  # step 1 is kernels.sde_step from the driver's sigma 0.8 to 0.5
        x_1 = batch.latents[:1, 0]
        cond = {k: v[:1] for k, v in batch.conditions.items()}
        with torch.no_grad():
            v = adapter.velocity(transformer, x_1, torch.tensor(0.8), cond, Geometry(32, 32))
        step = kernels.sde_step(x_1, v, 0.8, 0.5, eta=0.7, sde_type="sde",
                                noise=adapter.step_noise(IDS[:1], 1, list(x_1.shape[1:]), seed=7))
        assert torch.allclose(batch.next_latents[0, 0], step.prev_sample[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        replay = replay_log_probs(adapter, transformer, batch, backend="torch")
    assert torch.allclose(replay, batch.log_probs, atol=2e-4, rtol=0)


def test_bad_driver_sigmas_are_a_400(server):
    body = {"prompt": "a cat", "seed": 1, "width": 32, "height": 32, "num_inference_steps": 4,
            "extra_sampling_params": {"flowgrpo": {
                "sample_ids": ["a"], "model_family": "qwen_image", "latent_shape": [64, 16],
                "sde_type": "dance", "sigmas": [1.0, 0.5, 0.7, 0.1]}}}
    detail = _post_400(server.url, body)
    for fragment in ("'sigmas' holds 4 values, num_inference_steps=4 needs 5",
                     "'sigmas' must run from <= 1.0 down to 0.0", "must decrease strictly",
                     "sde_type 'dance' is this plugin's sampler"):
        assert fragment in detail, fragment


def test_hooks_are_inert_for_stock_requests(server):
    adapter, transformer = _served(server)
    from trainer.actor.replay import replay_log_probs

    request = _request(adapter, {"driver_xt": False, "sde_type": "sde"}, [1, 2])
    batch = adapter.pack_trajectory(SGLangEngineClient(server.url).generate(request), request)
    assert not torch.equal(batch.latents[:, 0], adapter.initial_latents(IDS, Geometry(32, 32), seed=7))
    with torch.no_grad():
        replay = replay_log_probs(adapter, transformer, batch, backend="torch")
    assert torch.allclose(replay, batch.log_probs, atol=2e-4, rtol=0)


def test_malformed_block_is_a_400(server):
    body = {"prompt": "a cat", "seed": 1, "width": 32, "height": 32, "num_inference_steps": 4,
            "extra_sampling_params": {"flowgrpo": {"sample_ids": ["a"], "colour": 1}}}
    detail = _post_400(server.url, body)
    assert "unknown key 'colour'" in detail and "missing 'model_family'" in detail


def _post_400(url: str, body: dict) -> str:
    req = urllib.request.Request(url + "/rollout/generate", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == 400
    return json.loads(info.value.read())["detail"]


@pytest.mark.parametrize("driver_sigmas", [False, True], ids=["server_sigmas", "driver_sigmas"])
def test_trainer_step_with_the_extension(server, tiny_model_dir, tmp_path, monkeypatch,
                                         driver_sigmas):
    """rollout.sglang_extension: a training step with dance and the driver's noise through
    SGLang; every candidate starts from the driver's x_T and the replay matches. With
    driver_sigmas the trainer's schedule (here one SGLang's grid is not) is the one sampled."""
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.models.qwen_image import QwenImageAdapter
    from trainer.preflight import preflight

    if driver_sigmas:
        monkeypatch.setattr(QwenImageAdapter, "scheduler_sigmas",
                            lambda self, steps, geometry: torch.tensor(DRIVER_SIGMAS))
    sampling = {"driver_xt": True, "sde_type": "dance", "sde_indices": [0, 2],
                "sde_pool": [0, 1, 2], "sde_resample_per_rollout": False,
                "driver_sigmas": driver_sigmas}
    overrides = trainer_overrides(tiny_model_dir("qwen_image"), server.url, tmp_path, sampling)
    cfg = load_config("tiny", overrides + ["rollout.sglang_extension=true"])
    preflight(cfg, world_size=1, device="cpu")
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        batch = trainer.rollout(0)
        assert batch.sde_indices[0] == 0
        x_t = trainer.adapter.initial_latents(batch.sample_ids, Geometry(32, 32),
                                              seed=cfg.rollout.generation_seed)
        assert torch.equal(batch.latents[:, 0], x_t)
        if driver_sigmas:  # steps 0 and 2 of the driver's schedule
            want = torch.tensor(DRIVER_SIGMAS)
            assert torch.equal(batch.sigmas, want[[0, 2]].expand_as(batch.sigmas))
            assert torch.equal(batch.sigmas_next, want[[1, 3]].expand_as(batch.sigmas))
        metrics = trainer.train_step(1)
        assert metrics["train/logp_parity"] < 2e-4
        assert trainer.engine.committed_version == trainer.policy_version == 1
    finally:
        trainer.close()


def test_training_run_through_the_extension_transport_samples_from_the_synced_weights(
        server, tiny_model_dir, tmp_path):
    """The extension path's twin of test_sglang_api's stock training run: the trainer finds
    the server's weight receiver (GET /flowgrpo/weight_receivers) and every step's weights go
    through our transport into the native DiT (manifest, checksum, commit; no SGLang weight
    route is called), and the next rollout is sampled by them: its recorded log-probs are the
    new policy's replay, not the old one's."""
    from trainer.config import load_config
    from trainer.engine.sglang.transport import SGLangTransport
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    overrides = trainer_overrides(tiny_model_dir("qwen_image"), server.url, tmp_path)
    cfg = load_config("tiny", overrides + ["rollout.sglang_extension=true",
                                           "train.num_rollouts=3", "train.lr=2e-2"])
    preflight(cfg, world_size=1, device="cpu")
    weight_routes = len(server.weight_requests)
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    adapter = server.adapter
    try:
        assert isinstance(trainer.sender, SGLangTransport)
        assert trainer.engine.committed_version == 0
        for step in range(2):
            old = policy_copy(trainer, adapter)
            metrics = trainer.train_step(step)
            new = policy_copy(trainer, adapter)
            assert trainer.policy_version == trainer.engine.committed_version == step + 1
            assert metrics["train/weight_sync_tensors"] > 0
            assert_served_and_sampled_from(trainer, adapter, server, old, new, step)
        assert server.weight_requests[weight_routes:] == []  # the stock routes were never used
    finally:
        trainer.close()


def _connect(server, tiny_model_dir, tmp_path):
    from trainer.config import load_config
    from trainer.engine.sglang.sync import connect_sglang

    overrides = trainer_overrides(tiny_model_dir("qwen_image"), server.url, tmp_path)
    cfg = load_config("tiny", overrides + ["rollout.sglang_extension=true"])
    return connect_sglang(cfg.model, cfg.rollout, cfg.lora, cfg.weight_sync, 0, tmp_path,
                          server.adapter)


def test_receivers_turned_off_fall_back_to_the_stock_sync_with_a_warning(
        server, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """FLOWGRPO_WEIGHT_RECEIVER=0 on the server (its HTTP process reads the same environment):
    the documented fallback, the stock path, said in a warning."""
    from trainer.engine.sglang.sync import SGLangWeightSync

    monkeypatch.setenv("FLOWGRPO_WEIGHT_RECEIVER", "0")
    with caplog.at_level("WARNING"):
        _, sender = _connect(server, tiny_model_dir, tmp_path)
    assert isinstance(sender, SGLangWeightSync)
    assert "FLOWGRPO_WEIGHT_RECEIVER=0" in caplog.text and "stock path" in caplog.text


def test_receivers_on_but_unavailable_are_an_error_not_a_fallback(server, tiny_model_dir,
                                                                  tmp_path, monkeypatch):
    """Receivers on, none published where the server looks (workers that failed to install
    one, or another receiver directory): the trainer stops with the reason."""
    from trainer.engine.sglang.transport import TransportError

    monkeypatch.setenv("FLOWGRPO_RECEIVER_DIR", str(tmp_path / "nobody-published-here"))
    with pytest.raises(TransportError, match="0 SGLang receivers on the CPU.*publishes: none"):
        _connect(server, tiny_model_dir, tmp_path)
