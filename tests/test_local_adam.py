"""Adam / AdamW stepped on FSDP2's local shards equals ``optimizer.step()`` over the DTensor
parameters bit for bit (parameters and every state tensor), at world size 1 and 2 (gloo),
uneven shards included, with the optimizer's step hooks run once per step; Partial placements
and other optimizers keep the optimizer's own step."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_fixtures import one_rank_group, run_on_gloo_ranks
from trainer.actor.local_adam import _elementwise_safe, step_adam_on_local_shards

VARIANTS = {  # name: (optimizer class, kwargs, found_inf at step 2, tensor lr)
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), False, False),
    "adamw_fused_skip": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True),
                         True, True),
    "adamw_foreach_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, foreach=True),
                              False, False),
    "adam_l2_maximize": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, maximize=True),
                         False, False),
}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))  # 7 rows: uneven shards


def _state_values(optimizer) -> list[torch.Tensor]:
    out = []
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        for key in sorted(optimizer.state[p]):
            t = optimizer.state[p][key]
            out.append(t.full_tensor() if hasattr(t, "full_tensor") else t.clone())
    return out


def _run(variant: str, local: bool, device: str = "cpu") -> tuple[list[torch.Tensor],
                                                                  list[torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    cls, kwargs, skip_second, tensor_lr = VARIANTS[variant]
    model = fully_shard(_model(0).to(device))
    optimizer = cls(model.parameters(), **kwargs)
    hooks = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: hooks.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: hooks.append("post"))
    if local:  # the local path must not fall back to the DTensor step
        optimizer.step = lambda *a, **k: pytest.fail("DTensor step taken")
    gen = torch.Generator().manual_seed(dist.get_rank() + 5)
    for step in range(3):
        x = torch.randn(4, 6, generator=gen).to(device)
        model(x).square().mean().backward()
        if tensor_lr:
            for group in optimizer.param_groups:
                group["lr"] = torch.tensor(1e-2 / (step + 1), device=device)
        if skip_second:
            optimizer.found_inf = torch.tensor(float(step == 1), device=device)
        if local:
            step_adam_on_local_shards(optimizer)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert hooks == ["pre", "post"] * 3  # the step hooks run once per step on either path
    weights = [p.full_tensor() for p in model.parameters()]
    return weights, _state_values(optimizer)


def _compare_all_variants(device: str = "cpu") -> None:
    for variant in VARIANTS:
        (w_ref, s_ref), (w_loc, s_loc) = _run(variant, False, device), _run(variant, True, device)
        assert len(s_ref) == len(s_loc) > 0, variant
        for a, b in zip(w_ref + s_ref, w_loc + s_loc):
            assert torch.equal(a, b), variant
        assert not torch.equal(w_ref[0].cpu(), _model(0)[0].weight.detach()), variant  # trained


def test_local_shard_step_equals_the_dtensor_step_world_one(tmp_path):
    with one_rank_group(tmp_path):
        _compare_all_variants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_local_shard_step_equals_the_dtensor_step_on_cuda(tmp_path):
    """The CUDA kernels the trainer runs (fused and foreach AdamW among them), nccl world 1."""
    with one_rank_group(tmp_path, "nccl"):
        _compare_all_variants("cuda")


@pytest.mark.multiproc
def test_local_shard_step_equals_the_dtensor_step_two_ranks():
    run_on_gloo_ranks(_compare_all_variants)


def test_partial_placements_and_other_optimizers_take_their_own_step(tmp_path, monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    with one_rank_group(tmp_path):
        mesh = init_device_mesh("cpu", (1,))
        assert _elementwise_safe([DTensor.from_local(torch.ones(2), mesh, [Shard(0)])])
        assert not _elementwise_safe([DTensor.from_local(torch.ones(2), mesh, [Partial()])])
        own_steps = []
        p = nn.Parameter(torch.ones(3))
        p.grad = torch.ones(3)
        sgd = torch.optim.SGD([p], lr=0.5)
        monkeypatch.setattr(sgd, "step", lambda: own_steps.append("sgd"))
        step_adam_on_local_shards(sgd)
        partial = nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Shard(0)]))
        partial.grad = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        adam = torch.optim.Adam([partial], lr=0.5)
        monkeypatch.setattr(adam, "step", lambda: own_steps.append("adam"))
        step_adam_on_local_shards(adam)
        assert own_steps == ["sgd", "adam"]
