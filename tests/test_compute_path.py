"""The model-compute path: batched replay, pi_old without a redundant forward, the auto
micro-batch, a LoRA actor at the compute dtype, the engine's merged adapter, and regional
compilation (inductor on this CPU)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import kernels
from engine_fixtures import (ADAPTER_PATH, FixtureAdapter, build_fixture_model_dir,
                             make_request)
from trainer.actor import update
from trainer.actor.micro_batch import largest_fitting_divisor, resolve_micro_batch
from trainer.actor.model import build_actor, build_optimizer, lora_options
from trainer.models.lora import apply_lora
from trainer.actor.replay import plan_updates, replay_log_probs, replay_log_probs_per_step
from trainer.config import load_config
from trainer.engine import launch_embedded_engine
from trainer.models.compile import compile_blocks, compile_events
from trainer.profiling import ComputeMeter

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPTS = ["a red panda"] * 4 + ["a teacup"] * 4
IDS = [f"prompt:{g}:sample:{s}" for g in (7, 9) for s in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_fixture_model_dir(tmp_path_factory.mktemp("compute_model"))


@pytest.fixture(scope="module")
def adapter(model_dir):
    return FixtureAdapter(str(model_dir))


@pytest.fixture(scope="module")
def batch(model_dir, adapter):
    engine = launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                    adapter_options=None, device="cpu", dtype="fp32",
                                    lora=None, in_process=True)
    try:
        request = make_request(adapter, PROMPTS, IDS)
        return adapter.pack_trajectory(engine.generate(request), request)
    finally:
        engine.close()


def _cfg(*sets):
    return load_config(None, ["lora.rank=4", "lora.alpha=8", "fsdp.trainable_mode=lora",
                              "fsdp.param_dtype=fp32", "fsdp.master_dtype=fp32",
                              "train.num_updates_per_batch=2", "train.lr=0.05",
                              "train.clip_grad=1e9", "train.eps_clip=0.5", *sets])


def _lora_model(adapter, cfg):
    torch.manual_seed(0)
    model = adapter.load_train_model(dtype=torch.float32)
    model.requires_grad_(False)
    model = apply_lora(model, **lora_options(cfg, adapter))
    with torch.no_grad():  # a policy whose LoRA is live (B != 0), so updates move it
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model


def _trainer(adapter, cfg, model):
    optimizer = build_optimizer(model, cfg)
    return SimpleNamespace(
        cfg=cfg, adapter=adapter, model=model, optimizer=optimizer, lr_steps=0,
        device=torch.device("cpu"), meter=ComputeMeter(), outside=ComputeMeter(),
        auto_micro_batch=None, ema=None,
        _assert_microbatch_count_aligned=lambda n: None,
        _all_ranks_degenerate=lambda adv: bool(adv.abs().max() == 0))


def test_batched_replay_equals_per_step_replay(adapter, batch):
    model = adapter.load_train_model(dtype=torch.float32)
    with torch.no_grad():
        batched = replay_log_probs(adapter, model, batch)
        per_step = replay_log_probs_per_step(adapter, model, batch)
    assert batched.shape == (len(batch), len(batch.sde_indices)) == per_step.shape
    assert (batched - per_step).abs().max() <= 1e-6
    # and both are the engine's recorded log-probs of the same weights, to fp32 rounding
    assert (batched - batch.log_probs).abs().max() <= 1e-5


def test_batched_replay_gradient_equals_per_step_gradient(adapter, batch):
    cfg = _cfg()
    grads = []
    for fn in (replay_log_probs, replay_log_probs_per_step):
        model = _lora_model(adapter, cfg)
        fn(adapter, model, batch).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_first_update_is_its_own_anchor_and_equals_a_no_grad_replay(adapter, batch):
    cfg = _cfg()
    model = _lora_model(adapter, cfg)
    trainer = _trainer(adapter, cfg, model)
    rows = torch.tensor([0, 5, 6])
    mb = batch.select(rows)
    with torch.no_grad():
        separate = replay_log_probs(adapter, model, mb)
    seen = {}
    real = kernels.grpo_clip_loss

    def spy(logp, old, adv, **kw):
        seen["logp"], seen["old"] = logp.detach().clone(), old.clone()
        return real(logp, old, adv, **kw)

    kernels.grpo_clip_loss, saved = spy, kernels.grpo_clip_loss
    try:
        stats = update.forward_backward(trainer, mb, torch.tensor([1.0, -1.0, 0.5]), 1.0, None)
    finally:
        kernels.grpo_clip_loss = saved
    assert float(stats["ratio_mean"]) == 1.0 and float(stats["ratio_max"]) == 1.0
    assert torch.equal(seen["old"], seen["logp"])
    assert torch.equal(seen["logp"], separate)  # the eager training forward IS the no-grad one


def test_later_updates_are_anchored_on_the_pre_update_policy(adapter, batch, monkeypatch):
    cfg = _cfg("train.micro_batch_size=2")
    model = _lora_model(adapter, cfg)
    before = copy.deepcopy(model)
    trainer = _trainer(adapter, cfg, model)
    captured = {}
    real_anchors = update.anchors

    def spy(tr, b, plan):
        captured["plan"], captured["pi_old"] = plan, real_anchors(tr, b, plan).clone()
        return captured["pi_old"]

    monkeypatch.setattr(update, "anchors", spy)
    adv = torch.linspace(-1.0, 1.0, len(batch))
    out = update.train_on(trainer, batch, adv, rollout_id=3)
    assert out["train/optimizer_steps"] == 2.0 and out["train/micro_batch_size"] == 2.0
    # replayed micro-batch by micro-batch as the anchor pass does: the same row counts give
    # the same GEMM shapes, so bitwise equality does not depend on the CPU's kernel choice
    micro = captured["plan"].updates[1]
    later = torch.cat(micro)
    with torch.no_grad():
        pre = torch.cat([replay_log_probs(adapter, before, batch.select(r)) for r in micro])
        post = torch.cat([replay_log_probs(adapter, model, batch.select(r)) for r in micro])
    assert torch.equal(captured["pi_old"][later], pre)
    assert not torch.allclose(pre, post)  # the policy did move: the test can tell them apart
    first = torch.cat(captured["plan"].updates[0])
    assert torch.equal(captured["pi_old"][first], torch.zeros_like(pre))  # no forward spent


def test_largest_fitting_divisor_picks_a_divisor_and_refuses_what_cannot_fit():
    gib = 2.0 ** 30
    assert largest_fitting_divisor(12, 1 * gib, 5.5 * gib) == 4   # 5 and 5.5 are not divisors
    assert largest_fitting_divisor(12, 1 * gib, 100 * gib) == 12
    assert largest_fitting_divisor(7, 1 * gib, 6.9 * gib) == 1     # prime: only 1 fits
    assert largest_fitting_divisor(8, 0.0, 0.0) == 8                # nothing measured: all
    with pytest.raises(ValueError, match="one sample's replay needs 3.00 GiB"):
        largest_fitting_divisor(8, 3 * gib, 2 * gib)


def test_auto_micro_batch_on_the_cpu_is_the_whole_update(adapter, batch):
    cfg = _cfg()
    trainer = _trainer(adapter, cfg, _lora_model(adapter, cfg))
    assert cfg.train.micro_batch_size == "auto"
    assert resolve_micro_batch(trainer, batch, torch.ones(len(batch)), 4) == 4
    assert load_config(None, ["train.micro_batch_size=3"]).train.micro_batch_size == 3
    plan = plan_updates(len(batch), 2, 4)
    assert [len(m) for u in plan.updates for m in u] == [4, 4]


def test_auto_micro_batch_uses_the_probe_and_the_budget(adapter, batch, monkeypatch):
    from trainer.actor import micro_batch

    cfg = _cfg("train.micro_batch_memory_gb=2.5")
    trainer = _trainer(adapter, cfg, _lora_model(adapter, cfg))
    trainer.device = torch.device("cuda")  # the GPU branch, with the probe measured here
    monkeypatch.setattr(micro_batch, "probe_sample_bytes", lambda *a: 2.0 ** 30)
    assert resolve_micro_batch(trainer, batch, torch.ones(len(batch)), 4) == 2
    assert trainer.auto_micro_batch == 2  # kept for the run
    monkeypatch.setattr(micro_batch, "probe_sample_bytes", lambda *a: 3.0 * 2 ** 30)
    trainer.auto_micro_batch = None
    with pytest.raises(ValueError, match="micro_batch_size=auto"):
        resolve_micro_batch(trainer, batch, torch.ones(len(batch)), 4)


def test_lora_actor_keeps_the_frozen_base_in_the_compute_dtype(adapter):
    cfg = _cfg("fsdp.param_dtype=bf16")
    model = build_actor(adapter, cfg, torch.device("cpu"), distributed=False)
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    full = build_actor(adapter, load_config(None, ["fsdp.param_dtype=bf16"]),
                       torch.device("cpu"), distributed=False)
    assert {p.dtype for p in full.parameters()} == {torch.float32}  # full: fp32 master


def _engine(model_dir, merge: bool):
    lora = {"rank": 4, "alpha": 8, "target_modules": ["attn.to_q", "attn.to_k", "attn.to_v",
                                                       "attn.to_out.0"], "merge": merge}
    return launch_embedded_engine(adapter_path=ADAPTER_PATH, model_path=str(model_dir),
                                  adapter_options=None, device="cpu", dtype="fp32", lora=lora,
                                  in_process=True)


def _set_lora(core, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in core.params.items():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    core._on_commit(1, "adapter")  # what the receiver calls after an adapter-mode sync


def test_engine_merge_round_trip_restores_the_base_bit_for_bit(model_dir, adapter):
    client = _engine(model_dir, merge=True)
    core = client._transport.core
    try:
        base = {n: p.detach().clone() for n, p in core.params.items() if "lora_" not in n}
        checksum_base = core.checksum()
        _, layer = core.merger.layers[0]
        w0 = layer.base_layer.weight.detach().clone()
        _set_lora(core, 0)
        core._serve_merged()
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        expected = w0 + layer.scaling["default"] * (b @ a)
        assert core.merger.merged and layer.merged
        assert torch.allclose(layer.base_layer.weight, expected, atol=1e-6)
        assert not torch.equal(layer.base_layer.weight, w0)
        # the checksum is of the weights as synced (base + adapter), merged or not
        core.merger.unmerge()
        checksum_lora = core.checksum()
        core._merge_pending = True
        core._serve_merged()
        assert core.checksum() == checksum_lora != checksum_base
        for n, p in core.params.items():  # checksum() left the base exactly restored
            if "lora_" not in n:
                assert torch.equal(p, base[n]), n
        core._serve_merged()  # merged again (checksum() unmerged)
        _set_lora(core, 1)  # a second adapter sync re-merges from the kept base
        assert core.merger.merged  # over the first merge, without an unmerge in between
        core._serve_merged()
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert torch.allclose(layer.base_layer.weight, w0 + layer.scaling["default"] * (b @ a),
                              atol=1e-6)  # base + the new delta, not the two deltas summed
        core.merger.unmerge()
        for n, p in core.params.items():
            if "lora_" not in n:
                assert torch.equal(p, base[n]), n
    finally:
        client.close()


def test_bf16_merge_rounds_base_plus_fp32_delta_once():
    from peft import LoraConfig, get_peft_model

    from trainer.engine.lora_merge import LoraMerger

    torch.manual_seed(0)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(16, 8)).to(torch.bfloat16),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["0"]))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    w0 = layer.base_layer.weight.detach().clone()
    merger = LoraMerger(model)
    merger.merge()
    a = layer.lora_A["default"].weight.float()
    b = layer.lora_B["default"].weight.float()
    want = (w0.float() + 2.0 * (b @ a)).to(torch.bfloat16)
    assert layer.base_layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.base_layer.weight, want)
    merger.unmerge()
    assert torch.equal(layer.base_layer.weight, w0)


def test_merged_engine_samples_what_the_unmerged_adapter_samples(model_dir, adapter):
    request = make_request(adapter, PROMPTS, IDS)
    out = {}
    for merge in (True, False):
        client = _engine(model_dir, merge=merge)
        try:
            _set_lora(client._transport.core, 0)
            out[merge] = client.generate(request)
            assert client.health()["lora_merged"] is merge
        finally:
            client.close()
    diff = (out[True]["rollout_log_probs"] - out[False]["rollout_log_probs"]).abs().max()
    assert diff <= 1e-4, diff  # fp32: the merged matmul rounds differently, nothing more
    assert torch.allclose(out[True]["dit_trajectory"]["latents"],
                          out[False]["dit_trajectory"]["latents"], atol=1e-4)


@pytest.mark.slow
def test_compiled_blocks_replay_like_eager_and_stop_compiling(adapter, batch):
    eager = adapter.load_train_model(dtype=torch.float32)
    compiled = adapter.load_train_model(dtype=torch.float32)
    assert compile_blocks(adapter.transformer_blocks(compiled)) == 1
    names = [n for n, _ in compiled.named_parameters()]
    assert names == [n for n, _ in eager.named_parameters()]  # no _orig_mod. segment
    before = compile_events()
    got = replay_log_probs(adapter, compiled, batch)
    first = compile_events() - before
    again = replay_log_probs(adapter, compiled, batch)
    assert first >= 1 and compile_events() - before == first  # same shape: no recompile
    with torch.no_grad():
        want = replay_log_probs(adapter, eager, batch)
    assert (got.detach() - want).abs().max() <= 1e-5
    assert torch.equal(got, again)
    got.sum().backward()  # the compiled backward runs and reaches the weights
    assert all(p.grad is not None for p in adapter.transformer_blocks(compiled)[0].parameters())


def test_offload_policy_skips_the_offloads_only_when_both_sides_fit():
    from trainer.actor.colocate import Footprint, OffloadPolicy

    gib = 2 ** 30
    roomy = Footprint(total=100 * gib, actor_resident=30 * gib, actor_peak=50 * gib,
                      engine_resident=20 * gib, engine_peak=35 * gib)
    assert roomy.fits_together()  # max(30 + 35, 50 + 20) = 70, + 10 margin <= 100
    tight = Footprint(total=100 * gib, actor_resident=30 * gib, actor_peak=70 * gib,
                      engine_resident=25 * gib, engine_peak=35 * gib)
    assert not tight.fits_together()  # 70 + 25 + 10 > 100
    policy = OffloadPolicy("as_needed", offload_rollout=True, offload_train=True, device="cuda")
    assert not policy.decided and policy.engine_release and policy.actor_offload
    policy.measure(tight)
    assert policy.decided and policy.engine_release and policy.actor_offload
    policy = OffloadPolicy("as_needed", offload_rollout=True, offload_train=True, device="cuda")
    policy.measure(roomy)
    assert not (policy.engine_release or policy.actor_offload)
    assert policy.metrics() == {"perf/offload_active": 0.0}
    always = OffloadPolicy("always", offload_rollout=True, offload_train=True, device="cuda")
    always.measure(roomy)
    assert always.decided and always.engine_release and always.actor_offload
    cpu = OffloadPolicy("as_needed", offload_rollout=False, offload_train=True, device="cpu")
    assert cpu.decided and not cpu.actor_offload  # the actor offload is a GPU thing


def test_world_one_fsdp_keeps_gathered_blocks_and_trains_the_same(adapter, batch, tmp_path):
    """World 1 defaults: no re-gather (reshard_after_forward=None), the frozen base left out
    of FSDP2 (shard_frozen=None: plain tensors; only the LoRA is sharded) and one FSDP2 unit
    for the whole model (block_units=None). An update (anchor forward for the second update,
    two optimizer steps) equals the resharding, sharded-base and per-block actors' bit for
    bit: grad norm (clipping sees the real gradients), stats and the weights after it;
    explicit values kept."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from trainer.actor.model import block_units, reshard_after_forward, shard_frozen

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    assert reshard_after_forward(_cfg()) is True  # no process group: nothing to keep
    assert shard_frozen(_cfg()) is True
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        assert reshard_after_forward(_cfg()) is False
        assert reshard_after_forward(_cfg("fsdp.reshard_after_forward=true")) is True
        assert shard_frozen(_cfg()) is False
        assert shard_frozen(_cfg("fsdp.shard_frozen=true")) is True
        assert block_units(_cfg()) is False
        assert block_units(_cfg("fsdp.shard_frozen=true")) is True
        assert block_units(_cfg("lora.rank=0", "fsdp.trainable_mode=full")) is True
        out, weights = {}, {}
        adv = torch.linspace(-1.0, 1.0, len(batch))
        variants = {"default": [], "reshard": ["fsdp.reshard_after_forward=true"],
                    "sharded_base": ["fsdp.shard_frozen=true"],
                    "per_block": ["fsdp.block_units=true"]}
        for key, sets in variants.items():
            cfg = _cfg(*sets, "train.micro_batch_size=2")
            model = build_actor(adapter, cfg, torch.device("cpu"), distributed=True)
            units = sum(isinstance(m, FSDPModule) for m in model.modules())
            blocks = len(adapter.transformer_blocks(model.base_model.model))
            assert units == (1 + blocks if key in ("sharded_base", "per_block") else 1), key
            kinds = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
            assert all(kinds[n] for n in kinds if "lora_" in n), key
            assert all(kinds[n] == (key == "sharded_base") for n in kinds if "lora_" not in n)
            out[key] = update.train_on(_trainer(adapter, cfg, model), batch, adv, rollout_id=3)
            weights[key] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).clone()
                            for n, p in model.named_parameters()}
        assert out["default"]["train/grad_norm"] > 0
        for key in ("reshard", "sharded_base", "per_block"):
            assert out["default"] == out[key], key
            assert weights["default"].keys() == weights[key].keys()
            for name, w in weights["default"].items():
                assert torch.equal(w, weights[key][name]), (key, name)
    finally:
        dist.destroy_process_group()


def _grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in ((64, 4), (4, 64), (7,), (33, 5))]


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_on_local_shards_equals_torch_clip(max_norm, tmp_path):
    """update.clip_grad_norm (local shards, one all-reduce) gives torch's clip_grad_norm_
    norm and clipped gradients, on plain tensors and on FSDP-style Shard(0) DTensors."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    def params_with(grads):
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return params

    want_params = params_with(_grads(0))
    want = torch.nn.utils.clip_grad_norm_(want_params, max_norm)
    plain = params_with(_grads(0))
    got = update.clip_grad_norm(plain, max_norm)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for p, q in zip(plain, want_params):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    if max_norm > 1e6:  # no clipping: the gradients are untouched, bit for bit
        assert all(torch.equal(p.grad, g) for p, g in zip(plain, _grads(0)))

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = [torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, [Shard(0)]))
                   for g in _grads(0)]
        for p, g in zip(sharded, _grads(0)):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        got = update.clip_grad_norm(sharded, max_norm)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        for p, q in zip(sharded, want_params):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_skip_on_device_steps_like_the_host_check(device, adapter, batch, tmp_path, monkeypatch):
    """train.skip_on_device (fused AdamW, no EMA): the skip of a non-finite norm and the lr
    schedule's position are decided on the device, with no host read per step. Two rollout
    batches of two updates under a warmup (the lr moves every step), the first update's norm
    forced non-finite: the metrics, the weights, the optimizer state and the schedule position
    equal the host check's bit for bit, and the device path never calls the host one."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    real_clip = update.clip_grad_norm

    def clip_first_non_finite(params, max_norm):
        calls.append(1)
        norm = real_clip(params, max_norm)
        return torch.full_like(norm, float("inf")) if len(calls) == 1 else norm

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).clone()

    monkeypatch.setattr(update, "clip_grad_norm", clip_first_non_finite)
    host_steps = []
    real_host_step = update.optimizer_step
    monkeypatch.setattr(update, "optimizer_step",
                        lambda *a: host_steps.append(1) or real_host_step(*a))
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        results = {}
        adv = torch.linspace(-1.0, 1.0, len(batch))
        for key in ("host", "device"):
            calls, host_steps[:] = [], []
            # warmup lrs exact in float32, the dtype of the device table (the fused kernel
            # reads a float32 lr; the host passes a double)
            cfg = _cfg(f"train.skip_on_device={key == 'device'}", "train.adam_fused=true",
                       "train.lr=0.0625", "train.lr_warmup_iters=4",
                       "train.micro_batch_size=2")
            model = build_actor(adapter, cfg, torch.device(device), distributed=True)
            trainer = _trainer(adapter, cfg, model)
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
    finally:
        dist.destroy_process_group()
