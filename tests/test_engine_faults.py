"""Engine faults: deadlines on every call of a spawned engine (a SIGSTOPped engine is
reported with its stage and state, a SIGKILLed one at once), and the trainer's restart +
re-sync of a failed engine, bounded by rollout.engine_max_restarts."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine_fixtures import ADAPTER_PATH, FixtureAdapter, build_fixture_model_dir, make_request
from trainer.engine import launch_embedded_engine
from trainer.engine.client import EngineError, EngineUnavailableError

pytestmark = [pytest.mark.slow, pytest.mark.multiproc,
              pytest.mark.usefixtures("torch_single_thread")]

PROMPTS = ["a red panda"] * 2 + ["a teacup"] * 2
IDS = [f"prompt:{g}:sample:{s}" for g in (0, 1) for s in (0, 1)]


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def engine(tmp_path):
    model_dir = build_fixture_model_dir(tmp_path / "model")
    client = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32", lora=None,
                                    call_timeout_floor_s=2.0, call_timeout_per_image_s=0.5)
    request = make_request(FixtureAdapter(str(model_dir)), PROMPTS, IDS)
    yield client, request
    _kill(client.pid)
    client.close()


def test_deadline_scales_with_the_request(engine):
    client, request = engine
    assert client._transport.deadline_s("generate", (request,)) == 2.0 + 0.5 * 4
    assert client._transport.deadline_s("checksum", ()) == 2.0
    client.generate(request)                                   # well inside its deadline


def test_stopped_engine_misses_its_deadline_with_stage_and_state(engine):
    client, request = engine
    os.kill(client.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError) as e:
        client.generate(request)
    waited = time.monotonic() - t0
    assert 4.0 <= waited < 8.0, waited                         # 2 s + 0.5 s x 4 images
    msg = str(e.value)
    assert "generate (stage: rollout)" in msg and "4.0 s deadline" in msg
    assert "stopped (SIGSTOP?)" in msg
    with pytest.raises(EngineUnavailableError, match="unusable since"):
        client.checksum()                                      # no late answer is trusted
    process = client._transport.process
    t0 = time.monotonic()
    client.close()                                             # a stopped engine is killed
    assert time.monotonic() - t0 < 10 and not process.is_alive()


def test_killed_engine_is_reported_at_once(engine):
    client, request = engine
    os.kill(client.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=r"died during generate \(stage: rollout\)"):
        client.generate(request)
    assert time.monotonic() - t0 < 2.0


# ---- the trainer restarts and re-syncs -----------------------------------------------------
def _toy_trainer(tmp_path, restarts: int):
    from trainer.config import load_config
    from trainer.loop import Trainer
    cfg = load_config("toy", [
        f"logging.run_dir={tmp_path / 'run'}", "data.eval_prompt_data=none",
        "logging.progress=false", "rollout.write_artifacts=false", "logging.tensorboard=false",
        "rollout.rollout_batch_size=2", "rollout.engine_timeout_floor_s=5",
        "rollout.engine_timeout_per_sample_s=0.5", f"rollout.engine_max_restarts={restarts}"])
    return Trainer(cfg, rank=0, world=1, device="cpu")


def _engine_matches_actor(trainer) -> bool:
    from ipc import weights_checksum
    from trainer.actor.sync import sync_payload
    sent = dict(sync_payload(trainer.model, "full", name_map=trainer._engine_names()))
    return weights_checksum({k: v.to(torch.float32) for k, v in sent.items()}) == \
        trainer.engine.checksum()


def test_trainer_restarts_stopped_engines_then_stops_at_the_budget(tmp_path, caplog):
    """A stopped engine in the rollout, then one stopped in the weight sync's checksum check:
    each is killed, restarted and re-synced (the engine then holds the actor's weights); a
    killed engine with the budget spent stops with a clear error."""
    trainer = _toy_trainer(tmp_path, restarts=2)
    pids = []
    try:
        trainer.train_step(0)
        assert trainer.policy_version == 1
        pids.append(trainer.engine.pid)
        os.kill(pids[-1], signal.SIGSTOP)
        metrics = trainer.train_step(1)                        # restarted, re-synced, trained
        assert trainer.engine_restarts == 1 and trainer.engine.pid != pids[-1]
        assert metrics["train/optimizer_steps"] > 0 and trainer.policy_version == 2
        assert metrics["train/engine_restarts"] == 1.0
        assert trainer.engine.version == 2 and _engine_matches_actor(trainer)
        assert "engine failed during rollout" in caplog.text and "stopped" in caplog.text

        engine = trainer.engine
        real_checksum = engine.checksum
        pids.append(engine.pid)

        def stop_then_checksum():  # the engine stops right when the sync cross-checks it
            engine.checksum = real_checksum
            os.kill(engine.pid, signal.SIGSTOP)
            return real_checksum()
        engine.checksum = stop_then_checksum
        trainer.train_step(2)
        assert trainer.engine_restarts == 2 and trainer.engine.pid != pids[-1]
        assert trainer.policy_version == 3 and trainer.engine.version == 3
        assert _engine_matches_actor(trainer)
        assert "engine failed during weight sync" in caplog.text
        assert "checksum (stage: weight sync (checksum check))" in caplog.text

        pids.append(trainer.engine.pid)
        os.kill(pids[-1], signal.SIGKILL)
        with pytest.raises(EngineError) as e:
            trainer.train_step(3)
        msg = str(e.value)
        assert "engine failed during rollout" in msg and "died during generate" in msg
        assert "restart budget spent (2 of rollout.engine_max_restarts=2)" in msg
    finally:
        for pid in pids:
            _kill(pid)
        trainer.close()
