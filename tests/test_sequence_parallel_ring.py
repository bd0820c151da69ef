"""Ring attention for ``fsdp.sequence_parallel`` where the degree does not divide the heads.

First the CPU backend's op pair (``trainer.parallel.cpu_flash_attention``) against attention
written plainly in float64: its output, log-sum-exp and the three gradients, with and without a
padding mask, and the property diffusers' ring relies on: the backward of each key chunk, given
the merged output and log-sum-exp, yields that chunk's share of the gradient. Then diffusers'
ring with that backend at two gloo ranks against one plain rank, for a tiny Wan and a tiny
Qwen-Image of three heads (degree 2 does not divide them): the same SDE log-probs and every
parameter's gradient to fp32 rounding, as ``tests/test_sequence_parallel.py`` checks Ulysses.
"""
from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from dist_fixtures import run_on_gloo_ranks
from test_sequence_parallel import (_actor_apply_fsdp, _checkpointed_and_split,
                                    _compare_with_one_rank, _split_and_shard, _wan_inputs)
from trainer.parallel import cpu_flash_attention
from trainer.parallel.rules import RING_BACKENDS, model_problems, ring_problems, uses_ring

B, S, K, H, D = 2, 5, 7, 3, 6  # odd sizes: no dimension equal to another


class _Ctx:
    """Stands in for the autograd context diffusers' ring hands the ops (an attribute
    holder with ``save_for_backward``), so the op pair can be called outside a ring."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _attention64(q, k, v, mask=None):
    """Softmax attention in float64 of (B, S, H, D) inputs: output and log-sum-exp (B, S, H)."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - lse[..., None]) @ v
    return out.transpose(1, 2), lse.transpose(1, 2)


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, H, D, generator=g, dtype=dtype) for n in (S, K, K))
    mask = torch.ones(B, 1, 1, K, dtype=torch.bool)
    mask[1, ..., 4:] = False  # the second sample's last keys are padding
    return q, k, v, mask, torch.randn(B, S, H, D, generator=g, dtype=dtype)


def _oracle(q, k, v, mask, grad_out):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out, lse = _attention64(*leaves, mask)
    out.backward(grad_out.double())
    return out.detach(), lse.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_the_cpu_flash_ops_give_the_output_lse_and_gradients_of_softmax_attention(dtype, masked):
    q, k, v, mask, grad_out = _inputs(dtype)
    mask = mask if masked else None
    ctx = _Ctx()
    out, lse = cpu_flash_attention._forward_op(ctx, q, k, v, mask, return_lse=True)
    grads = cpu_flash_attention._backward_op(ctx, grad_out)
    want_out, want_lse, want_grads = _oracle(q, k, v, mask, grad_out)
    assert out.shape == (B, S, H, D) and lse.shape == (B, S, H) and out.dtype == dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)
    for name, got, want in zip("qkv", grads, want_grads, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, **tol, msg=f"grad {name}")


def test_each_key_chunks_backward_under_the_merged_lse_is_its_share_of_the_gradient():
    """What diffusers' ring backward does: one backward call per key chunk with the merged
    (whole-softmax) output and log-sum-exp; the query gradients add up, the key and value
    gradients are the chunk's rows of the whole."""
    q, k, v, mask, grad_out = _inputs(torch.float64, seed=1)
    ctx = _Ctx()
    out, lse = cpu_flash_attention._forward_op(ctx, q, k, v, mask, return_lse=True)
    _, _, (want_q, want_k, want_v) = _oracle(q, k, v, mask, grad_out)
    got_q = torch.zeros_like(q)
    for start, stop in ((0, 3), (3, K)):
        chunk = _Ctx()
        cpu_flash_attention._forward_op(chunk, q, k[:, start:stop], v[:, start:stop],
                                        mask[..., start:stop])
        gq, gk, gv = cpu_flash_attention._backward_op(chunk, grad_out, out=out, lse=lse)
        got_q += gq
        torch.testing.assert_close(gk, want_k[:, start:stop], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gv, want_v[:, start:stop], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_q, want_q, rtol=1e-12, atol=1e-12)


def test_the_backend_is_registered_with_diffusers_dispatcher_and_matches_native_sdpa():
    from diffusers.models.attention_dispatch import (AttentionBackendName,
                                                     _AttentionBackendRegistry,
                                                     dispatch_attention_fn)

    name = cpu_flash_attention.register()
    assert cpu_flash_attention.register() is name  # once
    assert RING_BACKENDS["cpu"] == cpu_flash_attention.NAME  # the torch-free rules name it
    assert AttentionBackendName(cpu_flash_attention.NAME) is name
    assert name.value in {m.value for m in AttentionBackendName.__members__.values()}
    assert _AttentionBackendRegistry._is_context_parallel_available(name)
    q, k, v, mask, _ = _inputs(torch.float32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    got = dispatch_attention_fn(*leaves, attn_mask=mask, backend=name)
    want = dispatch_attention_fn(q, k, v, attn_mask=mask, backend=AttentionBackendName.NATIVE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.sum().backward()  # torch differentiates the kernel outside a ring
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in leaves)


def test_ring_is_chosen_exactly_where_the_degree_does_not_divide_the_heads():
    assert not uses_ring(1, 3) and not uses_ring(2, 4) and not uses_ring(3, 3)
    assert uses_ring(2, 3) and uses_ring(4, 6) and uses_ring(4, 2)


def test_the_ring_rules_name_every_problem_at_once():
    assert ring_problems(2, model="Wan", transformer_class="WanTransformer3DModel",
                         device_type="cpu", compute_dtype="fp32") == []
    assert ring_problems(2, model="Wan", transformer_class="WanTransformer3DModel",
                         device_type="cuda", compute_dtype="bf16") == []
    qwen = ring_problems(2, model="Qwen", transformer_class="QwenImageTransformer2DModel",
                         device_type="cuda", compute_dtype="fp32")
    assert len(qwen) == 2
    assert "_native_cudnn" in qwen[0] and "fp32" in qwen[0]
    assert "text mask" in qwen[1]
    assert "no attention backend on 'mps'" in ring_problems(
        2, model="Wan", transformer_class="WanTransformer3DModel", device_type="mps")[0]
    assert model_problems(2, model="Wan", sequences={"image tokens": 4}) == []


# ---- diffusers' ring at two gloo ranks against one rank --------------------------------------


def _tiny_wan3():
    """The tiny Wan of the Ulysses tests with three heads, which degree 2 does not divide."""
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8,
                                 in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
                                 ffn_dim=32, num_layers=2, rope_max_seq_len=32)


def _assert_ring(model) -> None:
    from trainer.actor.model import inner_model

    cp = inner_model(model)._parallel_config.context_parallel_config
    assert (cp.ring_degree, cp.ulysses_degree) == (2, 1)


def _ring_split(split, model, sequence_degree: int):
    split(model, sequence_degree)
    _assert_ring(model)


def _wan_check(split=_split_and_shard) -> None:
    _compare_with_one_rank(_tiny_wan3, _wan_inputs, split=functools.partial(_ring_split, split))


def test_a_three_head_wan_split_over_two_gloo_ranks_by_ring_replays_like_one_rank():
    run_on_gloo_ranks(_wan_check)


def test_the_actors_fsdp2_entry_runs_ring_with_activation_checkpointing():
    run_on_gloo_ranks(functools.partial(_wan_check, _checkpointed_and_split))


def test_ring_over_two_data_groups_of_two_sequence_ranks_trains_like_one_rank():
    run_on_gloo_ranks(functools.partial(_wan_check, _actor_apply_fsdp), world=4)


def qwen_image_with_three_heads(model_dir, out):
    """A copy of the tiny Qwen-Image model directory whose transformer has three heads (its
    head width and everything else as the tiny one's), saved by diffusers."""
    from diffusers import QwenImageTransformer2DModel

    shutil.copytree(model_dir, out)
    config = json.loads((out / "transformer" / "config.json").read_text())
    shutil.rmtree(out / "transformer")
    keep = {k: v for k, v in config.items() if not k.startswith("_")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        QwenImageTransformer2DModel(**{**keep, "num_attention_heads": 3}).save_pretrained(
            out / "transformer")
    return out


def _qwen_check(model_dir: str, text: int) -> None:
    """The Ulysses test's Qwen-Image check (``tests/test_sequence_parallel.py``) on the
    three-head model: loaded through the adapter, the second prompt padded."""
    from trainer.models.qwen_image import QwenImageAdapter

    def build():
        model = QwenImageAdapter(model_dir).load_train_model().float()
        model.requires_grad_(True)
        return model

    def make_inputs(model, seed: int = 0):
        g = torch.Generator().manual_seed(1 + seed)
        batch, side = 2, 4
        mask = torch.ones(batch, text, dtype=torch.long)
        mask[1, 4:] = 0  # rank 1's text chunk holds the padding, rank 0's none
        inputs = dict(hidden_states=torch.randn(batch, side * side, model.config.in_channels,
                                                generator=g),
                      timestep=torch.tensor([0.7, 0.7]),
                      encoder_hidden_states=torch.randn(batch, text,
                                                        model.config.joint_attention_dim,
                                                        generator=g),
                      encoder_hidden_states_mask=mask, img_shapes=[[(1, side, side)]] * batch)
        v_shape = (batch, side * side, model.config.out_channels * 4)
        x = torch.randn(v_shape, generator=g)
        return inputs, x, x + 0.1 * torch.randn(v_shape, generator=g), torch.tensor([0.5, -1.0])

    _compare_with_one_rank(build, make_inputs,
                           split=functools.partial(_ring_split, _split_and_shard))


@pytest.mark.parametrize("text", [6, 5], ids=["text-6", "text-5-padded"])
def test_a_three_head_qwen_image_split_by_ring_replays_like_one_rank(tiny_model_dir, tmp_path,
                                                                     text):
    """The second prompt is padded (a masked key on some rank's chunk); five text tokens are
    also padded to six by the split: each chunk must be given its own rank's mask."""
    model_dir = qwen_image_with_three_heads(tiny_model_dir("qwen_image"), tmp_path / "qwen3")
    run_on_gloo_ranks(functools.partial(_qwen_check, str(model_dir), text))
