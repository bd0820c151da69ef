"""Engine faults: deadlines on every call of a spawned engine (a SIGSTOPped engine is
reported with its stage and state, a SIGKILLed one at once), and the trainer's restart +
re-sync of a failed engine, bounded by rollout.engine_max_restarts."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

from engine_fixtures import ADAPTER_PATH, FixtureAdapter, build_fixture_model_dir, make_request
from trainer.engine import launch_embedded_engine
from trainer.engine.embedded.client import EngineError, EngineUnavailableError

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
# The engine's checksum covers every weight only after a full sync (an adapter-mode step moves
# the LoRA tensors alone), so these tests, which compare the restarted engine with the actor,
# run the toy recipe with full fine-tuning.
FULL_FINE_TUNING = ("fsdp.trainable_mode=full", "lora.rank=0", "lora.alpha=0", "train.kl_coef=0")


def _toy_trainer(tmp_path, restarts: int, *extra: str):
    from trainer.config import load_config
    from trainer.loop import Trainer
    cfg = load_config("toy", [
        f"logging.run_dir={tmp_path / 'run'}", "data.eval_prompt_data=none",
        "logging.progress=false", "rollout.write_artifacts=false", "logging.tensorboard=false",
        "rollout.rollout_batch_size=2", "rollout.engine_timeout_floor_s=5",
        "rollout.engine_timeout_per_sample_s=0.5", f"rollout.engine_max_restarts={restarts}",
        *FULL_FINE_TUNING, *extra])
    return Trainer(cfg, rank=0, world=1, device="cpu")


def _engine_matches_actor(trainer) -> bool:
    from ipc import weights_checksum
    from trainer.actor.sync import sync_payload
    sent = dict(sync_payload(trainer.model, "full", name_map=trainer._engine_names()))
    # sharded ranks: lazy views whose full_tensor() gathers (every rank in the same order)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sent.items()}
    return weights_checksum({k: v.to(torch.float32) for k, v in full.items()}) == \
        trainer.engine.checksum()


def test_trainer_restarts_stopped_engines_then_stops_at_the_budget(tmp_path, caplog):
    """A stopped engine in the rollout, one stopped in the weight sync's checksum check, one
    stopped during the weight transfer: each is killed, restarted and re-synced (the engine
    then holds the actor's weights); a killed engine with the budget spent stops with a
    clear error."""
    trainer = _toy_trainer(tmp_path, 3, "weight_sync.timeout_s=3", "weight_sync.max_retries=0")
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
        _inject(trainer, "stop at the weight transfer")
        trainer.train_step(3)
        assert trainer.engine_restarts == 3 and trainer.engine.pid != pids[-1]
        assert trainer.policy_version == 4 and trainer.engine.version == 4
        assert _engine_matches_actor(trainer)
        assert "is stopped (SIGSTOP?); the weight transfer failed" in caplog.text

        pids.append(trainer.engine.pid)
        os.kill(pids[-1], signal.SIGKILL)
        with pytest.raises(EngineError) as e:
            trainer.train_step(4)
        msg = str(e.value)
        assert "engine failed during rollout" in msg and "died during generate" in msg
        assert "restart budget spent (3 of rollout.engine_max_restarts=3)" in msg
    finally:
        for pid in pids:
            _kill(pid)
        trainer.close()


def test_restart_budget_counts_every_engine_restarted():
    """The budget counts engines restarted on all ranks: two failing at once need two."""
    from types import SimpleNamespace

    from trainer.engine.recovery import refusal
    rollouts = SimpleNamespace(restartable=True, max_restarts=3, restarts=2)
    assert refusal(rollouts, {1: "died"}) is None
    assert refusal(rollouts, {0: "died", 1: "died"}) == \
        "restarting 2 engines would exceed the budget (2 of rollout.engine_max_restarts=3 used)"
    rollouts.restarts = 3
    assert refusal(rollouts, {1: "died"}) == \
        "restart budget spent (3 of rollout.engine_max_restarts=3)"
    rollouts.restartable, rollouts.restarts = False, 0  # an SGLang server
    assert "SGLang server is not restarted" in refusal(rollouts, {0: "died"})


def test_transfer_failure_of_a_stopped_engine_on_several_ranks_stops_with_the_reason():
    """With more than one rank, a weight transfer that failed because this rank's engine is
    stopped is not restarted (the other ranks are inside the transfer's gathers): an
    EngineError says why. A transfer failure with the engine alive keeps its own error."""
    from types import SimpleNamespace

    import ipc
    import torch.distributed as dist
    from trainer.engine.recovery import engine_down_behind
    from trainer.launch import free_port
    engine = SimpleNamespace(pid=4242, down=lambda: "stopped (SIGSTOP?)")
    trainer = SimpleNamespace(engine=engine, rank=1, world=2)
    failure = ipc.WeightSyncError("pre-write", ["no answer to begin: timed out"], 5)
    assert "engine process 4242 is stopped (SIGSTOP?); the weight transfer failed: no answer " \
           "to begin: timed out" in str(engine_down_behind(SimpleNamespace(engine=engine,
                                                                          rank=0, world=1),
                                                          failure))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)  # trainer.world = 2 above: taken for a multi-rank run
    try:
        with pytest.raises(EngineError, match=r"during weight sync on rank 1: engine process "
                                              r"4242 is stopped .* part-way through the ranks' "
                                              r"gathers"):
            engine_down_behind(trainer, failure)
        engine.down = lambda: None
        assert engine_down_behind(trainer, failure) is None
    finally:
        dist.destroy_process_group()


# ---- two gloo ranks: every rank agrees, restarts and re-syncs together ---------------------
def _inject(trainer, fault: str) -> None:
    engine = trainer.engine
    if fault == "kill":
        os.kill(engine.pid, signal.SIGKILL)
    elif fault == "stop":
        os.kill(engine.pid, signal.SIGSTOP)
    elif fault == "stop at the weight transfer":
        sender, real_sync = trainer.sender, trainer.sender.sync

        def stop_then_sync(*args, **kwargs):  # the receiver never answers the transfer
            sender.sync = real_sync
            os.kill(engine.pid, signal.SIGSTOP)
            return real_sync(*args, **kwargs)
        sender.sync = stop_then_sync
    else:
        real_checksum = engine.checksum

        def stop_then_checksum():  # the engine stops right when the sync cross-checks it
            engine.checksum = real_checksum
            os.kill(engine.pid, signal.SIGSTOP)
            return real_checksum()
        engine.checksum = stop_then_checksum


def _rank_worker(rank: int, world: int, port: int, run_dir: str, out_dir: str,
                 faults: dict, rollouts: int, max_restarts: int) -> None:
    """One rank of ``python -m trainer launch --nproc 2`` (``rank_main``, as torchrun runs it),
    its train_step wrapped to inject ``faults`` ({rollout id: (rank, fault)}, just before that
    rollout's step) and to record, after each step, the policy version, its engine's version
    and whether its engine holds the actor's weights."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    log_fd = os.open(out / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)  # this rank's log, the launcher's "error: rank N: ..." line included
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    from trainer.launch import rank_main
    from trainer.loop import Trainer
    real_step = Trainer.train_step

    def train_step(self, rollout_id):
        target, fault = faults.get(rollout_id, (None, None))
        if target == self.rank:
            _inject(self, fault)
        metrics = real_step(self, rollout_id)
        record = {"rollout": rollout_id, "policy_version": self.policy_version,
                  "engine_version": self.engine.version, "engine_pid": self.engine.pid,
                  "restarts": self.engine_restarts, "matches": _engine_matches_actor(self)}
        with open(out / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return metrics
    Trainer.train_step = train_step
    rc = 99
    try:
        rc = rank_main(["--config", "toy", "--set", f"logging.run_dir={run_dir}",
                        "--set", "data.eval_prompt_data=none", "--set", "logging.progress=false",
                        "--set", "rollout.write_artifacts=false",
                        "--set", "logging.tensorboard=false",
                        "--set", "rollout.rollout_batch_size=2",
                        "--set", "rollout.n_samples_per_prompt=4",
                        "--set", "train.micro_batch_size=2",
                        "--set", f"train.num_rollouts={rollouts}",
                        *[a for o in FULL_FINE_TUNING for a in ("--set", o)],
                        "--set", "checkpoint.save_interval=-1",
                        "--set", "rollout.engine_timeout_floor_s=10",
                        "--set", "rollout.engine_timeout_per_sample_s=0.5",
                        "--set", f"rollout.engine_max_restarts={max_restarts}"])
    except BaseException:  # an unexpected failure: its traceback goes to the rank's log
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # no interpreter teardown: a gloo thread can abort it (test_sync_gather)


def _run_two_ranks(tmp_path, faults: dict, rollouts: int, max_restarts: int):
    """Both ranks' exit codes, logs, per-step records, and rank 0's metrics.jsonl rows."""
    import json

    import torch.multiprocessing as mp

    from trainer.launch import free_port
    out = tmp_path / "out"
    out.mkdir()
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_worker, args=(r, 2, port, str(tmp_path / "run"), str(out),
                                                    faults, rollouts, max_restarts))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    for p in procs:
        if p.is_alive():
            p.kill()
    logs = [(out / f"rank{r}.log").read_text() for r in range(2)]
    records = [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()]
               if (out / f"rank{r}.jsonl").exists() else [] for r in range(2)]
    metrics = tmp_path / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] \
        if metrics.exists() else []
    return [p.exitcode for p in procs], logs, records, rows


def test_two_ranks_restart_and_resync_together(tmp_path):
    """2 gloo ranks, one toy engine each. Rank 1's engine killed before a rollout, rank 0's
    stopped (its deadline passes), rank 1's stopped during the weight sync's checksum check:
    each time both ranks agree, the failed rank restarts its engine, both re-sync, and the
    step completes with every engine at the trainer's policy version holding the actor's
    weights; the run finishes (exit 0 on both ranks)."""
    faults = {1: (1, "kill"), 2: (0, "stop"), 3: (1, "stop at the sync's checksum")}
    codes, logs, records, rows = _run_two_ranks(tmp_path, faults, rollouts=4, max_restarts=3)
    assert codes == [0, 0], "\n----\n".join(t[-4000:] for t in logs)
    for r, text in enumerate(logs):
        assert "error: rank" not in text and "Traceback" not in text, text[-4000:]
        # every rank logged each restart with the failing rank and its cause
        assert "engine failed during rollout on rank 1: engine process" in text
        assert "died during generate (stage: rollout)" in text
        assert "engine failed during rollout on rank 0: engine process" in text
        assert "within its 12.0 s deadline; the process is stopped (SIGSTOP?)" in text
        assert "engine failed during weight sync on rank 1" in text
        assert "checksum (stage: weight sync (checksum check))" in text
        assert [x["rollout"] for x in records[r]] == [0, 1, 2, 3]
        assert [x["policy_version"] for x in records[r]] == [1, 2, 3, 4]
        assert [x["engine_version"] for x in records[r]] == [1, 2, 3, 4]
        assert [x["restarts"] for x in records[r]] == [0, 1, 2, 3]
        assert all(x["matches"] for x in records[r]), records[r]
    a, b, c, d = [x["engine_pid"] for x in records[0]]
    assert a == b != c == d                                  # rank 0: restarted in rollout 2
    a, b, c, d = [x["engine_pid"] for x in records[1]]
    assert a != b == c != d and a != d                       # rank 1: in rollouts 1 and 3
    assert [row["train/engine_restarts"] for row in rows] == [0.0, 1.0, 2.0, 3.0]
    assert rows[-1]["train/policy_version"] == 4.0


def test_two_ranks_stop_together_when_the_restart_budget_is_spent(tmp_path):
    """rollout.engine_max_restarts=0 and rank 1's engine killed before rollout 1: both ranks
    exit 1, each printing the same message naming rank 1, the stage and the cause."""
    codes, logs, records, _ = _run_two_ranks(tmp_path, {1: (1, "kill")}, rollouts=3,
                                             max_restarts=0)
    assert codes == [1, 1], "\n----\n".join(t[-4000:] for t in logs)
    for r, text in enumerate(logs):
        errors = [line for line in text.splitlines() if line.startswith("error: rank")]
        assert len(errors) == 1, text[-4000:]
        assert errors[0].startswith(f"error: rank {r}: engine failed during rollout on rank 1: "
                                    "engine process ")
        assert "died during generate (stage: rollout)" in errors[0]
        assert "not restarting it: restart budget spent (0 of " \
               "rollout.engine_max_restarts=0)" in errors[0]
        assert "Traceback" not in text, text[-4000:]
        assert [x["rollout"] for x in records[r]] == [0]
