"""Save -> resume reproduces the uninterrupted run bit for bit (one process, and 2 ranks of
FSDP2 on gloo under torchrun); sidecars, rotation, failure accounting, contract refusal."""
import json
import logging
import shutil

import pytest
import torch

import test_checkpoint_harness as h
from trainer.checkpoint import (CheckpointError, ContractMismatchError, latest_committed,
                                load_checkpoint, save_checkpoint)
from trainer.checkpoint import layout

pytestmark = pytest.mark.usefixtures("torch_single_thread")
K = h.RESUME_STEPS  # steps before the save


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return h.save_tinynet(tmp_path_factory.mktemp("tinynet"))


def trained(model_dir, root, lora, steps=K, **kw):
    tr = h.make_trainer(model_dir, root, lora=lora, **kw)
    h.seed_all(7)
    for _ in range(steps):
        h.train_step(tr)
    return tr


def assert_same_step(ref, got):
    for key in ("loss", "sample"):
        assert torch.equal(ref[key], got[key]), key
    assert (ref["scale"], ref["shift"]) == (got["scale"], got["shift"])
    assert ref["weights"].keys() == got["weights"].keys()
    for k in ref["weights"]:
        assert torch.equal(ref["weights"][k], got["weights"][k]), k


def step_record(tr):
    rec = h.train_step(tr)
    rec["weights"] = h.trainable_weights(tr)
    return rec


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_in_one_process_is_bit_exact(model_dir, tmp_path, lora):
    tr = trained(model_dir, tmp_path, lora)
    assert save_checkpoint(tr, K) is not None
    ref = step_record(tr)

    fresh = h.make_trainer(model_dir, tmp_path, lora=lora)
    h.seed_all(99)
    control = step_record(h.make_trainer(model_dir, tmp_path / "unused", lora=lora))
    assert not torch.equal(control["loss"], ref["loss"])  # without the resume it differs
    assert load_checkpoint(fresh, tmp_path).name == layout.iter_name(K)
    assert (fresh.next_rollout, fresh.policy_version, fresh.lr_steps) == (K, K, K)
    assert_same_step(ref, step_record(fresh))


def test_a_compiled_actors_checkpoint_resumes_into_an_eager_one(model_dir, tmp_path):
    """CUDA compiles the blocks by default and a CPU run does not: a checkpoint written by a
    compiled LoRA actor loads into an eager one with the same names and values."""
    from trainer.models.compile import compile_events
    before = compile_events()
    tr = trained(model_dir, tmp_path, True, extra=["model.compile=blocks"])
    assert compile_events() > before  # the blocks did run compiled
    assert save_checkpoint(tr, K) is not None
    saved = h.trainable_weights(tr)
    fresh = h.make_trainer(model_dir, tmp_path, lora=True)
    assert load_checkpoint(fresh, tmp_path).name == layout.iter_name(K)
    got = h.trainable_weights(fresh)
    assert got.keys() == saved.keys()
    for name in saved:
        assert torch.equal(got[name], saved[name]), name


def test_checkpoint_files_and_sidecars(model_dir, tmp_path):
    from ipc.protocol import manifest_hash
    from torch.distributed.checkpoint import FileSystemReader
    tr = trained(model_dir, tmp_path, lora=True)
    d = save_checkpoint(tr, K)
    assert d == tmp_path / "t2i" / "iter_0000003"
    for name in ("fsdp/.metadata", "rng_rank0.pt", "trainer_state.json",
                 "weight_sync_manifest.json", "adapter_contract.json", "COMMITTED"):
        assert (d / name).is_file(), name
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    assert (tmp_path / "t2i" / "latest_checkpointed_iteration.txt").read_text() == "3\n"
    state = json.loads((d / "trainer_state.json").read_text())
    assert (state["rollout_id"], state["policy_version"], state["lr_scheduler_steps"]) == (2, 3, 3)
    assert state["task"] == "t2i" and state["trainable_mode"] == "lora"
    assert len(state["sampling_fingerprint"]) == 16
    contract = json.loads((d / "adapter_contract.json").read_text())
    assert (contract["mode"], contract["rank"], contract["alpha"]) == ("lora", 4, 8.0)
    assert contract["target_modules"] == ["to_q", "to_v"]
    assert contract["base_model_hash"].startswith("sha256:")
    # the model part of a LoRA checkpoint is the adapter and nothing else
    meta = FileSystemReader(str(d / "fsdp")).read_metadata().state_dict_metadata
    model_keys = [k for k in meta if k.startswith("model.")]
    assert len(model_keys) == 2 * 2 * 2 and all(".lora_" in k for k in model_keys)
    # merge-mode sync: plain names, merged shapes, nothing LoRA
    manifest = json.loads((d / "weight_sync_manifest.json").read_text())
    plain = h.TinyNet().state_dict()
    assert manifest["mode"] == "merge"
    assert [e[0] for e in manifest["entries"]] == list(plain)
    assert [tuple(e[1]) for e in manifest["entries"]] == [tuple(v.shape) for v in plain.values()]
    assert manifest["hash"] == manifest_hash([tuple(e) for e in manifest["entries"]])
    assert manifest["nbytes"] == sum(v.numel() * 2 for v in plain.values())  # bf16 engine
    listed = json.loads((d / "COMMITTED").read_text())["files"]
    assert "fsdp/.metadata" in listed and "rng_rank0.pt" in listed


def test_rotation_keeps_newest_n(model_dir, tmp_path):
    tr = h.make_trainer(model_dir, tmp_path, lora=False)
    for n in range(1, 6):
        save_checkpoint(tr, n)
    assert [n for n, _ in layout.iteration_dirs(tmp_path / "t2i")] == [4, 5]
    tr.cfg.checkpoint.max_actor_ckpt_to_keep = 0
    for n in (6, 7, 8):
        save_checkpoint(tr, n)
    assert [n for n, _ in layout.iteration_dirs(tmp_path / "t2i")] == [4, 5, 6, 7, 8]


class RecordingMetrics:
    def __init__(self):
        self.rows = []

    def log(self, step, metrics, console=True):
        self.rows.append((step, dict(metrics)))


def test_failed_write_is_counted_and_training_goes_on(model_dir, tmp_path, monkeypatch,
                                                      caplog):
    import trainer.checkpoint.shards as shards
    tr = trained(model_dir, tmp_path, lora=False)
    tr.metrics = RecordingMetrics()
    first = save_checkpoint(tr, 1)
    real_save = shards.dcp.save

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shards.dcp, "save", disk_full)
    with caplog.at_level(logging.ERROR, "trainer.checkpoint"):
        assert save_checkpoint(tr, 2) is None
    assert "CHECKPOINT FAILED" in caplog.text and "No space left" in caplog.text
    assert tr.checkpoint_failures == 1
    assert tr.metrics.rows == [(2, {"train/checkpoint_failures": 1.0})]
    assert not (tmp_path / "t2i" / "iter_0000002" / "COMMITTED").exists()
    assert latest_committed(tmp_path) == first
    assert (tmp_path / "t2i" / "latest_checkpointed_iteration.txt").read_text() == "1\n"

    monkeypatch.setattr(shards.dcp, "save", real_save)
    h.train_step(tr)  # training went on
    assert save_checkpoint(tr, 3) is not None
    assert [n for n, _ in layout.iteration_dirs(tmp_path / "t2i")] == [1, 3]  # leftover gone
    resumed = h.make_trainer(model_dir, tmp_path, lora=False)
    load_checkpoint(resumed, tmp_path)
    assert resumed.checkpoint_failures == 1  # the counter survives a resume


def test_resume_refuses_a_different_contract(model_dir, tmp_path):
    tr = trained(model_dir, tmp_path / "ckpt", lora=True, steps=1)
    save_checkpoint(tr, 1)
    other_base = tmp_path / "other_base"
    shutil.copytree(model_dir, other_base)
    h.save_tinynet(other_base, seed=1)  # same architecture, other weights
    changed = h.make_trainer(other_base, tmp_path / "ckpt", lora=True,
                             extra=["lora.alpha=16", 'lora.target_modules=["to_q"]'])
    with pytest.raises(ContractMismatchError) as e:
        load_checkpoint(changed, tmp_path / "ckpt")
    text = str(e.value)
    for key in ("alpha: checkpoint has 8.0, current config has 16.0", "target_modules:",
                "base_model_hash:"):
        assert key in text
    full = h.make_trainer(model_dir, tmp_path / "ckpt", lora=False)
    with pytest.raises(ContractMismatchError, match="mode: checkpoint has 'lora'"):
        load_checkpoint(full, tmp_path / "ckpt")


def test_resume_without_a_committed_checkpoint_says_why(model_dir, tmp_path):
    (tmp_path / "t2i" / "iter_0000004" / "fsdp").mkdir(parents=True)
    tr = h.make_trainer(model_dir, tmp_path, lora=False)
    with pytest.raises(CheckpointError, match="iter_0000004: no COMMITTED marker"):
        load_checkpoint(tr, tmp_path)


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_rank_fsdp_resume_is_bit_exact(model_dir, tmp_path):
    """Process 1 trains K steps on 2 ranks, saves, trains step K+1; process 2 resumes from
    the save (with other seeds, and an uncommitted newer iteration on disk) and trains step
    K+1: loss, RNG-driven samples and weights must be identical on both ranks."""
    h.run_phases(tmp_path, model_dir, nproc=2, device="cpu")
    assert sorted(p.name for p in tmp_path.glob("resume_*_rank0.pt")) == \
        ["resume_full_rank0.pt", "resume_lora_rank0.pt"]
    assert h.compare_runs(tmp_path, nproc=2) == []
    for rank in (0, 1):
        report = json.loads((tmp_path / f"reference_report_rank{rank}.json").read_text())
        assert report["failed_save_returned"] == "None"     # rank 1's RNG write failed
        assert report["failures_after_write_error"] == 1     # counted on both ranks
        assert report.get("partial_dir_left") is not True   # rank 0 removed the partial save
        assert "failed on rank 0" in report["rotation_error"]  # raised on both ranks
    task = tmp_path / "ckpt_full" / "t2i"
    assert not (task / "iter_0000005" / "COMMITTED").exists()
    assert latest_committed(tmp_path / "ckpt_full") == task / "iter_0000003"


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_nccl_resume_is_bit_exact(model_dir, tmp_path):
    """The same on GPUs: nccl collectives, CUDA RNG, and a save of an offloaded actor."""
    nproc = min(2, torch.cuda.device_count())
    h.run_phases(tmp_path, model_dir, nproc=nproc, device="cuda")
    assert h.compare_runs(tmp_path, nproc=nproc) == []


def test_fingerprint_without_a_driver_matches_the_drivers(model_dir, tmp_path):
    from trainer.checkpoint.contract import sampling_fingerprint
    from trainer.rollout.artifacts import sampling_fingerprint as drivers
    tr = h.make_trainer(model_dir, tmp_path, lora=False, extra=["rollout.sampling={\"eta\": 0.3}"])
    assert sampling_fingerprint(tr) == drivers(tr.cfg.rollout.sampling.to_dict())


@pytest.mark.slow
@pytest.mark.multiproc
def test_real_trainer_resumes_exactly(tiny_model_dir, tmp_path):
    """The real loop (engine process, rewards, weight sync) on a tiny SD3: save after
    rollout 0, resume in a new Trainer, and rollout 1 gives the same metrics; the engine is
    re-synced with the restored weights."""
    from ipc import weights_checksum
    from trainer.actor.sync import sync_payload
    from trainer.config import load_config
    from trainer.loop import Trainer
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"a cat number {i}",
                                             "metadata": {"sample_id": f"p{i}"}})
                                 for i in range(8)))
    cfg = load_config("tiny", [
        "model.adapter_path=trainer.models.sd3.SD3Adapter",
        f"model.model_path={tiny_model_dir('sd3')}",
        "reward.scorer_path=trainer.rewards.jpeg.JpegCompressibilityScorer",
        "reward.required_components=[]", "reward.component_weights={}",
        f"data.prompt_data={prompts}", "data.eval_prompt_data=none",
        f"logging.run_dir={tmp_path / 'run'}", "logging.progress=false",
        "logging.tensorboard=false", "rollout.write_artifacts=false",
        "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
        "rollout.global_batch_size=none", "train.num_rollouts=2", "train.micro_batch_size=2",
        "train.lr=1e-3", "train.lr_warmup_iters=5", f"checkpoint.save={tmp_path / 'ckpt'}"])
    keys = ("train/loss", "train/grad_norm", "train/lr", "reward/mean", "train/ratio_mean",
            "train/policy_version")
    first = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        first.train_step(0)
        first.next_rollout = 1
        assert save_checkpoint(first, 1) is not None
        want = first.train_step(1)
    finally:
        first.close()
    second = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        load_checkpoint(second, tmp_path / "ckpt")
        assert (second.next_rollout, second.policy_version, second.lr_steps) == \
            (1, 1, first.lr_steps // 2)
        sent = dict(sync_payload(second.model, "full", name_map=second._engine_names()))
        assert weights_checksum({k: v.float() for k, v in sent.items()}) == \
            second.engine.checksum()
        got = second.train_step(1)
    finally:
        second.close()
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
