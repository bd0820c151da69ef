"""The model-compute path: batched replay, pi_old without a redundant forward, the auto
micro-batch, a LoRA actor at the compute dtype, the engine's merged adapter, and regional
compilation (inductor on this CPU)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import flowgrpo_kernels as kernels
from compute_fixtures import (IDS, PROMPTS, adapter, batch, lora_cfg,  # noqa: F401
                              model_dir, stand_in_trainer)
from engine_fixtures import ADAPTER_PATH, HEIGHT, JOINT, WIDTH, make_request
from trainer.actor import update
from trainer.actor.micro_batch import largest_fitting_divisor, resolve_micro_batch
from trainer.actor.model import build_actor, lora_options
from trainer.models.lora import apply_lora
from trainer.actor.replay import plan_updates, replay_log_probs, replay_log_probs_per_step
from trainer.config import load_config
from trainer.engine import launch_embedded_engine
from trainer.models.compile import compile_blocks, compile_events
from trainer.models.geometry import Geometry

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _lora_model(adapter, cfg):
    torch.manual_seed(0)
    model = adapter.load_train_model(dtype=torch.float32)
    model.requires_grad_(False)
    model = apply_lora(model, **lora_options(cfg.lora, adapter))
    with torch.no_grad():  # a policy whose LoRA is live (B != 0), so updates move it
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    return model


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
    cfg = lora_cfg()
    grads = []
    for fn in (replay_log_probs, replay_log_probs_per_step):
        model = _lora_model(adapter, cfg)
        fn(adapter, model, batch).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_first_update_is_its_own_anchor_and_equals_a_no_grad_replay(adapter, batch):
    cfg = lora_cfg()
    model = _lora_model(adapter, cfg)
    trainer = stand_in_trainer(adapter, cfg, model)
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
    cfg = lora_cfg("train.micro_batch_size=2")
    model = _lora_model(adapter, cfg)
    before = copy.deepcopy(model)
    trainer = stand_in_trainer(adapter, cfg, model)
    captured = {}
    real_anchors = update.anchors
    real_select = update.select_micro_batches

    def spy_select(tr, b, adv, plan):
        captured["plan"] = plan
        return real_select(tr, b, adv, plan)

    def spy(tr, selected):
        captured["pi_old"] = real_anchors(tr, selected)
        return captured["pi_old"]

    monkeypatch.setattr(update, "select_micro_batches", spy_select)
    monkeypatch.setattr(update, "anchors", spy)
    adv = torch.linspace(-1.0, 1.0, len(batch))
    out = update.train_on(trainer, batch, adv, rollout_id=3)
    assert out["train/optimizer_steps"] == 2.0 and out["train/micro_batch_size"] == 2.0
    # replayed micro-batch by micro-batch as the anchor pass does: the same row counts give
    # the same GEMM shapes, so bitwise equality does not depend on the CPU's kernel choice
    micro = captured["plan"].updates[1]
    with torch.no_grad():
        pre = torch.cat([replay_log_probs(adapter, before, batch.select(r)) for r in micro])
        post = torch.cat([replay_log_probs(adapter, model, batch.select(r)) for r in micro])
    assert torch.equal(torch.cat(captured["pi_old"][1]), pre)
    assert not torch.allclose(pre, post)  # the policy did move: the test can tell them apart
    # no forward spent on the first update's anchors: its training forward is its own
    assert captured["pi_old"][0] == [None] * len(captured["plan"].updates[0])


def test_largest_fitting_divisor_picks_a_divisor_and_refuses_what_cannot_fit():
    gib = 2.0 ** 30
    assert largest_fitting_divisor(12, 1 * gib, 5.5 * gib) == 4   # 5 and 5.5 are not divisors
    assert largest_fitting_divisor(12, 1 * gib, 100 * gib) == 12
    assert largest_fitting_divisor(7, 1 * gib, 6.9 * gib) == 1     # prime: only 1 fits
    assert largest_fitting_divisor(8, 0.0, 0.0) == 8                # nothing measured: all
    with pytest.raises(ValueError, match="one sample's replay needs 3.00 GiB"):
        largest_fitting_divisor(8, 3 * gib, 2 * gib)


def test_auto_micro_batch_on_the_cpu_is_the_whole_update(adapter, batch):
    cfg = lora_cfg()
    trainer = stand_in_trainer(adapter, cfg, _lora_model(adapter, cfg))
    assert cfg.train.micro_batch_size == "auto"
    assert resolve_micro_batch(trainer, batch, torch.ones(len(batch)), 4) == 4
    assert load_config(None, ["train.micro_batch_size=3"]).train.micro_batch_size == 3
    plan = plan_updates(len(batch), 2, 4)
    assert [len(m) for u in plan.updates for m in u] == [4, 4]


def test_auto_micro_batch_uses_the_probe_and_the_budget(adapter, batch, monkeypatch):
    from trainer.actor import micro_batch

    cfg = lora_cfg("train.micro_batch_memory_gb=2.5")
    trainer = stand_in_trainer(adapter, cfg, _lora_model(adapter, cfg))
    trainer.device = torch.device("cuda")  # the GPU branch, with the probe measured here
    monkeypatch.setattr(micro_batch, "probe_sample_bytes", lambda *a: 2.0 ** 30)
    assert resolve_micro_batch(trainer, batch, torch.ones(len(batch)), 4) == 2
    assert trainer.auto_micro_batch == 2  # kept for the run
    monkeypatch.setattr(micro_batch, "probe_sample_bytes", lambda *a: 3.0 * 2 ** 30)
    trainer.auto_micro_batch = None
    with pytest.raises(ValueError, match="micro_batch_size=auto"):
        resolve_micro_batch(trainer, batch, torch.ones(len(batch)), 4)


def test_lora_actor_keeps_the_frozen_base_in_the_compute_dtype(adapter):
    cfg = lora_cfg("fsdp.param_dtype=bf16")
    model = build_actor(adapter, cfg.train, cfg.fsdp, cfg.lora, torch.device("cpu"),
                        distributed=False)
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    full_cfg = load_config(None, ["fsdp.param_dtype=bf16"])
    full = build_actor(adapter, full_cfg.train, full_cfg.fsdp, full_cfg.lora,
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

    from trainer.engine.embedded.lora_merge import LoraMerger

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


def _text_conditions(batch: int, length: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length - 2:] = 0  # one padded prompt, as a batch of prompts of two lengths has
    return {"prompt_embeds": torch.randn(batch, length, JOINT), "prompt_embeds_mask": mask}


@pytest.mark.slow
@pytest.mark.parametrize("marked", [True, False], ids=["text-marked", "control"])
def test_a_second_prompt_length_compiles_nothing_once_the_text_dimension_is_marked(adapter, marked):
    torch._dynamo.reset()  # the block's code object may hold other tests' compiled graphs
    eager = adapter.load_train_model(dtype=torch.float32)
    compiled = adapter.load_train_model(dtype=torch.float32)
    compile_blocks(adapter.transformer_blocks(compiled),
                   adapter.block_dynamic_dims if marked else None)
    torch.manual_seed(0)
    latents = torch.randn(2, *adapter.latent_shape(Geometry(HEIGHT, WIDTH)))
    sigma = torch.tensor([0.7, 0.4])
    compiles = []
    for length in (5, 9):  # the actor's replay: forward and backward, grad enabled
        cond = _text_conditions(2, length)
        before = compile_events()
        got = adapter.velocity(compiled, latents, sigma, cond, Geometry(HEIGHT, WIDTH))
        got.square().sum().backward()
        compiles.append(compile_events() - before)
        want = adapter.velocity(eager, latents, sigma, cond, Geometry(HEIGHT, WIDTH))
        want.square().sum().backward()
        assert (got - want).abs().max() <= 1e-5
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            g, h = (torch.zeros_like(p) if x.grad is None else x.grad for x in (p, q))
            assert torch.allclose(g, h, rtol=1e-4, atol=1e-6), name
            p.grad, q.grad = None, None
    assert compiles[0] >= 1
    if marked:
        assert compiles[1] == 0, compiles
    else:  # without the marks torch compiles again at the second length
        assert compiles[1] >= 1, compiles


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


@pytest.mark.parametrize("fits", [True, False], ids=["fits", "does-not-fit"])
def test_the_first_step_decides_before_its_actor_offload(monkeypatch, fits):
    from trainer import loop
    from trainer.actor.colocate import OffloadPolicy
    from trainer.actor.model import OffloadState
    from trainer.profiling import StageTimer

    gib = 2 ** 30
    offloads, host = [], OffloadState({1: (torch.zeros(3), 12)})
    monkeypatch.setattr(loop, "offload_actor", lambda model, opt: offloads.append(model) or host)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 100 * gib))
    engine = {"memory_allocated_bytes": 20 * gib, "memory_peak_bytes": (35 if fits else 70) * gib}
    trainer = SimpleNamespace(
        colocate=OffloadPolicy("as_needed", offload_rollout=True, offload_train=True,
                               device="cuda"),
        driver=SimpleNamespace(last_engine_memory=engine), device=torch.device("cuda"),
        actor=SimpleNamespace(model="actor", optimizer=None, offloaded=None),
        timer=StageTimer(sync=False))
    # the first step: the actor measured 30 GiB resident, 50 GiB at its peak
    loop.Trainer._offload_after_train(trainer, (30 * gib, 50 * gib))
    assert trainer.colocate.decided
    assert offloads == ([] if fits else ["actor"])  # fits: no offload, so no onload next step
    assert trainer.actor.offloaded is (None if fits else host)
    if not fits:  # what the step reports as moved: the host copies' bytes
        assert trainer.colocate.metrics(trainer.actor.offloaded)["perf/offload_gb"] == 12 / 1e9
    loop.Trainer._offload_after_train(trainer, None)  # a later step follows the decision
    assert len(offloads) == (0 if fits else 2)
