"""FSDP2's one-rank unshard (trainer/patches/fsdp_one_rank_unshard.py): the same parameters, forwards
and gradients as torch's method, through one foreach copy per parameter group."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from dist_fixtures import count_calls, one_rank_group
from trainer.patches import fsdp_one_rank_unshard as one_rank_unshard

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture
def torch_method(monkeypatch):
    """torch's own wait_for_unshard, whether or not install() already replaced it; restored
    after the test."""
    one_rank_unshard.install()
    original = one_rank_unshard._torch_wait_for_unshard or FSDPParamGroup.wait_for_unshard
    monkeypatch.setattr(FSDPParamGroup, "wait_for_unshard", original)
    return original


def _model(device: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(),
                         nn.Linear(24, 5)).to(device)


def _train_twice(model: nn.Sequential, device: str) -> list[torch.Tensor]:
    """Forward, backward and an Adam step, then a second forward and backward (an unshard
    after the step's reshard): every output and gradient, as plain tensors."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[2], mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(1)).to(device)
    seen = []
    for _ in range(2):
        out = model(x)
        out.float().square().mean().backward()
        seen += [out.detach().float().cpu()]
        seen += [p.grad.full_tensor().cpu() for p in model.parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


def _compare_with_torch(tmp_path, monkeypatch, torch_method, device: str) -> None:
    for name in ("torch", "flat"):
        (tmp_path / name).mkdir()
    with one_rank_group(tmp_path / "torch"):
        want = _train_twice(_model(device), device)
    calls = count_calls(monkeypatch, one_rank_unshard, "flat_unshard_copy")
    monkeypatch.setattr(FSDPParamGroup, "wait_for_unshard", one_rank_unshard._wait_for_unshard)
    with one_rank_group(tmp_path / "flat"):
        got = _train_twice(_model(device), device)
    # per step: the inner unit (weight and bias) unshards for its forward and again for its
    # backward (resharded after forward, FSDP2's default below the root); the root (four
    # parameters) once, kept gathered through its backward
    assert sorted(calls) == [2, 2, 2, 2, 4, 4]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_flat_unshard_trains_as_torchs_bit_for_bit(tmp_path, monkeypatch, torch_method):
    _compare_with_torch(tmp_path, monkeypatch, torch_method, "cpu")


def test_install_recognises_this_torch_and_refuses_another_method(monkeypatch, torch_method):
    assert one_rank_unshard.source_fingerprint(inspect.getsource(torch_method)) \
        in one_rank_unshard._KNOWN_SOURCES
    assert one_rank_unshard.install() and one_rank_unshard.installed()

    def wait_for_unshard(self):  # a torch whose method changed
        return None

    monkeypatch.setattr(FSDPParamGroup, "wait_for_unshard", wait_for_unshard)
    assert not one_rank_unshard.install()
    assert FSDPParamGroup.wait_for_unshard is wait_for_unshard


def test_a_group_with_an_all_gather_hook_keeps_torchs_method(tmp_path, monkeypatch):
    """A parameter whose shard defines its own all-gather (a tensor subclass such as float8's)
    is not copied flat: its group's unshard is torch's method."""
    torch_calls = []
    monkeypatch.setattr(one_rank_unshard, "_torch_wait_for_unshard", torch_calls.append)
    with one_rank_group(tmp_path):
        model = _model("cpu")
        fully_shard(model)
        group = model._get_fsdp_state()._fsdp_param_group
        assert one_rank_unshard._flat_eligible(group)
        shard = group.fsdp_params[0]._sharded_local_tensor
        shard.fsdp_pre_all_gather = None
        group._all_gather_result = "gathered"
        try:
            assert not one_rank_unshard._flat_eligible(group)
            one_rank_unshard._wait_for_unshard(group)
        finally:
            del shard.fsdp_pre_all_gather
            group._all_gather_result = None
    assert torch_calls == [group]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_flat_unshard_trains_as_torchs_bit_for_bit(tmp_path, monkeypatch,
                                                               torch_method):
    _compare_with_torch(tmp_path, monkeypatch, torch_method, "cuda")
