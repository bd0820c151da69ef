"""trainer.engine.sglang_extension loaded into SGLang's own rollout path (sglang==0.5.23) by
SGLang's hook registry, on CPU: the driver's x_T and step noise, ``dance``, kernels.sde_step as
the sampler; inert for stock requests. tests/sglang_fixtures.py says what is SGLang's code."""
from __future__ import annotations

import json
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from sglang_fixtures import require_sglang, serve_sglang, trainer_overrides

from trainer.engine.sglang_client import SGLangEngineClient

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

ROOT = Path(__file__).resolve().parents[1]
IDS = ["prompt:1:sample:0", "prompt:1:sample:1"]
PROMPTS = ["a red panda"] * 2


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_sglang(tiny_model_dir("qwen_image")) as srv:
        from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry

        from trainer.engine import sglang_extension

        sglang_extension.register()  # what SGLang's loader calls for SGLANG_PLUGINS=flowgrpo
        HookRegistry.apply_hooks()
        yield srv


def _request(adapter, sampling_extra, sde_indices):
    sampling = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                "driver_sigmas": False, **sampling_extra}
    return adapter.build_rollout_request(PROMPTS, IDS, sampling, rollout_id=0, seed=7,
                                         sde_indices=sde_indices)


def test_entry_point_names_the_plugin():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["sglang.multimodal_gen.plugins"]["flowgrpo"]
    assert target == "trainer.engine.sglang_extension:register"


def test_dance_with_driver_noise_is_our_sampler(server):
    """x_T is the driver's recipe, step i's noise is adapter.step_noise, the step is
    kernels.sde_step ('dance' at sigma = 1 included), the log-prob is the replay's."""
    import kernels
    from trainer.actor.replay import replay_log_probs

    adapter, transformer = server.scheduler.adapter, server.scheduler.transformer
    request = _request(adapter, {"driver_xt": True, "sde_type": "dance"}, [0, 2])
    with pytest.raises(ValueError, match="stock SGLang rejects"):
        SGLangEngineClient(server.url).generate(request)  # stock client: refused before sending
    response = SGLangEngineClient(server.url, extension=True).generate(request)
    batch = adapter.pack_trajectory(response, request)
    x_t = adapter.initial_latents(IDS, 32, 32, seed=7)
    assert torch.equal(batch.latents[:, 0], x_t)
    sigmas = response["dit_trajectory"]["sigmas"]
    for b, sid in enumerate(IDS):
        cond = {k: v[b:b + 1] for k, v in batch.conditions.items()}
        with torch.no_grad():
            v = adapter.velocity(transformer, x_t[b:b + 1], sigmas[0], cond, 32, 32)
        noise = adapter.step_noise([sid], 0, list(x_t.shape[1:]), seed=7)
        step = kernels.sde_step(x_t[b:b + 1], v, float(sigmas[0]), float(sigmas[1]), eta=0.7,
                                sde_type="dance", noise=noise)
        assert torch.allclose(batch.next_latents[b, 0], step.prev_sample[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        replay = replay_log_probs(adapter, transformer, batch, backend="torch")
    assert torch.allclose(replay, batch.log_probs, atol=2e-4, rtol=0)
    again = SGLangEngineClient(server.url, extension=True).generate(request)
    assert torch.equal(again["dit_trajectory"]["latents"], response["dit_trajectory"]["latents"])


def test_hooks_are_inert_for_stock_requests(server):
    adapter, transformer = server.scheduler.adapter, server.scheduler.transformer
    from trainer.actor.replay import replay_log_probs

    request = _request(adapter, {"driver_xt": False, "sde_type": "sde"}, [1, 2])
    batch = adapter.pack_trajectory(SGLangEngineClient(server.url).generate(request), request)
    assert not torch.equal(batch.latents[:, 0], adapter.initial_latents(IDS, 32, 32, seed=7))
    with torch.no_grad():
        replay = replay_log_probs(adapter, transformer, batch, backend="torch")
    assert torch.allclose(replay, batch.log_probs, atol=2e-4, rtol=0)


def test_malformed_block_is_a_400(server):
    body = {"prompt": "a cat", "seed": 1, "width": 32, "height": 32, "num_inference_steps": 4,
            "extra_sampling_params": {"flowgrpo": {"sample_ids": ["a"], "colour": 1}}}
    req = urllib.request.Request(server.url + "/rollout/generate", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    assert info.value.code == 400
    detail = json.loads(info.value.read())["detail"]
    assert "unknown key 'colour'" in detail and "missing 'noise_recipe'" in detail


def test_trainer_step_with_the_extension(server, tiny_model_dir, tmp_path):
    """rollout.sglang_extension: a training step with dance and the driver's noise through
    SGLang; every candidate starts from the driver's x_T and the replay matches."""
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    sampling = {"driver_xt": True, "sde_type": "dance", "sde_indices": [0, 2],
                "sde_pool": [0, 1, 2], "sde_resample_per_rollout": False}
    overrides = trainer_overrides(tiny_model_dir("qwen_image"), server.url, tmp_path, sampling)
    cfg = load_config("tiny", overrides + ["rollout.sglang_extension=true"])
    preflight(cfg, world_size=1, device="cpu")
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        batch = trainer.rollout(0)
        assert batch.sde_indices[0] == 0
        x_t = trainer.adapter.initial_latents(batch.sample_ids, 32, 32,
                                              seed=cfg.rollout.generation_seed)
        assert torch.equal(batch.latents[:, 0], x_t)
        metrics = trainer.train_step(1)
        assert metrics["train/logp_parity"] < 2e-4
        assert trainer.engine.committed_version == trainer.policy_version == 1
    finally:
        trainer.close()
