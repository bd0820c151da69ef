"""The training loop end to end on tiny random models (CPU): rollout through a real engine
process, reward, advantages, replay/update, weight sync through ipc/, eval, metrics.

In-process Trainer (world 1, no process group) for the loop's contracts; one torchrun run
with 2 gloo ranks (FSDP2) for the distributed path.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _prompts(path: Path, n: int = 16) -> Path:
    path.write_text("\n".join(json.dumps({"prompt": f"a photo of a cat number {i}",
                                          "metadata": {"sample_id": f"p{i:03d}"}})
                              for i in range(n)))
    return path


def _overrides(model_dir: Path, tmp: Path, extra: list[str] = ()) -> list[str]:
    return [f"model.adapter_path=trainer.models.sd3.SD3Adapter", f"model.model_path={model_dir}",
            "reward.scorer_path=trainer.rewards.jpeg.JpegCompressibilityScorer",
            "reward.required_components=[]", "reward.component_weights={}",
            f"data.prompt_data={_prompts(tmp / 'prompts.jsonl')}", "data.eval_prompt_data=none",
            f"logging.run_dir={tmp / 'run'}", "logging.progress=false",
            "logging.tensorboard=false", "rollout.write_artifacts=false",
            "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
            "rollout.global_batch_size=none", "train.num_rollouts=2",
            "train.micro_batch_size=2", "train.lr=1e-3", *extra]


@pytest.fixture
def make_trainer(tiny_model_dir, tmp_path):
    from trainer.config import load_config
    from trainer.loop import Trainer

    made = []

    def make(extra: list[str] = ()):
        cfg = load_config("tiny", _overrides(tiny_model_dir("sd3"), tmp_path, extra))
        trainer = Trainer(cfg, rank=0, world=1, device="cpu")
        made.append(trainer)
        return trainer

    yield make
    for t in made:
        t.close()


def test_step_contracts(make_trainer):
    """First update's ratio is exactly 1, later updates move, engine == actor after each sync,
    the version advances once per step."""
    trainer = make_trainer()
    assert trainer.policy_version == 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    m1 = trainer.train_step(0)
    assert m1["train/first_update_ratio_mean"] == 1.0
    assert m1["train/optimizer_steps"] == 2.0
    assert m1["train/ratio_max"] > 1.0 or m1["train/ratio_min"] < 1.0  # update 2 moved
    assert m1["train/logp_parity"] < 1e-4  # replay agrees with the engine's own log-prob
    assert trainer.policy_version == 1 and m1["train/weight_sync_failures"] == 0
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert moved, "the optimizer did not move any weight"
    # the loop already cross-checks after each sync; check it independently too
    from ipc import weights_checksum
    from trainer.actor.sync import sync_payload
    sent = dict(sync_payload(trainer.model, "full", name_map=trainer._engine_names()))
    engine_dtype = torch.float32
    assert weights_checksum({k: v.to(engine_dtype) for k, v in sent.items()}) == \
        trainer.engine.checksum()
    m2 = trainer.train_step(1)
    assert trainer.policy_version == 2 and m2["train/first_update_ratio_mean"] == 1.0
    # model compute measured in place: every part of the step reported, inside the step time
    for m in (m1, m2):
        parts = {k.removeprefix("perf/compute/") for k in m if k.startswith("perf/compute/")}
        assert parts == {"engine_text_encoder", "engine_transformer", "engine_vae",
                         "transformer", "transformer_backward", "reward_model"}, parts
        assert all(m[f"perf/compute/{p}"] > 0 for p in parts)
        assert 0 < m["perf/model_compute_time"] < m["perf/step_time"]
        assert m["perf/outside_compute_share"] == pytest.approx(
            1 - m["perf/model_compute_time"] / m["perf/step_time"])
        # the named outside parts: the optimizer (2 updates) and the sync's phases
        assert 0 < m["perf/outside/optimizer"] < m["perf/train_time"]
        phases = [m[f"weight_sync/{k}_s"] for k in ("prepare", "begin", "write", "commit")]
        assert all(x >= 0 for x in phases) and sum(phases) <= m["weight_sync/seconds"] + 1e-9
        assert m["weight_sync/gb_per_s"] == pytest.approx(
            m["train/weight_sync_gb"] / m["weight_sync/seconds"])


def test_compute_meter_regions_do_not_nest_and_pop_resets():
    import time

    from trainer.profiling import ComputeMeter
    meter = ComputeMeter()
    with meter.region("outer", "cpu"):
        time.sleep(0.02)
        with meter.region("inner", "cpu"):  # inside an open region: not timed twice
            time.sleep(0.02)
    with meter.region("outer", "cpu"):
        time.sleep(0.01)
    got = meter.pop()
    assert set(got) == {"outer"} and got["outer"] >= 0.05
    assert meter.pop() == {}
    with pytest.raises(RuntimeError):
        with meter.region("failed", "cpu"):
            raise RuntimeError("boom")
    with meter.region("after", "cpu"):  # a failed region leaves the meter usable
        pass
    assert set(meter.pop()) == {"after"}  # a region that raised is not counted


def test_single_update_loss_is_zero(make_trainer):
    """--num-updates-per-batch 1: ratio == 1 throughout, so the clipped loss is -mean(A) = 0
    up to rounding (group-centred advantages), by construction."""
    trainer = make_trainer(["train.num_updates_per_batch=1", "train.micro_batch_size=8"])
    m = trainer.train_step(0)
    assert m["train/ratio_mean"] == 1.0 and m["train/clip_fraction"] == 0.0
    assert abs(m["train/loss"]) < 1e-6


def test_sync_failure_rolls_back_and_retries(make_trainer, monkeypatch):
    import ipc
    trainer = make_trainer(["weight_sync.max_retries=1"])
    real = trainer.sender.sync
    calls = []

    def flaky(version, tensors, **kw):
        calls.append(version)
        if len(calls) == 1:
            for _ in tensors:  # consume the payload like a transport that died mid-way
                pass
            raise ipc.WeightSyncError("post-write", ["injected: peer died"], version)
        return real(version, tensors, **kw)

    monkeypatch.setattr(trainer.sender, "sync", flaky)
    m = trainer.train_step(0)
    assert calls == [1, 1]  # the retry rebuilt the same version number
    assert trainer.policy_version == 1 and m["train/weight_sync_failures"] == 1.0

    def dead(version, tensors, **kw):
        raise ipc.WeightSyncError("pre-write", ["injected: manifest mismatch"], version)

    monkeypatch.setattr(trainer.sender, "sync", dead)
    with pytest.raises(ipc.WeightSyncError):
        trainer.train_step(1)
    assert trainer.policy_version == 1  # not advanced


def test_two_ranks_fsdp_gloo(tiny_model_dir, tmp_path):
    """`python -m trainer launch --nproc 2`: torchrun, 2 gloo ranks, FSDP2, one engine each,
    the base model loaded one rank at a time (--fsdp-load-wave-size 1)."""
    sets = _overrides(tiny_model_dir("sd3"), tmp_path, ["train.micro_batch_size=2",
                                                        "fsdp.load_wave_size=1"])
    from trainer.launch import free_port  # a fixed port collides with a concurrent run
    cmd = [sys.executable, "-m", "trainer", "launch", "--config", "tiny", "--nproc", "2",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    last = rows[-1]
    assert last["train/policy_version"] == 2.0
    assert last["train/first_update_ratio_mean"] == 1.0
    assert last["train/weight_sync_failures"] == 0.0
    assert (tmp_path / "run" / "config.toml").exists()


def test_two_nodes_one_host_rendezvous(tiny_model_dir, tmp_path):
    """The multi-node launch path on one host: two launchers as node 0 and node 1
    (--nnodes 2 --node-rank i, one rank each, a local c10d rendezvous), gloo. Both exit 0 and
    global rank 0 logs every step of the 2-rank run."""
    from trainer.launch import free_port
    port = free_port()
    sets = _overrides(tiny_model_dir("sd3"), tmp_path, ["train.micro_batch_size=2"])
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "trainer", "launch", "--config", "tiny", "--nproc", "1",
               "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
               f"127.0.0.1:{port}"]
        for s in sets:
            cmd += ["--set", s]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(o[-3000:] for o in outs)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    assert len(steps) == 2 and steps[-1]["train/policy_version"] == 2.0
    # rates are summed over the world: 2 ranks x (2 groups / 2 ranks) x 4 samples per step
    # (each rank's n / its own step time, averaged: equal to 8 / mean step time within the
    # ranks' small spread of step times; a world of 1 would read half)
    assert steps[-1]["perf/samples_per_s"] == pytest.approx(8 / steps[-1]["perf/step_time"],
                                                            rel=0.05)
