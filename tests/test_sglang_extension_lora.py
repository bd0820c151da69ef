"""LoRA adapter sync mode through the extension's receiver (trainer/engine/sglang/lora_receiver.py)
into SGLang's own native Qwen-Image DiT (sglang==0.5.23), on CPU, over shared memory.

The server is SGLang's native pipeline with the extension loaded in both of its processes
(tests/sglang_fixtures.py says what is SGLang's code and what stands in); the trainer side is
the trainer's own: peft LoRA on our diffusers transformer, its sync payloads
(``trainer.actor.sync.sync_payload``) and, for the expected served weights, the actor's own
merge (``merged_full_tensors``) packed as the native DiT packs (``to_added_qkv``).

The Qwen-Image tests share one server and run in order (first sync, replacing syncs, faults,
then the trainer's connections, which take the worker's channels over); SD3 and FLUX.1 get a
server each. The tests at the end drive our receiver's rollback with injected merge failures,
which must run where the merge runs: there the worker is in this process and serves a stand-in
module (named in its docstring) instead of SGLang's DiT.
"""
from __future__ import annotations

import pytest
import torch

from sglang_fixtures import (_process_state_kept, as_served, require_sglang, serve_sglang,
                             trainer_overrides)

import ipc
from ipc._copyplan import CopyPlan
from trainer.actor.sync import merged_full_tensors, sync_payload
from trainer.engine.sglang.client import SGLangEngineClient
from trainer.engine.sglang.transport import SGLangTransport, fetch_receivers
from trainer.models.lora import apply_lora

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

RANK, ALPHA = 4, 8
SCALING = ALPHA / RANK
BUCKET = 64 << 10
ADAPTER = [f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "fsdp.trainable_mode=lora",
           "lora.adapter_mode=true", "train.lr=0.3"]
QKV = "transformer_blocks.0.attn.to_added_qkv.weight"
TO_Q = "transformer_blocks.0.attn.to_q.weight"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_sglang(tiny_model_dir("qwen_image"), extension=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def transport(server):
    t = SGLangTransport.connect(server.url, "cpu", lora_scaling=SCALING, bucket_bytes=BUCKET,
                                timeout_s=60.0)
    yield t
    t.close()


def _peft(adapter, seed: int, targets=None):
    """Our diffusers transformer of the served checkpoint with the trainer's LoRA layers, as
    after some training (B away from its zero init)."""
    torch.manual_seed(seed)
    model = apply_lora(adapter.load_train_model(), rank=RANK, alpha=ALPHA,
                       target_modules=list(targets or adapter.lora_target_modules()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def _payload(adapter, model, *, first: bool):
    """What the trainer's loop sends: its first sync (base + pairs) or an adapter sync."""
    names = adapter.weight_name_map([n for n, _ in model.named_parameters()])
    return list(sync_payload(model, "full" if first else "adapter", scaling=SCALING,
                             first=first, name_map=names))


def _expected(adapter, model) -> dict[str, torch.Tensor]:
    """The actor's merged weights, under the native DiT's (packed) names."""
    return as_served(merged_full_tensors(model, SCALING), adapter.sglang_dit)


def _differ(served: dict, expected: dict) -> list[str]:
    """Names of ``expected`` whose bytes the server does not hold."""
    def raw(t):
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    return sorted(n for n, t in expected.items() if n not in served or served[n].dtype != t.dtype
                  or not torch.equal(raw(served[n]), raw(t)))


def test_first_adapter_sync_serves_the_actors_merged_weights_bit_for_bit(server, transport):
    adapter, model = server.adapter, _peft(server.adapter, 1)
    routes = len(server.weight_requests)
    stats = transport.sync(0, _payload(adapter, model, first=True))
    served, expected = server.served_tensors(), _expected(adapter, model)
    assert _differ(served, expected) == []
    base = as_served(adapter.load_train_model().named_parameters(), adapter.sglang_dit)
    assert not torch.equal(served[QKV], base[QKV]) and not torch.equal(served[TO_Q], base[TO_Q])
    assert stats.tensors == len(expected) + 2 * sum(".lora_A" in n for n, _ in
                                                    model.named_parameters())
    assert server.weight_requests[routes:] == []  # SGLang's own weight routes never called
    assert fetch_receivers(server.url)[0]["committed_version"] == transport.version_base


def test_a_second_adapter_sync_replaces_the_first(server, transport):
    """Each sync merges the whole adapter into the base snapshot: the served weights are the
    new adapter's merge, not the two stacked; a layer the new adapter leaves out is back to its
    base, bit for bit."""
    adapter = server.adapter
    first, second = _peft(adapter, 1), _peft(adapter, 2)
    transport.sync(1, _payload(adapter, second, first=False), mode="adapter")
    served = server.served_tensors()
    assert _differ(served, _expected(adapter, second)) == []
    assert _differ(served, _expected(adapter, first)) != []
    only_q = _peft(adapter, 3, targets=["attn.to_q"])  # another layer set: another channel
    transport.sync(2, _payload(adapter, only_q, first=False), mode="adapter")
    served = server.served_tensors()
    assert _differ(served, _expected(adapter, only_q)) == []
    base = as_served(adapter.load_train_model().named_parameters(), adapter.sglang_dit)
    assert torch.equal(served[QKV], base[QKV]) and not torch.equal(served[TO_Q], base[TO_Q])


def _probe(adapter):
    sampling = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                "driver_sigmas": False, "driver_xt": False, "guidance_scale": 1.0,
                "sde_type": "sde"}
    return adapter.build_rollout_request(["a teacup"], ["probe:0"], sampling, rollout_id=0,
                                         seed=3, sde_indices=[1, 2])


def _corrupting_run_bucket(real):
    def run(self, b, memory, *a, **k):
        real(self, b, memory, *a, **k)
        if b == 0:  # one flipped byte of the bucket's first tensor, after the copy's checksum
            memory[self.dst_offsets[self.buckets[0][0][0]]] ^= 0x40
    return run


def test_a_corrupted_bucket_fails_and_the_previous_version_keeps_serving(server, transport,
                                                                         monkeypatch):
    adapter, client = server.adapter, SGLangEngineClient(server.url)
    version = 3
    transport.sync(version, _payload(adapter, _peft(adapter, 4), first=False), mode="adapter")
    before, rollout = server.served_tensors(), client.generate(_probe(adapter))
    update = _peft(adapter, 5)
    monkeypatch.setattr(CopyPlan, "run_bucket", _corrupting_run_bucket(CopyPlan.run_bucket))
    with pytest.raises(ipc.WeightSyncError) as err:
        transport.sync(version + 1, _payload(adapter, update, first=False), mode="adapter")
    monkeypatch.undo()
    assert err.value.stage == "post-write"
    assert "checksum mismatch in 1 tensors: transformer_blocks.0.attn.to_q.lora_A.weight" \
        in str(err.value)
    assert _differ(server.served_tensors(), before) == []
    again = client.generate(_probe(adapter))  # still served, by the previous version
    assert torch.equal(again["dit_trajectory"]["latents"], rollout["dit_trajectory"]["latents"])
    assert fetch_receivers(server.url)[0]["committed_version"] == transport.version_base + version
    transport.sync(version + 1, _payload(adapter, update, first=False), mode="adapter")
    assert _differ(server.served_tensors(), _expected(adapter, update)) == []


def test_a_pair_for_a_layer_the_server_lacks_is_refused_before_anything_is_applied(server,
                                                                                 transport):
    """Here with a run's first sync: neither its base nor its adapter is written, and one
    error names every layer that does not fit."""
    adapter = server.adapter
    before = server.served_tensors()
    committed = fetch_receivers(server.url)[0]["committed_version"]
    model = _peft(adapter, 6)
    with torch.no_grad():  # a base the refused sync would have written
        model.base_model.model.transformer_blocks[0].attn.to_q.base_layer.weight.add_(1.0)
    payload = _payload(adapter, model, first=True) + [
        ("transformer_blocks.0.attn.no_such_proj.lora_A.weight", torch.randn(RANK, 32)),
        ("transformer_blocks.0.attn.no_such_proj.lora_B.weight", torch.randn(32, RANK)),
        ("proj_out.lora_A.weight", torch.randn(RANK, 7)),
        ("proj_out.lora_B.weight", torch.randn(16, RANK))]
    with pytest.raises(ipc.WeightSyncError) as err:
        transport.sync(7, payload)
    message = str(err.value)
    assert err.value.stage == "pre-write"
    assert "LoRA layers the server holds no linear weight for (1): " \
           "transformer_blocks.0.attn.no_such_proj" in message
    assert "shape mismatch (1): proj_out: A is [4, 7], proj_out.weight takes 32 inputs" in message
    assert _differ(server.served_tensors(), before) == []
    assert fetch_receivers(server.url)[0]["committed_version"] == committed
    SGLangEngineClient(server.url).generate(_probe(adapter))  # serving, not refusing


def _connect(server, tiny_model_dir, tmp_path, extra):
    from trainer.config import load_config
    from trainer.engine.sglang.sync import connect_sglang

    overrides = trainer_overrides(tiny_model_dir("qwen_image"), server.url, tmp_path)
    cfg = load_config("tiny", overrides + ADAPTER + extra)
    return connect_sglang(cfg.model, cfg.rollout, cfg.lora, cfg.weight_sync, 0, tmp_path,
                          server.adapter)[1]


def test_adapter_mode_picks_the_extension_and_else_sglangs_lora_merge(
        server, tiny_model_dir, tmp_path, monkeypatch):
    """``connect_sglang`` in LoRA adapter sync mode: the extension's transport (with the
    adapter's scaling) when the server publishes receivers; SGLang's lora_merge (stock
    ``SGLangWeightSync``) when its receivers are turned off or the extension is not used."""
    from trainer.engine.sglang.sync import SGLangWeightSync

    sender = _connect(server, tiny_model_dir, tmp_path, ["rollout.sglang_extension=true"])
    try:
        assert isinstance(sender, SGLangTransport) and sender.lora_scaling == SCALING
    finally:
        sender.close()
    for extra in (["rollout.sglang_extension=false"], ["rollout.sglang_extension=true"]):
        if extra[0].endswith("true"):
            monkeypatch.setenv("FLOWGRPO_WEIGHT_RECEIVER", "0")
        sender = _connect(server, tiny_model_dir, tmp_path, extra)
        assert isinstance(sender, SGLangWeightSync) and sender.lora == (ALPHA, RANK)


def test_training_in_adapter_mode_through_the_extension(server, tiny_model_dir, tmp_path):
    """A LoRA adapter-mode run with the extension: the first sync (base + adapter) and every
    step's adapter go through our receiver (no SGLang weight route called), the served weights
    are the actor's merge bit for bit, and the next rollout is sampled by them."""
    from trainer.actor.replay import replay_log_probs
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    adapter = server.adapter
    overrides = trainer_overrides(tiny_model_dir("qwen_image"), server.url, tmp_path)
    cfg = load_config("tiny", overrides + ADAPTER + ["rollout.sglang_extension=true"])
    preflight(cfg, world_size=1, device="cpu")
    routes = len(server.weight_requests)
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        assert isinstance(trainer.sender, SGLangTransport)
        assert trainer.cfg.sync_mode == "adapter" and trainer.engine.committed_version == 0
        assert _differ(server.served_tensors(), _expected(adapter, trainer.model)) == []
        trainer.train_step(0)
        assert trainer.policy_version == trainer.engine.committed_version == 1
        assert _differ(server.served_tensors(), _expected(adapter, trainer.model)) == []
        local = adapter.load_train_model().eval()
        local.load_state_dict(dict(merged_full_tensors(trainer.model, SCALING)))
        base = adapter.load_train_model().eval()
        batch = trainer.rollout(1)
        with torch.no_grad():
            served_replay = replay_log_probs(adapter, local, batch, backend="torch")
            base_replay = replay_log_probs(adapter, base, batch, backend="torch")
        assert torch.allclose(served_replay, batch.log_probs, atol=2e-4, rtol=0)
        assert float((base_replay - batch.log_probs).abs().max()) > 2e-3
        assert server.weight_requests[routes:] == []
    finally:
        trainer.close()


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_adapter_syncs_into_sd3_and_flux_native_dits(tiny_model_dir, family):
    """The same channel on the other families' native DiTs (nothing packed; SD3's position
    table, a parameter there, is never synced): the actor's merge bit for bit, then replaced."""
    with serve_sglang(tiny_model_dir(family), extension=True) as srv:
        adapter = srv.adapter
        t = SGLangTransport.connect(srv.url, "cpu", lora_scaling=SCALING, bucket_bytes=BUCKET)
        try:
            first, second = _peft(adapter, 1), _peft(adapter, 2)
            t.sync(0, _payload(adapter, first, first=True))
            assert _differ(srv.served_tensors(), _expected(adapter, first)) == []
            t.sync(1, _payload(adapter, second, first=False), mode="adapter")
            served = srv.served_tensors()
            assert _differ(served, _expected(adapter, second)) == []
            assert _differ(served, _expected(adapter, first)) != []
        finally:
            t.close()



def test_adapter_syncs_into_wans_renamed_native_dit(tmp_path):
    """Wan 2.1's native DiT renames most parameters (``attn1.to_q`` -> ``to_q``): the adapter
    channel places each pair by the same name rules as the full channel, so the served weights
    are the actor's merge bit for bit under SGLang's names, then replaced."""
    from wan_models import build_tiny_wan_dir

    built = build_tiny_wan_dir("wan2.1", tmp_path / "wan2.1")
    with serve_sglang(built.rename(built.parent / "wan"), extension=True) as srv:
        adapter = srv.adapter
        t = SGLangTransport.connect(srv.url, "cpu", lora_scaling=SCALING, bucket_bytes=BUCKET)
        try:
            first, second = _peft(adapter, 1), _peft(adapter, 2)
            t.sync(0, _payload(adapter, first, first=True))
            expected = _expected(adapter, first)
            assert any(".attn1." not in n and ".to_q." in n for n in expected)  # renamed
            assert _differ(srv.served_tensors(), expected) == []
            t.sync(1, _payload(adapter, second, first=False), mode="adapter")
            served = srv.served_tensors()
            assert _differ(served, _expected(adapter, second)) == []
            assert _differ(served, expected) != []
        finally:
            t.close()

# ---- the worker in this process: rollback of a merge that fails, refusals ----------------------
class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = torch.nn.Linear(8, 8)
        self.to_added_qkv = torch.nn.Linear(8, 24)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()


class _StandInDiT(torch.nn.Module):
    """Stand-in for SGLang's native DiT, in this process (the faults below are injected into
    the worker's merge, which runs where the worker runs): one block with a linear layer
    under our name and the text-stream projections packed by SGLang's own Qwen-Image packing
    table (its ``QwenImageArchConfig.param_names_mapping``)."""

    def __init__(self) -> None:
        with _process_state_kept():  # SGLang's imports set environment variables
            from sglang.multimodal_gen.configs.models.dits.qwenimage import QwenImageArchConfig

        super().__init__()
        self.param_names_mapping = QwenImageArchConfig().param_names_mapping
        self.transformer_blocks = torch.nn.ModuleList([_Block()])


LAYERS = {"transformer_blocks.0.attn.to_q": (8, 8)}
LAYERS.update({f"transformer_blocks.0.attn.add_{p}_proj": (8, 8) for p in "qkv"})


def _our_tensors(seed: int) -> tuple[dict, dict]:
    """(base tensors, LoRA pairs) in our names, as the trainer holds them."""
    g = torch.Generator().manual_seed(seed)
    base, pairs = {}, {}
    for layer, (rows, cols) in LAYERS.items():
        base[f"{layer}.weight"] = torch.randn(rows, cols, generator=g)
        base[f"{layer}.bias"] = torch.randn(rows, generator=g)
        pairs[layer] = (torch.randn(RANK, cols, generator=g), torch.randn(rows, RANK, generator=g))
    return base, pairs


def _pair_items(pairs: dict) -> list:
    return [(f"{layer}.lora_{k}.weight", t) for layer, ab in pairs.items() for k, t in zip("AB", ab)]


def _served_after(transport, base: dict, pairs: dict | None) -> dict:
    """What the worker must serve: each layer merged by the actor's function, packed."""
    from trainer.models.lora import merged_lora_weight

    merged = dict(base)
    for layer, (a, b) in (pairs or {}).items():
        merged[f"{layer}.weight"] = merged_lora_weight(base[f"{layer}.weight"], a, b, SCALING)
    return {n: t.full_tensor() if hasattr(t, "full_tensor") else t
            for n, t in transport.packing.payload(merged.items())}


@pytest.fixture
def local(tmp_path, monkeypatch):
    """(worker, its DiT, a connected transport), the worker's receivers in this process."""
    from trainer.engine.sglang.receiver import WorkerReceiver, read_descriptors

    monkeypatch.setenv("FLOWGRPO_RECEIVER_DIR", str(tmp_path))
    dit = _StandInDiT()
    worker = WorkerReceiver(dit, rank=0, port="local")
    transport = SGLangTransport(read_descriptors("local")[0], lora_scaling=SCALING,
                                bucket_bytes=BUCKET, timeout_s=20.0)
    yield worker, dit, transport
    transport.close()
    worker.close()


def _failing_merge(monkeypatch, fail) -> None:
    """The worker's merge raising on the calls ``fail(call number)`` picks (from 1)."""
    from trainer.engine.sglang import lora_receiver

    real, calls = lora_receiver.merged_lora_weight, []

    def merge(*args):
        calls.append(1)
        if fail(len(calls)):
            raise RuntimeError(f"injected merge failure (call {len(calls)})")
        return real(*args)

    monkeypatch.setattr(lora_receiver, "merged_lora_weight", merge)


def _dit_tensors(dit) -> dict:
    return {n: p.detach().clone() for n, p in dit.named_parameters()}


def test_a_merge_that_fails_puts_the_previous_version_back(local, monkeypatch):
    """The second layer's merge fails after the first layer was written: that layer gets the
    previous version's weight back, the version does not commit (only its retry is taken),
    the worker keeps serving, and the retry applies."""
    worker, dit, transport = local
    base, first = _our_tensors(1)
    transport.sync(0, list(base.items()) + _pair_items(first))
    before = _dit_tensors(dit)
    assert _differ(before, _served_after(transport, base, first)) == []
    second = _our_tensors(2)[1]
    _failing_merge(monkeypatch, lambda call: call == 2)  # to_q merged, then to_added_qkv fails
    with pytest.raises(ipc.WeightSyncError) as err:
        transport.sync(1, _pair_items(second), mode="adapter")
    assert err.value.stage == "post-write"
    assert "the engine did not take version 1: RuntimeError: injected merge failure (call 2)" \
        in str(err.value)
    assert _differ(_dit_tensors(dit), before) == []
    worker.assert_servable()
    monkeypatch.undo()
    with pytest.raises(ipc.WeightSyncError, match="only a retry of version 1 is accepted"):
        transport.sync(2, _pair_items(second), mode="adapter")
    transport.sync(1, _pair_items(second), mode="adapter")
    assert _differ(_dit_tensors(dit), _served_after(transport, base, second)) == []


def test_a_failed_restore_refuses_to_serve_until_a_sync_succeeds(local, monkeypatch):
    worker, dit, transport = local
    base, first = _our_tensors(1)
    transport.sync(0, list(base.items()) + _pair_items(first))
    second = _our_tensors(2)[1]
    _failing_merge(monkeypatch, lambda call: call >= 2)  # the restore's merge fails as well
    with pytest.raises(ipc.WeightSyncError):
        transport.sync(1, _pair_items(second), mode="adapter")
    with pytest.raises(ipc.WeightSyncError, match="restoring the previous one failed"):
        worker.assert_servable()
    monkeypatch.undo()
    transport.sync(1, _pair_items(second), mode="adapter")
    worker.assert_servable()
    assert _differ(_dit_tensors(dit), _served_after(transport, base, second)) == []


def test_a_runs_base_is_not_served_without_its_adapter(local, monkeypatch):
    """The first sync of an adapter run writes the base (full channel), then the adapter: if
    the adapter fails, the worker refuses to denoise (a base alone is no policy version)."""
    worker, dit, transport = local
    base, pairs = _our_tensors(3)
    _failing_merge(monkeypatch, lambda call: True)
    with pytest.raises(ipc.WeightSyncError):
        transport.sync(0, list(base.items()) + _pair_items(pairs))
    assert _differ(_dit_tensors(dit), _served_after(transport, base, None)) == []
    with pytest.raises(ipc.WeightSyncError, match="base weights of version 0 are written but "
                                                  "not their LoRA adapter"):
        worker.assert_servable()
    monkeypatch.undo()
    transport.sync(0, list(base.items()) + _pair_items(pairs))
    worker.assert_servable()
    assert _differ(_dit_tensors(dit), _served_after(transport, base, pairs)) == []


def test_an_adapter_on_part_of_a_packed_weight_is_refused_naming_it(local):
    worker, dit, transport = local
    base, pairs = _our_tensors(4)
    transport.sync(0, list(base.items()) + _pair_items(pairs))
    before = _dit_tensors(dit)
    partial = {k: v for k, v in _our_tensors(5)[1].items() if "add_k" not in k and "add_v" not in k}
    with pytest.raises(ipc.WeightSyncError) as err:
        transport.sync(1, _pair_items(partial), mode="adapter")
    assert err.value.stage == "pre-write"
    assert "transformer_blocks.0.attn.to_added_qkv.weight: LoRA on sections [0] of 3" \
        in str(err.value)
    assert _differ(_dit_tensors(dit), before) == []
    worker.assert_servable()
