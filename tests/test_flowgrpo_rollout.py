"""The Flow-GRPO reference's sampling through the real embedded engine and the actor's replay:
noise at every step with step 0 clamped, a trained fraction, CFG in both places. Replaying the
packed batch with the same weights must give back the engine's recorded log-probs."""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import ADAPTER_PATH, SAMPLING, FixtureAdapter, build_fixture_model_dir
from trainer.actor.replay import replay_log_probs
from trainer.engine import launch_embedded_engine
from trainer.models.guidance import NEGATIVE_PREFIX
from trainer.rollout import RolloutDriver

pytestmark = pytest.mark.usefixtures("torch_single_thread")

RECORDS = [{"prompt": p, "metadata": {"prompt_id": f"pid{i}"}}
           for i, p in enumerate(["a red panda", "a teacup"])]
REFERENCE = {**SAMPLING, "sde_indices": None, "sde_step_mode": "every_step",
             "timestep_fraction": 0.7, "sigma_one": "clamp_to_next"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = build_fixture_model_dir(tmp_path_factory.mktemp("flowgrpo_rollout"))
    engine = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    in_process=True)
    adapter = FixtureAdapter(str(model_dir))
    yield adapter, engine, adapter.load_train_model()
    engine.close()


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_every_step_rollout_replays_to_the_recorded_log_probs(setup, guidance):
    adapter, engine, model = setup
    driver = RolloutDriver(adapter, [engine], sampling={**REFERENCE, "guidance_scale": guidance},
                           seed=5, task="t2i")
    batch = driver.generate(RECORDS, 2, rollout_id=3, policy_version=0)
    assert batch.sde_indices == [0, 1, 2, 3]  # int(6 * 0.7) = 4 of the 6 noisy steps
    assert batch.sigmas[0, 0].item() == 1.0  # step 0 sampled with noise and trained
    assert torch.isfinite(batch.log_probs).all() and batch.log_probs.shape == (4, 4)
    assert batch.guidance_scale == guidance
    assert batch.sde_options == {"sigma_one": "clamp_to_next", "log_prob_form": "gaussian"}
    has_negative = any(k.startswith(NEGATIVE_PREFIX) for k in batch.conditions)
    assert has_negative == (guidance != 1.0)
    with torch.no_grad():
        replayed = replay_log_probs(adapter, model, batch, backend="torch")
    torch.testing.assert_close(replayed, batch.log_probs, rtol=0, atol=2e-5)


def test_guidance_changes_the_samples(setup):
    """CFG reaches the engine's sampling (not only the request): same noise, other latents."""
    adapter, engine, _ = setup
    latents = []
    for guidance in (1.0, 3.0):
        driver = RolloutDriver(adapter, [engine], sampling={**REFERENCE, "guidance_scale": guidance},
                               seed=5, task="t2i")
        latents.append(driver.generate(RECORDS, 2, rollout_id=3, policy_version=0).next_latents)
    assert (latents[0] - latents[1]).abs().max() > 1e-3


def test_ode_evaluation_samples_without_noise(setup):
    """The reference's eval: sde_step_mode 'ode' (its own step count), deterministic images."""
    adapter, engine, _ = setup
    table = {**REFERENCE, "sde_step_mode": "ode", "num_inference_steps": 8, "guidance_scale": 3.0,
             "timestep_fraction": None, "sigma_one": None}
    images = []
    for seed in (5, 5):
        driver = RolloutDriver(adapter, [engine], sampling=table, seed=seed, task="t2i")
        batch = driver.generate(RECORDS, 2, rollout_id=None, policy_version=0)
        assert batch.sde_indices == [] and batch.log_probs.shape == (4, 0)
        images.append(batch.images)
    assert torch.equal(images[0], images[1])


def test_sidecar_keeps_what_replay_needs(setup, tmp_path):
    """A CFG + clamp_to_next group read back from its audit sidecar replays to its log-probs."""
    from trainer.rollout import load_group_sidecar

    adapter, engine, model = setup
    driver = RolloutDriver(adapter, [engine], sampling={**REFERENCE, "guidance_scale": 3.0},
                           seed=5, task="t2i", artifact_root=str(tmp_path))
    batch = driver.generate(RECORDS, 2, rollout_id=4, policy_version=0)
    sidecar = next(tmp_path.rglob("group_00000000.safetensors"))
    rows = load_group_sidecar(sidecar)
    assert rows.guidance_scale == 3.0 and rows.sde_options == batch.sde_options
    assert set(rows.conditions) == set(batch.conditions)
    with torch.no_grad():
        replayed = replay_log_probs(adapter, model, rows, backend="torch")
    torch.testing.assert_close(replayed, batch.log_probs[:2], rtol=0, atol=2e-5)


def test_cps_reference_form_trains_every_step_including_the_last(setup):
    adapter, engine, model = setup
    table = {**REFERENCE, "sde_type": "cps", "cps_log_prob": "reference", "timestep_fraction": 1.0}
    driver = RolloutDriver(adapter, [engine], sampling=table, seed=5, task="t2i")
    batch = driver.generate(RECORDS, 2, rollout_id=3, policy_version=0)
    assert batch.sde_indices == list(range(6)) and batch.sigmas_next[0, -1].item() == 0.0
    assert batch.sde_options["log_prob_form"] == "squared_residual"
    assert (batch.log_probs[:, -1] == 0).all() and (batch.log_probs[:, :-1] < 0).all()
    with torch.no_grad():
        replayed = replay_log_probs(adapter, model, batch, backend="torch")
    torch.testing.assert_close(replayed, batch.log_probs, rtol=0, atol=1e-6)
