"""Sequence parallelism in a training run: gloo ranks with ``fsdp.sequence_parallel = 2`` train
as plain ranks train on the same samples.

Each spawned rank runs the whole loop (``Trainer``): its own engine process rolls out its own
prompt group, the reward scores it and its advantages are normalised within it; then the ranks
of each sequence group join their slices (``trainer.parallel.group_batch``) and replay the
joined batch with the transformer's tokens split between them (diffusers' Ulysses) while FSDP2
shards the trained weights over every rank; the weights go back into each rank's engine and the
run ends with its checkpoint. Every rank records each batch it trained on, with its advantages
and the update's own metrics, and after the last step the full trained tensors and the log-probs
of the last batch under them.

The reference trains on the recorded batches through the same update
(``trainer.actor.update.train_on``) without the split: one data group is one rank without a
process group (no FSDP2: the plain model); two data groups are two plain FSDP2 ranks, one per
group's batches. Losses, ratios, grad norms, the final weights and the log-probs must agree to
fp32 rounding; the logged sample counts and rates must count each sample once.

Families: the tiny Wan 2.1 recipe (LoRA; the dense video reward of
tests/test_family_wan_train.py; Flow-GRPO with activation checkpointing, and DiffusionNFT) and
the tiny Qwen-Image under the ``tiny`` recipe (full training; prompts of several lengths,
unaligned by the adapter, so the joined batch pads the text of one rank's slice to the other's
and the split pads an odd length with a masked token). Last, a save and resume of a
sequence-parallel run reproduces its next step to the last bit.
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

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

CANDIDATES = 4  # n_samples_per_prompt; one prompt group per rank
ROLLOUTS = 2
# fp32 rounding: the split forward sums attention and projections in another order than the
# plain one, and two steps of Adam (which divides by the gradient's own scale) carry that
# into the weights
RTOL, ATOL = 1e-4, 1e-6


def _common(tmp: Path, world: int) -> list[str]:
    return [f"rollout.rollout_batch_size={world}", f"rollout.n_samples_per_prompt={CANDIDATES}",
            f"rollout.global_batch_size={world * CANDIDATES}", "data.eval_prompt_data=none",
            f"train.num_rollouts={ROLLOUTS}", "train.micro_batch_size=2",
            "fsdp.param_dtype=fp32", "fsdp.reduce_dtype=fp32", "fsdp.master_dtype=fp32",
            f"logging.run_dir={tmp / 'run'}", "logging.progress=false",
            "logging.tensorboard=false", "rollout.write_artifacts=false",
            f"checkpoint.save={tmp / 'ckpt'}", f"launch.nproc={world}"]


def _wan(tmp: Path, world: int) -> tuple[str, Path, list[str]]:
    """The tiny Wan recipe of the family's own training test (it writes the prompt files)."""
    model_dir = build_tiny_wan_dir("wan2.1", tmp)
    sets = shrink(model_dir, tmp, steps=6, pool=[1, 2, 3]) + ["train.lr=1e-3"]
    return "wan2.1-t2v", model_dir, sets + _common(tmp, world)


_PROMPTS = ["a cat", "a photo of a cat sitting on a red chair", "a red panda in a teacup",
            "two dogs playing in the snow at sunset, digital art"]


def _qwen(tmp: Path, world: int, model_dir: Path) -> tuple[str, Path, list[str]]:
    """The tiny recipe on the tiny Qwen-Image, trained in full; text lengths left unaligned."""
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "metadata": {"sample_id": f"p{i}"}})
                                 for i, p in enumerate(_PROMPTS * 2)))
    sets = ["model.adapter_path=trainer.models.qwen_image.QwenImageAdapter",
            f"model.model_path={model_dir}", 'model.adapter_options={"joint_tokens_multiple": 1}',
            "reward.scorer_path=trainer.rewards.jpeg.JpegCompressibilityScorer",
            "reward.required_components=[]", "reward.component_weights={}",
            f"data.prompt_data={prompts}", "train.lr=1e-4"]
    return "tiny", model_dir, sets + _common(tmp, world)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _trained(model) -> dict[str, torch.Tensor]:
    from trainer.actor.model import strip_wrapper_names

    return {strip_wrapper_names(n): _full(p) for n, p in model.named_parameters()
            if p.requires_grad}


def _log_probs(adapter, model, batch) -> torch.Tensor | None:
    """The trained SDE steps' log-probs under ``model`` (None: an ODE rollout has none)."""
    from trainer.actor.replay import replay_log_probs

    if not batch.sde_indices:
        return None
    with torch.no_grad():
        return replay_log_probs(adapter, model, batch).float()


def _run_rank(tmp_dir: str, recipe: str, sets: list[str]) -> None:
    """One rank of the sequence-parallel run: train, record, save ``rank<r>.pt``."""
    import trainer.loop as loop
    from trainer.actor.model import inner_model
    from trainer.config import load_config
    from trainer.preflight import preflight

    tmp, rank, world = Path(tmp_dir), dist.get_rank(), dist.get_world_size()
    cfg = load_config(recipe, sets)
    assert preflight(cfg, world_size=world) == []
    recorded, own = [], []
    score = loop.Trainer.score

    def recording(update):
        def record(actor, batch, advantages, rollout_id, *args):
            recorded.append({"batch": batch, "advantages": advantages.clone(),
                             "rollout_id": rollout_id, "args": args})
            recorded[-1]["metrics"] = update(actor, batch, advantages, rollout_id, *args)
            return recorded[-1]["metrics"]
        return record

    def recording_score(self, batch):
        own.append(list(batch.sample_ids))
        return score(self, batch)

    loop.train_on, loop.nft_train_on = recording(loop.train_on), recording(loop.nft_train_on)
    loop.Trainer.score = recording_score
    trainer = loop.Trainer(cfg, rank=rank, world=world, device="cpu")
    try:
        assert inner_model(trainer.model)._parallel_config is not None  # the split is on
        trainer.train()
        log_probs = _log_probs(trainer.adapter, trainer.model, recorded[-1]["batch"])
        torch.save({"recorded": recorded, "own": own, "trained": _trained(trainer.model),
                    "log_probs": log_probs}, tmp / f"rank{rank}.pt")
    finally:
        trainer.close()


def _reference_actor(cfg, model_dir: Path, distributed: bool):
    from trainer.actor.actor import Actor
    from trainer.actor.model import build_actor, build_optimizer
    from trainer.ema import build_ema
    from trainer.utils.values import import_dotpath

    adapter = import_dotpath(cfg.model.adapter_path)(str(model_dir), **cfg.model.adapter_options)
    model = build_actor(adapter, cfg.train, cfg.fsdp, cfg.lora, torch.device("cpu"),
                        distributed=distributed, compile=cfg.model.compile)
    return Actor(adapter, model, build_optimizer(model, cfg.train), train=cfg.train,
                 fsdp=cfg.fsdp, device="cpu", ema=build_ema(model, cfg.ema),
                 trainable_only=cfg.lora.rank > 0)


def _reference(cfg, model_dir: Path, recorded: list[dict]) -> dict:
    """The recorded batches through the update, without the split (module docstring)."""
    from trainer.actor.update import train_on
    from trainer.algorithms.nft_step import nft_train_on

    actor = _reference_actor(cfg, model_dir, distributed=dist.is_initialized())
    update = nft_train_on if cfg.train.algorithm == "diffusionnft" else train_on
    metrics = [update(actor, r["batch"], r["advantages"], r["rollout_id"], *r["args"])
               for r in recorded]
    log_probs = _log_probs(actor.adapter, actor.model, recorded[-1]["batch"])
    return {"metrics": metrics, "trained": _trained(actor.model), "log_probs": log_probs}


def _data_parallel_rank(tmp_dir: str, recipe: str, sets: list[str], model_dir: str,
                        sequence_degree: int) -> None:
    """Plain FSDP2 rank d of the reference: data group d's recorded batches (those of its
    first sequence rank), saved as ``reference<d>.pt``."""
    from trainer.config import load_config

    tmp, rank = Path(tmp_dir), dist.get_rank()
    recorded = torch.load(tmp / f"rank{rank * sequence_degree}.pt", weights_only=False)["recorded"]
    torch.save(_reference(load_config(recipe, sets), Path(model_dir), recorded),
               tmp / f"reference{rank}.pt")


def _check_counts(run_dir: Path, samples: int, groups_per_rank: float) -> None:
    """Every sample counted once: the rates of the logged steps read ``samples`` per step, not
    ``degree`` times as many. A logged rate is the ranks' mean of each one's count over its own
    time, the time logged their mean: the margin takes their spread and still tells once from
    twice."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    assert len(steps) == ROLLOUTS
    for step, row in enumerate(steps):
        assert row["perf/samples_per_s"] == pytest.approx(samples / row["perf/step_time"],
                                                          rel=0.25)
        assert row["perf/train_samples_per_s"] == pytest.approx(
            samples / row["perf/train_time"], rel=0.25)
        assert row["reward/num_groups"] == groups_per_rank  # a rank's own groups, scored once
        assert row["train/policy_version"] == step + 1
        assert row.get("train/first_update_ratio_mean", 1.0) == 1.0  # NFT: no ratio


def _check_groups(ranks: list[dict], sequence_degree: int) -> None:
    """The ranks of each sequence group rolled out disjoint slices and all trained on all of
    them, joined in rank order, with the same advantages and the same update."""
    for first in range(0, len(ranks), sequence_degree):
        group = ranks[first:first + sequence_degree]
        for step in range(ROLLOUTS):
            slices = [r["own"][step] for r in group]
            joined = [s for piece in slices for s in piece]
            assert len(set(joined)) == len(joined) == CANDIDATES * sequence_degree
            lead = group[0]["recorded"][step]
            assert lead["batch"].sample_ids == joined
            assert lead["batch"].group_index.tolist() == [
                g for g in range(sequence_degree) for _ in range(CANDIDATES)]
            for other in group[1:]:
                got = other["recorded"][step]
                assert got["batch"].sample_ids == joined
                assert torch.equal(got["batch"].latents, lead["batch"].latents)
                assert torch.equal(got["advantages"], lead["advantages"])
                assert got["metrics"] == lead["metrics"]


def _compare(run: dict, reference: dict) -> None:
    for got, want in zip([r["metrics"] for r in run["recorded"]], reference["metrics"],
                         strict=True):
        assert got.keys() == want.keys()
        for key in ("train/loss", "train/ratio_mean", "train/grad_norm",
                    "train/num_microbatches", "train/optimizer_steps"):
            if key in want:  # DiffusionNFT has no ratio
                assert got[key] == pytest.approx(want[key], rel=RTOL, abs=ATOL), key
    assert run["trained"].keys() == reference["trained"].keys() and reference["trained"]
    for name, tensor in reference["trained"].items():
        torch.testing.assert_close(run["trained"][name], tensor, rtol=RTOL, atol=ATOL, msg=name)
    if reference["log_probs"] is None:  # DiffusionNFT: nothing recorded per SDE step
        assert run["log_probs"] is None
    else:
        torch.testing.assert_close(run["log_probs"], reference["log_probs"], rtol=RTOL,
                                   atol=ATOL)


def _moved(ranks: list[dict], recipe: str, model_dir: Path, sets: list[str]) -> None:
    """The run changed the weights it started from (else equal weights prove nothing)."""
    from trainer.config import load_config

    start = _trained(_reference_actor(load_config(recipe, sets), model_dir, False).model)
    assert any(not torch.equal(ranks[0]["trained"][n], t) for n, t in start.items())


def _run_and_compare_one_group(tmp_path: Path, recipe: str, model_dir: Path, sets: list[str]):
    from trainer.config import load_config

    run_on_gloo_ranks(functools.partial(_run_rank, str(tmp_path), recipe,
                                        sets + ["fsdp.sequence_parallel=2"]), world=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    _check_groups(ranks, 2)
    _check_counts(tmp_path / "run", 2 * CANDIDATES, 1.0)
    assert any((tmp_path / "ckpt").iterdir())  # the end-of-run checkpoint, saved by both ranks
    _compare(ranks[0], _reference(load_config(recipe, sets), model_dir, ranks[0]["recorded"]))
    _moved(ranks, recipe, model_dir, sets)
    return ranks


def test_two_ranks_of_one_sequence_group_train_the_tiny_wan_like_one_rank(tmp_path):
    """World 2, degree 2 (LoRA): one data group of two ranks, each rolling out one of the two
    prompt groups; both train on both. Activation checkpointing on, as the Wan recipes have
    it (the reference recomputes its blocks too)."""
    recipe, model_dir, sets = _wan(tmp_path, world=2)
    _run_and_compare_one_group(tmp_path, recipe, model_dir,
                               sets + ["fsdp.activation_checkpointing=true"])


def test_diffusionnft_under_the_split_trains_the_tiny_wan_like_one_rank(tmp_path):
    """DiffusionNFT's update (ODE rollouts, final latents, its old policy) on the joined batch:
    its noise and levels are drawn alike on every rank of the group."""
    recipe, model_dir, sets = _wan(tmp_path, world=2)
    # Adam's eps at 1e-6, not 1e-8: the gradient of the self-attention keys along a shift
    # common to all keys cancels exactly (softmax ignores it), so in both runs it is rounding
    # noise, which NFT's larger loss makes large enough for Adam at 1e-8 to scale up to a
    # percent of a step; at 1e-6 that noise stays at rounding and every real gradient still
    # far exceeds eps
    nft = ["train.algorithm=diffusionnft", "train.nft_old_decay_ramp=1.0", "train.adam_eps=1e-6",
           'rollout.sampling={"sde_resample_per_rollout": false, "timestep_fraction": 0.34}']
    _run_and_compare_one_group(tmp_path, recipe, model_dir, sets + nft)


def test_two_ranks_of_one_sequence_group_train_the_tiny_qwen_image_like_one_rank(
        tmp_path, tiny_model_dir):
    """World 2, degree 2, full training; the prompts' text lengths differ between the ranks'
    slices and at least one joined batch has a length the degree does not divide."""
    recipe, model_dir, sets = _qwen(tmp_path, 2, tiny_model_dir("qwen_image"))
    ranks = _run_and_compare_one_group(tmp_path, recipe, model_dir, sets)
    lengths = [r["batch"].conditions["prompt_embeds"].shape[1] for r in ranks[0]["recorded"]]
    assert any(n % 2 for n in lengths), lengths


def test_two_data_groups_of_two_sequence_ranks_train_the_tiny_wan_like_plain_data_parallel(
        tmp_path):
    """World 4, degree 2: two data groups, each of two ranks rolling out one prompt group. The
    reference is two plain FSDP2 ranks, rank d training on data group d's batches: FSDP2's
    mean over the data groups is the same, and the split changes nothing else. The ranks load
    the model one at a time (``fsdp.load_wave_size``: the split and FSDP2 come after)."""
    recipe, model_dir, sets = _wan(tmp_path, world=4)
    run_on_gloo_ranks(functools.partial(_run_rank, str(tmp_path), recipe,
                                        sets + ["fsdp.sequence_parallel=2",
                                                "fsdp.load_wave_size=1"]), world=4)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    _check_groups(ranks, 2)
    _check_counts(tmp_path / "run", 4 * CANDIDATES, 1.0)
    # the two data groups trained on different samples
    assert not set(ranks[0]["own"][0]) & set(ranks[2]["own"][0])
    run_on_gloo_ranks(functools.partial(_data_parallel_rank, str(tmp_path), recipe, sets,
                                        str(model_dir), 2), world=2)
    for d in range(2):
        reference = torch.load(tmp_path / f"reference{d}.pt", weights_only=False)
        _compare(ranks[2 * d], reference)
    _moved(ranks, recipe, model_dir, sets)


def _resume_rank(recipe: str, sets: list[str]) -> None:
    """Train rollout 0, save, train rollout 1; then a new Trainer resumes from the save and
    trains rollout 1 again: the same update to the last bit, the engine re-synced."""
    from trainer.checkpoint import load_checkpoint, save_checkpoint
    from trainer.config import load_config
    from trainer.loop import Trainer

    cfg = load_config(recipe, sets)
    keys = ("train/loss", "train/grad_norm", "train/lr", "reward/mean", "train/ratio_mean",
            "train/policy_version")
    first = Trainer(cfg, rank=dist.get_rank(), world=dist.get_world_size(), device="cpu")
    try:
        first.train_step(0)
        first.next_rollout = 1
        assert save_checkpoint(first.checkpointer, 1) is not None
        want = first.train_step(1)
        want_weights = _trained(first.model)
    finally:
        first.close()
    second = Trainer(cfg, rank=dist.get_rank(), world=dist.get_world_size(), device="cpu")
    try:
        load_checkpoint(second.checkpointer, cfg.checkpoint.save)
        assert (second.next_rollout, second.policy_version) == (1, 1)
        got = second.train_step(1)
        got_weights = _trained(second.model)
    finally:
        second.close()
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert got_weights.keys() == want_weights.keys()
    assert all(torch.equal(got_weights[k], w) for k, w in want_weights.items())


def test_a_sequence_parallel_run_resumes_from_its_checkpoint_exactly(tmp_path):
    recipe, _, sets = _wan(tmp_path, world=2)
    run_on_gloo_ranks(functools.partial(_resume_rank, recipe,
                                        sets + ["fsdp.sequence_parallel=2"]), world=2)
