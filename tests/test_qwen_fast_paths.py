"""trainer/patches/diffusers_qwen_fast_paths.py: the same values as diffusers' own Qwen-Image code, with
no host copy at each forward and no complex tensor inside a compiled block.

Oracle: diffusers' functions themselves (``install_fast_paths(False)`` puts them back)."""
from __future__ import annotations

import pytest
import torch

from trainer.patches.diffusers_qwen_fast_paths import install_fast_paths, rotate_real, text_seq_len_from_mask
from trainer.models.qwen_image import QwenImageAdapter

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture
def module():
    """diffusers' Qwen-Image module, its fast paths installed again after the test."""
    from diffusers.models.transformers import transformer_qwenimage

    yield transformer_qwenimage
    install_fast_paths(True)


def _stock(module):
    install_fast_paths(False)
    return (module.compute_text_seq_len_from_mask, module.apply_rotary_emb_qwen,
            module.QwenEmbedRope.forward)


def test_text_lengths_equal_diffusers(module):
    """Lengths, dtype and bool mask as diffusers' (rows with no active token; no mask); a mask
    of the wrong shape refused."""
    stock = _stock(module)[0]
    assert stock is not text_seq_len_from_mask
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        hidden = torch.randn(4, 9, 3, generator=gen)
        mask = (torch.rand(4, 9, generator=gen) > 0.6).long()
        mask[trial % 4] = 0  # a row with no active token: the full length
        want, got = stock(hidden, mask), text_seq_len_from_mask(hidden, mask)
        assert got[0] == want[0] and got[1].dtype == want[1].dtype
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert text_seq_len_from_mask(hidden, None) == stock(hidden, None) == (9, None, None)
    with pytest.raises(ValueError, match="must match"):
        text_seq_len_from_mask(hidden, mask[:, :5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_rotation_is_the_complex_rotation_bit_for_bit(module, dtype):
    """Forward and backward, from complex frequencies or their (cos, sin) view; the real
    convention (use_real=True) is diffusers' own."""
    stock = _stock(module)[1]
    gen = torch.Generator().manual_seed(1)
    freqs = torch.polar(torch.ones(11, 16), 40 * torch.randn(11, 16, generator=gen))
    x = torch.randn(3, 11, 2, 32, generator=gen).to(dtype)
    grad = torch.randn(3, 11, 2, 32, generator=gen).to(dtype)
    want_x = x.clone().requires_grad_(True)
    want = stock(want_x, freqs, use_real=False)
    want.backward(grad)
    for f in (freqs, torch.view_as_real(freqs)):
        got_x = x.clone().requires_grad_(True)
        got = rotate_real(got_x, f, use_real=False)
        got.backward(grad)
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert torch.equal(got_x.grad, want_x.grad)
    install_fast_paths(True)
    cos_sin = (freqs.real.repeat_interleave(2, -1), freqs.imag.repeat_interleave(2, -1))
    heads_first = x.transpose(1, 2)  # the real convention's [B, H, S, D]
    assert torch.equal(rotate_real(heads_first, cos_sin, use_real=True),
                       stock(heads_first, cos_sin, use_real=True))


def _transformer_inputs(model, gen):
    cfg = model.config
    batch, text, side = 2, 5, 4
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1, 3:] = 0
    return dict(hidden_states=torch.randn(batch, side * side, cfg.in_channels, generator=gen),
                timestep=torch.rand(batch, generator=gen),
                encoder_hidden_states=torch.randn(batch, text, cfg.joint_attention_dim,
                                                  generator=gen),
                encoder_hidden_states_mask=mask, img_shapes=[[(1, side, side)]] * batch,
                return_dict=False)


def test_the_transformer_computes_what_stock_diffusers_computes(module, tiny_model_dir):
    """The tiny Qwen-Image transformer loaded through the adapter: output and every weight's
    gradient equal with the fast paths and with diffusers' own code."""
    model = QwenImageAdapter(str(tiny_model_dir("qwen_image"))).load_train_model()
    model.requires_grad_(True)
    assert module.apply_rotary_emb_qwen is rotate_real  # loading installs them
    inputs = _transformer_inputs(model, torch.Generator().manual_seed(2))

    def forward_backward():
        model.zero_grad(set_to_none=True)
        out = model(**inputs)[0]
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert "transformer_blocks.0.attn.to_q.weight" in grads
        return out.detach(), grads

    fast_out, fast_grads = forward_backward()
    _stock(module)
    stock_out, stock_grads = forward_backward()
    assert torch.equal(fast_out, stock_out)
    assert fast_grads.keys() == stock_grads.keys()
    assert all(torch.equal(fast_grads[n], stock_grads[n]) for n in fast_grads)


def _graph_dtypes(block, inputs) -> set[torch.dtype]:
    """Every tensor dtype in the graph TorchDynamo captures from the block's forward."""
    seen: set[torch.dtype] = set()

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                seen.add(value.dtype)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(block.forward, backend=record, fullgraph=True)(**inputs)
    torch._dynamo.reset()
    return seen


def test_no_complex_tensor_enters_a_compiled_block(module, tiny_model_dir):
    """What the compiled block sees: no complex tensor with the fast paths (TorchInductor
    generates no code for complex operators); diffusers' own code does pass them (control)."""
    model = QwenImageAdapter(str(tiny_model_dir("qwen_image"))).load_train_model()
    block = model.transformer_blocks[0]
    captured = {}

    def capture(_, args, kwargs):
        captured["inputs"] = kwargs

    def graph_dtypes():
        handle = block.register_forward_pre_hook(capture, with_kwargs=True)
        with torch.no_grad():
            model(**_transformer_inputs(model, torch.Generator().manual_seed(3)))
        handle.remove()
        return _graph_dtypes(block, captured["inputs"])

    fast = graph_dtypes()
    assert torch.float32 in fast and not any(d.is_complex for d in fast)
    _stock(module)
    assert any(d.is_complex for d in graph_dtypes())


def test_install_and_uninstall_switch_all_three(module):
    stock = _stock(module)
    install_fast_paths(True)
    assert (module.compute_text_seq_len_from_mask, module.apply_rotary_emb_qwen) == (
        text_seq_len_from_mask, rotate_real)
    assert module.QwenEmbedRope.forward is not stock[2]
    install_fast_paths(False)
    assert (module.compute_text_seq_len_from_mask, module.apply_rotary_emb_qwen,
            module.QwenEmbedRope.forward) == stock
