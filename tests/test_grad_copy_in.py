"""FSDP2's one-rank gradient copy-in (trainer/actor/grad_copy_in.py) gives torch's bytes."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.actor import grad_copy_in


def _grads(dtype: torch.dtype, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(7, 5), (11,), (3, 4, 2), (6, 1)]
    grads = [torch.randn(s, generator=g, device=device).to(dtype) for s in shapes]
    grads[2] = grads[2].transpose(0, 2)  # a non-contiguous gradient is copied by its values
    return grads


def _torch_copy_in(tensors, num_chunks, out_dtype, device="cpu"):
    padded = sum(-(-t.shape[0] // num_chunks) * num_chunks * math.prod(t.shape[1:])
                 for t in tensors)
    out = torch.full((num_chunks, padded // num_chunks), float("nan"), dtype=out_dtype,
                     device=device)
    torch._chunk_cat(tensors, 0, num_chunks, out=out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_chunk_is_each_gradient_flattened_end_to_end(dtype):
    grads = _grads(dtype)
    want = _torch_copy_in(grads, 1, torch.float32)
    got = torch.full_like(want, float("nan"))
    grad_copy_in.flat_copy_in(grads, 0, 1, got)
    assert torch.equal(got, want)
    assert torch.equal(got.view(-1)[:35], grads[0].float().flatten())


def test_other_chunk_counts_keep_torchs_kernel():
    grads = [torch.randn(5, 3), torch.randn(4), torch.randn(3, 2)]  # dim 0 padded to even
    want = _torch_copy_in(grads, 2, torch.float32)
    got = torch.full_like(want, float("nan"))
    grad_copy_in.flat_copy_in(grads, 0, 2, got)
    assert torch.equal(got, want)
    # a buffer of another size is torch's case too (it resizes the buffer), never a part copy
    want, got = torch.zeros(1, 10), torch.zeros(1, 10)
    torch._chunk_cat(grads, 0, 1, out=want)
    grad_copy_in.flat_copy_in(grads, 0, 1, got)
    assert got.shape == want.shape == (1, 25) and torch.equal(got, want)


def test_install_replaces_only_the_cuda_kernel():
    assert grad_copy_in.install() and grad_copy_in.install()  # once per process
    assert grad_copy_in.installed()
    dump = torch._C._dispatch_dump("fsdp::chunk_cat").splitlines()
    cuda = [line for line in dump if line.startswith("CUDA:")]
    cpu = [line for line in dump if line.startswith("CPU:")]
    assert len(cuda) == 1 and "grad_copy_in.py" in cuda[0]
    assert len(cpu) == 1 and "grad_copy_in.py" not in cpu[0]
    grads = _grads(torch.bfloat16)
    want = _torch_copy_in(grads, 1, torch.float32)
    got = torch.full_like(want, float("nan"))
    torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=1, out=got)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_op_gives_torchs_bytes(dtype):
    assert grad_copy_in.install()
    grads = _grads(dtype, "cuda") + [torch.randn(3072, 3072, device="cuda").to(dtype)]
    for chunks in (1, 2):
        want = _torch_copy_in(grads, chunks, torch.float32, "cuda")
        got = torch.full_like(want, float("nan"))
        torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=chunks, out=got)
        assert torch.equal(got, want)
