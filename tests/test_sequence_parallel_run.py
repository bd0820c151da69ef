"""Sequence parallelism in a training run: gloo ranks with ``fsdp.sequence_parallel = 2`` train
the tiny Wan 2.1 recipe as one rank trains on the same samples.

Each spawned rank runs the whole loop (``Trainer``): its own engine process rolls out its own
prompt group, the dense video reward of tests/test_family_wan_train.py scores it and its
advantages are normalised within it; then the ranks of each sequence group join their slices
(``trainer.parallel.group_batch``) and replay the joined batch with the transformer's tokens
split between them (diffusers' Ulysses) while FSDP2 shards the LoRA over every rank; the weights
go back into each rank's engine and the run ends with its checkpoint. Every rank records each
batch it trained on, with its advantages and the update's own metrics, and after the last step
the full LoRA tensors and the log-probs of the last batch under them.

The reference is one rank without a process group (no FSDP2, no split: the plain model)
trained through the same update (``trainer.actor.update.train_on``) on the recorded batches of
each data group; with two data groups, the mean of the two groups' gradients, which is what
FSDP2's mean over data groups takes, is the reference's gradient of both batches' losses at
half weight each. Losses, ratios, grad norms, the final LoRA and the log-probs must agree to
fp32 rounding; the step's sample counts and rates must count each sample once.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_fixtures import run_on_gloo_ranks
from test_family_wan_train import shrink
from wan_models import build_tiny_wan_dir

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

CANDIDATES = 4  # n_samples_per_prompt; one prompt group per rank
ROLLOUTS = 2
# compared to fp32 rounding: the split forward sums attention and projections in another
# order than the plain one, and two Adam steps carry that into the weights
RTOL, ATOL = 1e-4, 1e-6


def _sets(tmp: Path, model_dir: Path, world: int) -> list[str]:
    """The tiny Wan recipe of the family's own training test (it writes the prompt files),
    one prompt group per rank, no eval; the sequence degree is left to the caller."""
    return shrink(model_dir, tmp, steps=6, pool=[1, 2, 3]) + [
        f"rollout.rollout_batch_size={world}", f"rollout.n_samples_per_prompt={CANDIDATES}",
        f"rollout.global_batch_size={world * CANDIDATES}", "data.eval_prompt_data=none",
        f"train.num_rollouts={ROLLOUTS}", "train.lr=1e-3", "fsdp.reduce_dtype=fp32",
        "fsdp.master_dtype=fp32", f"launch.nproc={world}"]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _lora(model) -> dict[str, torch.Tensor]:
    from trainer.actor.model import strip_wrapper_names

    return {strip_wrapper_names(n): _full(p) for n, p in model.named_parameters()
            if p.requires_grad}


def _run_rank(tmp_dir: str, sets: list[str]) -> None:
    """One rank of the sequence-parallel run: train, record, save ``rank<r>.pt``."""
    import trainer.loop as loop
    from trainer.actor.model import inner_model
    from trainer.actor.replay import replay_log_probs
    from trainer.config import load_config
    from trainer.preflight import preflight

    tmp, rank, world = Path(tmp_dir), dist.get_rank(), dist.get_world_size()
    cfg = load_config("wan2.1-t2v", sets)
    assert preflight(cfg, world_size=world) == []
    recorded, own = [], []
    train_on, score = loop.train_on, loop.Trainer.score

    def recording_train_on(actor, batch, advantages, rollout_id):
        recorded.append({"batch": batch, "advantages": advantages.clone(),
                         "rollout_id": rollout_id})
        recorded[-1]["metrics"] = train_on(actor, batch, advantages, rollout_id)
        return recorded[-1]["metrics"]

    def recording_score(self, batch):
        own.append(list(batch.sample_ids))
        return score(self, batch)

    loop.train_on, loop.Trainer.score = recording_train_on, recording_score
    trainer = loop.Trainer(cfg, rank=rank, world=world, device="cpu")
    try:
        assert inner_model(trainer.model)._parallel_config is not None  # the split is on
        trainer.train()
        last = recorded[-1]["batch"]
        with torch.no_grad():
            log_probs = replay_log_probs(trainer.adapter, trainer.model, last).float()
        torch.save({"recorded": recorded, "own": own, "lora": _lora(trainer.model),
                    "log_probs": log_probs}, tmp / f"rank{rank}.pt")
    finally:
        trainer.close()


def _one_rank(cfg, model_dir: Path, steps: list[list[dict]]):
    """The plain model trained on each step's batches (one per data group), as FSDP2's mean
    over data groups trains it; returns each step's metrics per group, the LoRA, the actor."""
    from trainer.actor.actor import Actor
    from trainer.actor.model import build_actor, build_optimizer
    from trainer.actor.update import train_on
    from trainer.ema import build_ema
    from trainer.utils.values import import_dotpath

    adapter = import_dotpath(cfg.model.adapter_path)(str(model_dir), **cfg.model.adapter_options)
    model = build_actor(adapter, cfg.train, cfg.fsdp, cfg.lora, torch.device("cpu"),
                        distributed=False, compile=cfg.model.compile)
    actor = Actor(adapter, model, build_optimizer(model, cfg.train), train=cfg.train,
                  fsdp=cfg.fsdp, device="cpu", ema=build_ema(model, cfg.ema),
                  trainable_only=True)
    metrics = []
    for groups in steps:
        assert len(groups) == 1, "two data groups: see _one_rank_of_two_groups"
        metrics.append([train_on(actor, g["batch"], g["advantages"], g["rollout_id"])
                        for g in groups])
    return metrics, _lora(model), actor


def _check_counts(run_dir: Path, samples: int) -> None:
    """Every sample counted once: the rates of the logged steps read ``samples`` per step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    assert len(steps) == ROLLOUTS
    for row in steps:
        assert row["perf/samples_per_s"] == pytest.approx(samples / row["perf/step_time"],
                                                          rel=0.05)
        assert row["perf/train_samples_per_s"] == pytest.approx(
            samples / row["perf/train_time"], rel=0.05)
        assert row["reward/num_groups"] == 1.0  # a rank's own group, scored once
        assert row["train/policy_version"] == steps.index(row) + 1
        assert row["train/first_update_ratio_mean"] == 1.0


def _compare_update(got: dict, want: dict) -> None:
    for key in ("train/loss", "train/ratio_mean", "train/grad_norm", "train/num_microbatches",
                "train/optimizer_steps"):
        assert got[key] == pytest.approx(want[key], rel=RTOL, abs=ATOL), key


def _compare_lora(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and got
    moved = 0
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=RTOL, atol=ATOL, msg=name)
        moved += not torch.equal(tensor, torch.zeros_like(tensor))
    assert moved  # the update moved the LoRA (its B starts at zero)


@pytest.mark.usefixtures("torch_single_thread")
def test_two_ranks_of_one_sequence_group_train_the_tiny_wan_like_one_rank(tmp_path):
    """World 2, degree 2: one data group of two ranks, each rolling out one of the two prompt
    groups; both train on both."""
    from trainer.config import load_config

    model_dir = build_tiny_wan_dir("wan2.1", tmp_path)
    sets = _sets(tmp_path, model_dir, world=2)
    run_on_gloo_ranks(functools.partial(_run_rank, str(tmp_path),
                                        sets + ["fsdp.sequence_parallel=2"]), world=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    # the group's ranks rolled out disjoint slices and trained on both, joined in rank order
    for step in range(ROLLOUTS):
        slices = [ranks[r]["own"][step] for r in range(2)]
        assert not set(slices[0]) & set(slices[1]) and len(slices[0]) == CANDIDATES
        for r in range(2):
            batch = ranks[r]["recorded"][step]["batch"]
            assert batch.sample_ids == slices[0] + slices[1]
            assert batch.group_index.tolist() == [g for g in range(2) for _ in range(CANDIDATES)]
        a, b = (ranks[r]["recorded"][step] for r in range(2))
        assert torch.equal(a["batch"].latents, b["batch"].latents)
        assert torch.equal(a["advantages"], b["advantages"])
        assert a["metrics"] == b["metrics"]  # the same update on both ranks of the group
    _check_counts(tmp_path / "run", 2 * CANDIDATES)
    assert (tmp_path / "ckpt").is_dir()

    cfg = load_config("wan2.1-t2v", sets)
    steps = [[ranks[0]["recorded"][s]] for s in range(ROLLOUTS)]
    metrics, lora, actor = _one_rank(cfg, model_dir, steps)
    for step in range(ROLLOUTS):
        _compare_update(ranks[0]["recorded"][step]["metrics"], metrics[step][0])
    _compare_lora(ranks[0]["lora"], lora)
    from trainer.actor.replay import replay_log_probs
    with torch.no_grad():
        want = replay_log_probs(actor.adapter, actor.model, steps[-1][0]["batch"]).float()
    torch.testing.assert_close(ranks[0]["log_probs"], want, rtol=RTOL, atol=ATOL)
