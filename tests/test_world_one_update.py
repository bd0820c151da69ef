"""The update at world size 1 and its optimizer step: FSDP2's defaults there (gathered blocks
kept, the frozen base left out, one unit for the adapter) train as the other settings do, the
clip on local shards equals torch's, the non-finite skip decided on the device equals the
host check, and (CUDA) the update queues its GPU work without waiting for it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from compute_fixtures import adapter, batch, lora_cfg, model_dir, stand_in_trainer  # noqa: F401
from dist_fixtures import one_rank_group
from trainer.actor import update
from trainer.actor.model import build_actor

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_world_one_fsdp_keeps_gathered_blocks_and_trains_the_same(adapter, batch, tmp_path):
    """World 1 defaults: no re-gather (reshard_after_forward=None), the frozen base left out
    of FSDP2 (shard_frozen=None: plain tensors; only the LoRA is sharded), one FSDP2 unit
    for the whole model (block_units=None) and one gradient reduce per update
    (accumulate_unsharded=None). An update (anchor forward for the second update,
    two optimizer steps) equals the resharding, sharded-base and per-block actors' bit for
    bit: grad norm (clipping sees the real gradients), stats and the weights after it;
    explicit values kept."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from trainer.actor.model import (accumulate_unsharded, block_units, reshard_after_forward,
                                     shard_frozen)

    def _block_units(cfg):
        return block_units(cfg.fsdp, cfg.lora)

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    assert reshard_after_forward(lora_cfg().fsdp) is True  # no process group: nothing to keep
    assert shard_frozen(lora_cfg().fsdp) is True
    assert accumulate_unsharded(lora_cfg().fsdp) is False
    with one_rank_group(tmp_path):
        assert accumulate_unsharded(lora_cfg().fsdp) is True
        assert accumulate_unsharded(lora_cfg("fsdp.accumulate_unsharded=false").fsdp) is False
        assert reshard_after_forward(lora_cfg().fsdp) is False
        assert reshard_after_forward(lora_cfg("fsdp.reshard_after_forward=true").fsdp) is True
        assert shard_frozen(lora_cfg().fsdp) is False
        assert shard_frozen(lora_cfg("fsdp.shard_frozen=true").fsdp) is True
        assert _block_units(lora_cfg()) is False
        assert _block_units(lora_cfg("fsdp.shard_frozen=true")) is True
        assert _block_units(lora_cfg("lora.rank=0", "fsdp.trainable_mode=full")) is True
        out, weights = {}, {}
        adv = torch.linspace(-1.0, 1.0, len(batch))
        variants = {"default": [], "reshard": ["fsdp.reshard_after_forward=true"],
                    "sharded_base": ["fsdp.shard_frozen=true"],
                    "per_block": ["fsdp.block_units=true"]}
        for key, sets in variants.items():
            cfg = lora_cfg(*sets, "train.micro_batch_size=2")
            model = build_actor(adapter, cfg.train, cfg.fsdp, cfg.lora, torch.device("cpu"),
                                distributed=True)
            units = sum(isinstance(m, FSDPModule) for m in model.modules())
            blocks = len(adapter.transformer_blocks(model.base_model.model))
            assert units == (1 + blocks if key in ("sharded_base", "per_block") else 1), key
            kinds = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
            assert all(kinds[n] for n in kinds if "lora_" in n), key
            assert all(kinds[n] == (key == "sharded_base") for n in kinds if "lora_" not in n)
            actor = stand_in_trainer(adapter, cfg, model)
            out[key] = update.train_on(actor, batch, adv, rollout_id=3)
            weights[key] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).clone()
                            for n, p in model.named_parameters()}
        assert out["default"]["train/grad_norm"] > 0
        for key in ("reshard", "sharded_base", "per_block"):
            assert out["default"] == out[key], key
            assert weights["default"].keys() == weights[key].keys()
            for name, w in weights["default"].items():
                assert torch.equal(w, weights[key][name]), (key, name)


def _accumulating_versus_per_micro_batch(adapter, batch, device: str, monkeypatch):
    """Train a full bf16 actor (fp32 master and reduce, per-block units, two updates of two
    micro-batches) once with each schedule of fsdp.accumulate_unsharded, inside a one-rank
    group; returns {accumulate: (stats, weights, gather and reduce counts)} and the units."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group
    from torch.distributed.tensor import DTensor

    calls = {"gather": 0, "reduce": 0}

    def counting(key, real):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)
        return wrapped

    # a unit's gather ends in _to_unsharded at every world size (world 1 copies the shards
    # in place of an all-gather); its gradient reduce is foreach_reduce
    cls = group.FSDPParamGroup
    monkeypatch.setattr(cls, "_to_unsharded", counting("gather", cls._to_unsharded))
    monkeypatch.setattr(group, "foreach_reduce", counting("reduce", group.foreach_reduce))
    adv = torch.linspace(-1.0, 1.0, len(batch))
    runs = {}
    for accumulate in (False, True):
        cfg = lora_cfg("lora.rank=0", "fsdp.trainable_mode=full", "fsdp.param_dtype=bf16",
                       "fsdp.block_units=true", "train.micro_batch_size=2", "model.compile=none",
                       f"fsdp.accumulate_unsharded={str(accumulate).lower()}")
        model = build_actor(adapter, cfg.train, cfg.fsdp, cfg.lora, torch.device(device),
                            distributed=True)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        trainer = stand_in_trainer(adapter, cfg, model)
        trainer.device = torch.device(device)
        calls.update(gather=0, reduce=0)
        stats = update.train_on(trainer, batch, adv, rollout_id=3)
        weights = {n: p.full_tensor().cpu() for n, p in model.named_parameters()
                   if isinstance(p, DTensor)}
        groups = [u._get_fsdp_state()._fsdp_param_group for u in units]
        assert all(g.reduce_grads and g.reshard_after_backward for g in groups if g), \
            "a unit left off FSDP2's defaults after the update"
        runs[accumulate] = (stats, weights, dict(calls))
    return runs, len(units)


def _assert_accumulating_is_the_same_with_fewer_copies(runs, units: int) -> None:
    (stats, weights, counts), (acc_stats, acc_weights, acc_counts) = runs[False], runs[True]
    assert stats["train/num_microbatches"] == 4 and stats["train/grad_norm"] > 0
    # per micro-batch: the anchor pass's gather (kept for update 0's first micro-batch), then
    # one for each later micro-batch; accumulating, one gather and one reduce per update
    assert counts == {"gather": 4 * units, "reduce": 4 * units}
    assert acc_counts == {"gather": 2 * units, "reduce": 2 * units}
    assert acc_stats == stats
    assert acc_weights.keys() == weights.keys() and weights
    for name, w in weights.items():
        assert torch.equal(w, acc_weights[name]), name


def test_accumulating_unsharded_gathers_and_reduces_once_per_update_and_trains_the_same(
        adapter, batch, tmp_path, monkeypatch):
    """fsdp.accumulate_unsharded at world 1 on the CPU: each unit gathers and reduces once per
    update, and the stats and weights equal the per-micro-batch schedule's bit for bit; every
    unit is back to FSDP2's defaults afterwards."""
    with one_rank_group(tmp_path):
        runs, units = _accumulating_versus_per_micro_batch(adapter, batch, "cpu", monkeypatch)
    _assert_accumulating_is_the_same_with_fewer_copies(runs, units)


def _grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in ((64, 4), (4, 64), (7,), (33, 5))]


def _clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The clip as the update's separate pass takes it: the norm and coefficient on the
    local shards, then the gradients scaled in place; returns the norm."""
    norm, coef = update.grad_norm_and_clip_coef(params, max_norm)
    update.scale_gradients(params, coef)
    return norm


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_on_local_shards_equals_torch_clip(max_norm, tmp_path):
    """The update's clip (local shards, one all-reduce) gives torch's clip_grad_norm_
    norm and clipped gradients, on plain tensors and on FSDP-style Shard(0) DTensors."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    def params_with(grads):
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return params

    want_params = params_with(_grads(0))
    want = torch.nn.utils.clip_grad_norm_(want_params, max_norm)
    plain = params_with(_grads(0))
    got = _clip(plain, max_norm)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for p, q in zip(plain, want_params):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    if max_norm > 1e6:  # no clipping: the gradients are untouched, bit for bit
        assert all(torch.equal(p.grad, g) for p, g in zip(plain, _grads(0)))

    with one_rank_group(tmp_path):
        mesh = init_device_mesh("cpu", (1,))
        sharded = [torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, [Shard(0)]))
                   for g in _grads(0)]
        for p, g in zip(sharded, _grads(0)):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        got = _clip(sharded, max_norm)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        for p, q in zip(sharded, want_params):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=0)


def _adam_run(params: list[torch.Tensor], max_norm: float, fold: bool, monkeypatch,
              as_grad=lambda g: g, **adam_kwargs) -> tuple[list[torch.Tensor], list[dict]]:
    """Two clipped AdamW steps through update.grad_norm_and_clip_coef / step_optimizer, with
    ``train.fold_clip`` = ``fold``; returns weights and moments. Asserts whether a separate
    pass scaled the gradients: none when the clip rides in a fused step."""
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor

    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, **adam_kwargs)
    actor = SimpleNamespace(optimizer=optimizer, train_cfg=SimpleNamespace(
        adam_on_local_shards=True, fold_clip=fold))
    real_mul, scaling_passes = torch._foreach_mul_, []
    monkeypatch.setattr(torch, "_foreach_mul_",
                        lambda *a, **k: scaling_passes.append(1) or real_mul(*a, **k))
    for seed in (1, 2):
        for p, g in zip(params, _grads(seed)):
            p.grad = as_grad(3.0 * g)
        _, coef = update.grad_norm_and_clip_coef(params, max_norm)
        update.step_optimizer(actor, params, coef)
    monkeypatch.setattr(torch, "_foreach_mul_", real_mul)
    assert bool(scaling_passes) is not (fold and adam_kwargs.get("fused", False))

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return ([full(p) for p in params],
            [{k: full(v) for k, v in optimizer.state[p].items()} for p in params])


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_the_clip_folded_into_the_fused_step_equals_clipping_first(max_norm, tmp_path,
                                                                    monkeypatch):
    """Fused AdamW on the local shards applies the clip as its kernel's grad_scale (no pass
    over the gradients of its own): after two steps the weights and moments equal those of
    scaling the gradients first, bit for bit without clipping and to the last bit or so with
    it, on plain tensors and on Shard(0) DTensors. foreach AdamW scales first either way."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    def zeros():
        return [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads(0)]

    def compare(got, want, exact=max_norm > 1e6):
        for g, w in zip(got[0] + [v for s in got[1] for v in s.values()],
                        want[0] + [v for s in want[1] for v in s.values()]):
            if exact:
                assert torch.equal(g, w)
            else:
                torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-9)

    want = _adam_run(zeros(), max_norm, False, monkeypatch, fused=True)
    compare(_adam_run(zeros(), max_norm, True, monkeypatch, fused=True), want)
    with one_rank_group(tmp_path):
        mesh = init_device_mesh("cpu", (1,))
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
                   for p in zeros()]
        compare(_adam_run(sharded, max_norm, True, monkeypatch, fused=True,
                          as_grad=lambda g: distribute_tensor(g, mesh, [Shard(0)])), want)
    foreach = _adam_run(zeros(), max_norm, False, monkeypatch, foreach=True)
    compare(_adam_run(zeros(), max_norm, True, monkeypatch, foreach=True), foreach, exact=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_skip_on_device_steps_like_the_host_check(device, adapter, batch, tmp_path, monkeypatch):
    """train.skip_on_device (fused AdamW, no EMA): the skip of a non-finite norm and the lr
    schedule's position are decided on the device, with no host read per step. Two rollout
    batches of two updates under a warmup (the lr moves every step), the first update's norm
    forced non-finite: the metrics, the weights, the optimizer state and the schedule position
    equal the host check's bit for bit, and the device path never calls the host one."""
    from torch.distributed.tensor import DTensor

    real_norm = update.grad_norm_and_clip_coef

    def first_norm_non_finite(params, max_norm):
        calls.append(1)
        norm, coef = real_norm(params, max_norm)
        return (torch.full_like(norm, float("inf")) if len(calls) == 1 else norm), coef

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).clone()

    monkeypatch.setattr(update, "grad_norm_and_clip_coef", first_norm_non_finite)
    host_steps = []
    real_host_step = update.optimizer_step
    monkeypatch.setattr(update, "optimizer_step",
                        lambda *a: host_steps.append(1) or real_host_step(*a))
    with one_rank_group(tmp_path, "nccl" if device == "cuda" else "gloo"):
        results = {}
        adv = torch.linspace(-1.0, 1.0, len(batch))
        for key in ("host", "device"):
            calls, host_steps[:] = [], []
            # warmup lrs exact in float32, the dtype of the device table (the fused kernel
            # reads a float32 lr; the host passes a double)
            cfg = lora_cfg(f"train.skip_on_device={key == 'device'}", "train.adam_fused=true",
                       "train.lr=0.0625", "train.lr_warmup_iters=4",
                       "train.micro_batch_size=2")
            model = build_actor(adapter, cfg.train, cfg.fsdp, cfg.lora, torch.device(device),
                                distributed=True)
            trainer = stand_in_trainer(adapter, cfg, model)
            trainer.device = torch.device(device)
            assert update.skips_on_device(trainer) is (key == "device")
            outs = [update.train_on(trainer, batch, adv, rollout_id=r) for r in (3, 4)]
            state = [{k: full(v) for k, v in s.items()} for s in trainer.optimizer.state.values()]
            weights = {n: full(p) for n, p in model.named_parameters()}
            results[key] = (outs, weights, state, trainer.lr_steps, len(host_steps))
            assert not hasattr(trainer.optimizer, "found_inf")
            assert all(isinstance(g["lr"], float) for g in trainer.optimizer.param_groups)
        (h_outs, h_w, h_state, h_steps, h_calls), (d_outs, d_w, d_state, d_steps, d_calls) = \
            results["host"], results["device"]
        assert h_outs[0]["train/optimizer_skips"] == 1.0 and h_outs[1]["train/optimizer_skips"] == 0
        assert h_outs[0]["train/lr"] == 0.0625 / 4  # the one step taken: step 0
        assert h_steps == 3 and h_calls == 4 and d_calls == 0
        assert d_outs == h_outs and d_steps == h_steps
        assert all(torch.equal(w, d_w[n]) for n, w in h_w.items())
        assert len(d_state) == len(h_state)
        for hs, ds in zip(h_state, d_state):
            assert hs.keys() == ds.keys() and all(torch.equal(hs[k], ds[k]) for k in hs)


def _strict(fn):
    """``fn`` under torch.cuda.set_sync_debug_mode("error"): any call that makes the host wait
    for the GPU (a blocking copy, a host read) raises."""
    def wrapped(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return wrapped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_accumulating_unsharded_on_cuda_trains_the_same(adapter, batch, tmp_path, monkeypatch):
    """The same on CUDA under NCCL, where the gradient reduce runs on FSDP2's side stream and
    the unsharded accumulation on the compute stream: the same stats and weights, bit for bit."""
    on_gpu = dataclasses.replace(
        batch, latents=batch.latents.cuda(), next_latents=batch.next_latents.cuda(),
        log_probs=batch.log_probs.cuda(),
        conditions={k: v.cuda() for k, v in batch.conditions.items()})
    with one_rank_group(tmp_path, "nccl"):
        runs, units = _accumulating_versus_per_micro_batch(adapter, on_gpu, "cuda", monkeypatch)
    _assert_accumulating_is_the_same_with_fewer_copies(runs, units)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_update_queues_its_gpu_work_without_waiting_for_it(adapter, batch, tmp_path,
                                                                monkeypatch):
    """Once the micro-batches are selected, nothing in the update makes the host wait for the
    GPU until the metrics are read at its end: every anchor replay, forward + backward and
    optimizer step runs in sync-debug "error" mode, so the host can queue the whole stage
    ahead of the GPU. The batch lies as the engine returns it: tensors on the GPU, sigmas on
    the host. Control: selecting rows of that batch with host indices does synchronise."""
    on_gpu = dataclasses.replace(
        batch, latents=batch.latents.cuda(), next_latents=batch.next_latents.cuda(),
        log_probs=batch.log_probs.cuda(),
        conditions={k: v.cuda() for k, v in batch.conditions.items()})
    with pytest.raises(RuntimeError, match="synchroniz"):
        _strict(on_gpu.select)(torch.tensor([0, 1]))
    with one_rank_group(tmp_path, "nccl"):
        cfg = lora_cfg("train.adam_fused=true", "train.micro_batch_size=2")
        model = build_actor(adapter, cfg.train, cfg.fsdp, cfg.lora, torch.device("cuda"),
                            distributed=True)
        trainer = stand_in_trainer(adapter, cfg, model)
        trainer.device = torch.device("cuda")
        assert update.skips_on_device(trainer)
        adv = torch.linspace(-1.0, 1.0, len(batch))
        update.train_on(trainer, on_gpu, adv, rollout_id=3)  # compiles and warms up: not judged
        monkeypatch.setattr(update, "forward_backward", _strict(update.forward_backward))
        monkeypatch.setattr(update, "replay_log_probs", _strict(update.replay_log_probs))
        monkeypatch.setattr(update.DeviceSkips, "step", _strict(update.DeviceSkips.step))
        out = update.train_on(trainer, on_gpu, adv, rollout_id=4)
        assert out["train/optimizer_steps"] == 2.0 and out["train/optimizer_skips"] == 0.0


def test_train_mode_is_set_only_where_a_module_is_not_training():
    """``ensure_train_mode`` (the update's start): nothing is set while every module trains
    (``train()`` costs the host milliseconds on the actor); one module in eval mode, however
    deep, puts the whole model back in training mode."""
    from torch import nn

    from trainer.actor.model import ensure_train_mode

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5), nn.Linear(2, 2)))
    calls = []
    real_train = model.train
    model.train = lambda mode=True: calls.append(mode) or real_train(mode)
    ensure_train_mode(model)
    assert calls == []
    model[1][0].eval()
    ensure_train_mode(model)
    assert calls == [True] and all(m.training for m in model.modules())
