"""The LoRA adapter sync mode against SGLang's own ``lora_merge`` (sglang==0.5.23), on CPU: the
served pipeline is SGLang's native ``QwenImagePipeline`` (a ``LoRAPipeline``) over its native
DiT, so an adapter update goes through SGLang's ``WeightsUpdater._update_lora_from_tensor``, its
LoRA layer conversion of the DiT's linear layers (the packed ``to_added_qkv`` included, whose
three sections' adapters SGLang stacks) and its merge; SGLang's checker then compares the merged
weights with the SHA-256 the trainer computed. tests/sglang_fixtures.py says what else is
SGLang's code.

This module serves its own server: after the first ``lora_merge`` SGLang has wrapped every
linear layer, which the plain-sync tests of test_sglang_api.py must not see.
"""
from __future__ import annotations

import pytest
import torch

from sglang_fixtures import require_sglang, serve_sglang, trainer_overrides

from trainer.engine.sglang.client import SGLangEngineClient
from trainer.engine.sglang.sync import SGLangSyncError, SGLangWeightSync
from trainer.models.qwen_image import QwenImageAdapter

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]

LAYER = "transformer_blocks.0.attn.to_q"
PACKED = "transformer_blocks.0.attn.to_added_qkv"
TARGETS = ["to_q", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"]
# a large step: one update must move the served model well past the replay tolerance
ADAPTER = ["lora.rank=4", "lora.alpha=8", "fsdp.trainable_mode=lora", "lora.adapter_mode=true",
           "train.lr=0.3"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_sglang(tiny_model_dir("qwen_image")) as srv:
        yield srv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_is_sglangs_bit_for_bit(dtype):
    """merged_weight repeats SGLang's LoRA layer merge (fp32, chunked addmm, alpha / rank, one
    rounding): the bytes are equal, so the checker can compare SHA-256 values."""
    from sglang.multimodal_gen.runtime.layers.lora import linear as sglang_lora

    from trainer.engine.sglang.lora import MERGE_CHUNK_BYTES, merged_weight

    assert MERGE_CHUNK_BYTES == sglang_lora.LORA_MERGE_CHUNK_BYTES
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(48, 40, dtype=dtype)
    base = layer.weight.detach().clone()
    a = torch.randn(4, 48, generator=gen).to(dtype)
    b = torch.randn(40, 4, generator=gen).to(dtype)
    wrapped = sglang_lora.wrap_with_lora_layer(layer)
    wrapped.lora_rank, wrapped.lora_alpha = 4, 8
    wrapped.set_lora_weights(a, b, merge_weights=True, clear_existing=True)
    ours = merged_weight(base, a, b, 8)
    assert ours.dtype == dtype and torch.equal(wrapped.base_layer.weight, ours)
    assert not torch.equal(ours, base)


def _peft(adapter, seed: int):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(adapter.load_train_model(),
                           LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    with torch.no_grad():  # a trained adapter: B away from its zero init
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def _lora_payload(model):
    return [(n, p) for n, p in model.named_parameters() if ".lora_" in n]


@pytest.fixture(scope="module")
def synced(server):
    """A sender that made the first (full) sync of a peft model: base weights as a checked
    plain update, the adapter as a lora_merge checked by its merged SHA-256."""
    client = SGLangEngineClient(server.url)
    sender = _sender(client)
    model = _peft(server.adapter, 0)
    seen = len(server.weight_requests)
    sender.sync(1, model.named_parameters())
    return sender, model, server.weight_requests[seen:]


def _sender(client):
    return SGLangWeightSync(client, lora=(8, 4), served_dit=QwenImageAdapter.sglang_dit)


def _packed_merged(model):
    """The merged text-stream projections of block 0, packed as the native DiT packs them."""
    merged = model.merge_and_unload()
    return torch.cat([merged.get_submodule(f"transformer_blocks.0.attn.{p}").weight
                      for p in ("add_q_proj", "add_k_proj", "add_v_proj")])


def test_first_sync_of_a_peft_model_is_checked_after_sglangs_merge(server, synced):
    sender, model, requests = synced
    kinds = [getattr(r, "weight_update_mode", None) or type(r).__name__ for r in requests]
    assert kinds == ["UpdateWeightFromTensorReqInput", "UpdateWeightFromTensorCheckerReqInput",
                     "lora_merge", "UpdateWeightFromTensorCheckerReqInput"]
    assert (requests[2].lora_alpha, requests[2].lora_rank) == (8, 4)
    checked = requests[3].expected_named_tensors_sha256
    for layer in (LAYER, PACKED):
        assert {f"{layer}.base_layer.weight", f"{layer}.lora_A", f"{layer}.lora_B"} <= set(checked)
    served = server.served_tensors()
    assert served[f"{PACKED}.lora_A"].shape == (3, 4, 32)  # SGLang stacks the three sections
    want = _packed_merged(model)  # merge_and_unload changes model: the packed layer first
    merged = model
    assert torch.allclose(served[f"{PACKED}.base_layer.weight"], want, atol=1e-6, rtol=0)
    assert torch.allclose(served[f"{LAYER}.base_layer.weight"],
                          merged.get_submodule(LAYER).weight, atol=1e-6, rtol=0)
    assert sender.client.committed_version == 1


def test_adapter_sync_is_merged_into_sglangs_base_snapshot(server, synced):
    """An adapter-only sync: SGLang restores the base it snapshot and merges the new adapter;
    the checker agrees with the trainer's expectation again."""
    sender = synced[0]
    retrained = _peft(server.adapter, 1)
    sender.sync(2, _lora_payload(retrained), mode="adapter")
    assert sender.client.committed_version == 2
    served = server.served_tensors()
    packed = _packed_merged(retrained)
    want = retrained.get_submodule(LAYER).weight
    assert torch.allclose(served[f"{LAYER}.base_layer.weight"], want, atol=1e-6, rtol=0)
    assert torch.allclose(served[f"{PACKED}.base_layer.weight"], packed, atol=1e-6, rtol=0)


def test_adapter_on_some_sections_of_a_packed_layer_is_refused(server, synced):
    """SGLang merges a packed layer's sections together: an adapter on add_q_proj alone
    cannot be verified, and the sync says so before sending anything."""
    payload = [(n, p) for n, p in _lora_payload(_peft(server.adapter, 2))
               if "add_k_proj" not in n and "add_v_proj" not in n]
    seen = len(server.weight_requests)
    with pytest.raises(SGLangSyncError, match=r"to_added_qkv: LoRA on sections \[0\] of 3"):
        synced[0].sync(3, payload, mode="adapter")
    assert len(server.weight_requests) == seen


def test_wrong_merge_expectation_fails_the_sync(server, synced, monkeypatch):
    """The check is real: an expectation computed with another scale does not match what
    SGLang merged, and the version does not advance."""
    from trainer.engine.sglang import lora as sglang_lora

    sender = synced[0]
    before = sender.client.committed_version
    monkeypatch.setattr(sglang_lora, "merge_scale", lambda alpha, rank: 1.0)
    with pytest.raises(SGLangSyncError, match="checksum mismatch"):
        sender.sync(before + 1, _lora_payload(_peft(server.adapter, 3)), mode="adapter")
    assert sender.client.committed_version == before


def test_unverifiable_adapter_syncs_are_refused(server, synced):
    client = SGLangEngineClient(server.url)
    payload = [(f"{LAYER}.lora_A.weight", torch.randn(4, 32)),
               (f"{LAYER}.lora_B.weight", torch.randn(32, 4))]
    with pytest.raises(SGLangSyncError, match="no base weight was synced"):
        _sender(client).sync(5, payload, mode="adapter")
    with pytest.raises(SGLangSyncError, match="without both lora_A and lora_B"):
        _sender(client).sync(5, payload[:1], mode="adapter")
    # SGLang keeps the linear weights it wrapped under '.base_layer.': a second full sync
    # cannot reach them, and the checker says so
    with pytest.raises(SGLangSyncError, match="restart the SGLang server"):
        _sender(client).sync(5, _peft(server.adapter, 4).named_parameters())
    assert client.committed_version is None


def test_pair_buckets_never_split_a_layer():
    from trainer.engine.sglang.lora import pair_buckets

    groups = [(f"l{i}", [(None, f"l{i}", (torch.zeros(4, 8), torch.zeros(8, 4)))])
              for i in range(5)]
    buckets = list(pair_buckets(groups, 300))  # 256 bytes a pair: one pair per bucket
    assert [[layer for layer, _ in b] for b in buckets] == [[f"l{i}"] for i in range(5)]
    assert [len(b) for b in pair_buckets(groups, 600)] == [2, 2, 1]
    # a packed layer's three sections (768 bytes) travel together, over the bucket size
    packed = ("qkv", [(k, f"s{k}", (torch.zeros(4, 8), torch.zeros(8, 4))) for k in range(3)])
    assert [[layer for layer, _ in b] for b in pair_buckets([groups[0], packed, groups[1]], 600)
            ] == [["l0"], ["qkv"], ["l1"]]


def test_trainer_adapter_mode_through_lora_merge(tiny_model_dir, tmp_path):
    """A LoRA adapter-mode run on SGLang: every sync goes through SGLang's lora_merge and is
    checker-verified; after a step the next rollout is served by the merged weights (it
    differs from the base model's and replays under a local merged model)."""
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    model_dir = tiny_model_dir("qwen_image")
    with serve_sglang(model_dir) as server:  # a fresh server: its first sync is a full one
        cfg = load_config("tiny", trainer_overrides(model_dir, server.url, tmp_path) + ADAPTER)
        preflight(cfg, world_size=1, device="cpu")
        _adapter_mode_run(Trainer(cfg, rank=0, world=1, device="cpu"), server)


def _adapter_mode_run(trainer, server):
    from trainer.actor.replay import replay_log_probs
    from trainer.actor.sync import merged_full_tensors

    adapter = server.adapter
    client = SGLangEngineClient(server.url)
    probe = adapter.build_rollout_request(["a teacup"] * 2, ["probe:0", "probe:1"],
                                          trainer.cfg.rollout.sampling, rollout_id=0, seed=3,
                                          sde_indices=[1, 2])
    try:
        assert trainer.cfg.sync_mode == "adapter" and trainer.engine.committed_version == 0
        before = client.generate(probe)
        trainer.train_step(0)
        assert trainer.policy_version == trainer.engine.committed_version == 1
        last = server.weight_requests[-2:]
        assert last[0].weight_update_mode == "lora_merge"
        assert "transformer_blocks.0.attn.to_added_qkv.base_layer.weight" in \
            last[1].expected_named_tensors_sha256
        local = adapter.load_train_model().eval()
        base = adapter.load_train_model().eval()
        local.load_state_dict(dict(merged_full_tensors(trainer.model, 8 / 4)))
        assert any(not torch.equal(p, base.state_dict()[n]) for n, p in local.state_dict().items())
        batch = trainer.rollout(1)
        with torch.no_grad():
            served_replay = replay_log_probs(adapter, local, batch, backend="torch")
            base_replay = replay_log_probs(adapter, base, batch, backend="torch")
        assert torch.allclose(served_replay, batch.log_probs, atol=2e-4, rtol=0)
        assert float((base_replay - batch.log_probs).abs().max()) > 2e-3
        # the same request (same seeds, so the same noise) is answered differently now
        after = client.generate(probe)
        assert not torch.allclose(after["dit_trajectory"]["latents"],
                                  before["dit_trajectory"]["latents"], atol=1e-3)
    finally:
        trainer.close()
