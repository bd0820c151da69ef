"""FSDP2's one-rank gradient copy-in (trainer/patches/fsdp_grad_copy_in.py) gives torch's bytes."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

from dist_fixtures import count_calls, one_rank_group
from trainer.patches import fsdp_grad_copy_in as grad_copy_in


def _grads(dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(7, 5), (11,), (3, 4, 2), (6, 1)]
    grads = [torch.randn(s, generator=g, device=device).to(dtype) for s in shapes]
    grads[2] = grads[2].transpose(0, 2)  # a non-contiguous gradient is copied by its values
    return grads


def _chunk_cat(tensors, num_chunks, device="cpu"):
    """torch's copy-in: dim 0 padded to ``num_chunks``, chunked, concatenated per chunk."""
    padded = sum(-(-t.shape[0] // num_chunks) * num_chunks * math.prod(t.shape[1:])
                 for t in tensors)
    out = torch.full((num_chunks, padded // num_chunks), float("nan"), device=device)
    torch._chunk_cat(tensors, 0, num_chunks, out=out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_is_each_gradient_flattened_end_to_end(dtype):
    grads = _grads(dtype)
    want = _chunk_cat(grads, 1)
    got = torch.full_like(want, float("nan"))
    assert grad_copy_in.flat_copy_in(grads, got)
    assert torch.equal(got, want)
    assert torch.equal(got.view(-1)[:35], grads[0].float().flatten())


def test_a_buffer_of_another_size_is_left_alone():
    grads = _grads(torch.float32)
    for out in (torch.zeros(60), torch.zeros(120)[::2]):  # too large; not contiguous
        assert not grad_copy_in.flat_copy_in(grads, out)
        assert not out.any()


def test_the_wrapper_copies_one_rank_flat_and_leaves_more_ranks_to_torch():
    assert grad_copy_in.install() and grad_copy_in.install()  # once per process
    assert grad_copy_in.installed()
    copy_in = _fsdp_collectives.foreach_reduce_scatter_copy_in
    grads = [torch.randn(5, 3), torch.randn(4), torch.randn(3, 2)]  # dim 0 padded to even
    for world in (1, 2):
        want = _chunk_cat(grads, world)
        got = torch.full((want.numel(),), float("nan"))
        copy_in(list(grads), got, world)
        assert torch.equal(got.view(world, -1), want)


def test_a_one_rank_fsdp_backward_goes_through_the_flat_copy(tmp_path, monkeypatch):
    assert grad_copy_in.install()
    calls = count_calls(monkeypatch, grad_copy_in, "flat_copy_in")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    x = torch.randn(5, 8)
    want = torch.autograd.grad(_loss(model, x, reference), reference)
    with one_rank_group(tmp_path):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model[0], mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        _loss(model, x).backward()
        got = [p.grad.full_tensor().cpu() for p in model.parameters()]
    assert sorted(calls) == [2, 2]  # each unit's weight and bias, one copy-in each
    for g, w in zip(got, want):  # bf16 compute against the fp32 reference
        torch.testing.assert_close(g, w, atol=3e-2, rtol=3e-2)


def _loss(model, x, params=None):
    if params is None:
        return model(x).float().square().mean()
    h = torch.tanh(x @ params[0].T + params[1])
    return (h @ params[2].T + params[3]).square().mean()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_flat_copy_gives_chunk_cats_bytes(dtype):
    grads = _grads(dtype, "cuda") + [torch.randn(3072, 3072, device="cuda").to(dtype)]
    want = _chunk_cat(grads, 1, "cuda")
    got = torch.full_like(want, float("nan"))
    assert grad_copy_in.flat_copy_in(grads, got)
    assert torch.equal(got, want)
