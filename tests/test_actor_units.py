"""Unit tests of the actor's pieces that need no engine: update planning, LR schedule,
LoRA merge for merge-mode sync, wrapper-name stripping, trainable boundary."""
import copy
import math

import pytest
import torch
from torch import nn

from trainer.actor.model import (apply_activation_checkpointing, assert_trainable_boundary,
                                 build_optimizer, lr_at_step, strip_wrapper_names)
from trainer.actor.replay import plan_updates
from trainer.actor.sync import merged_full_tensors, named_full_tensors
from trainer.config import load_config


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.ModuleDict({"to_q": nn.Linear(6, 6), "ff": nn.Linear(6, 6)}) for _ in range(2)])
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        for b in self.blocks:
            x = x + b["ff"](torch.tanh(b["to_q"](x)))
        return self.norm(x)


def test_plan_updates_disjoint_and_complete():
    plan = plan_updates(12, 3, 2, generator=torch.Generator().manual_seed(0))
    rows = torch.cat([r for u in plan.updates for r in u]).tolist()
    assert sorted(rows) == list(range(12))
    assert [sum(len(m) for m in u) for u in plan.updates] == [4, 4, 4]
    assert plan.num_micro_batches == 6


def test_plan_updates_reports_every_problem():
    with pytest.raises(ValueError) as e:
        plan_updates(10, 3, 4)
    assert "--num-updates-per-batch 3" in str(e.value)
    with pytest.raises(ValueError) as e:
        plan_updates(12, 2, 4)
    assert "--micro-batch-size 4" in str(e.value)


def test_lr_schedule_warmup_then_shapes():
    cfg = load_config(None, ["train.lr=1.0", "train.min_lr=0.1", "train.lr_warmup_iters=4",
                             "train.lr_decay_iters=10", "train.lr_scheduler=cosine"])
    assert [lr_at_step(s, cfg.train) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at_step(4, cfg.train) == pytest.approx(1.0)
    assert lr_at_step(9, cfg.train) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at_step(100, cfg.train) == pytest.approx(0.1)
    cfg.train.lr_scheduler = "linear"
    assert lr_at_step(9, cfg.train) == pytest.approx(0.1 + 0.9 * 0.5)
    cfg.train.lr_scheduler = "constant"
    assert lr_at_step(50, cfg.train) == 1.0


def test_adam_fused_is_the_same_maths():
    """--adam-fused selects torch's fused AdamW; it must train like the default one."""
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    runs = {"init": copy.deepcopy(Tiny().state_dict())}
    for fused in (False, True):
        cfg = load_config(None, ["train.lr=1e-2", "train.weight_decay=0.1",
                                 f"train.adam_fused={str(fused).lower()}"])
        model = Tiny()
        model.load_state_dict(runs["init"])
        opt = build_optimizer(model, cfg.train)
        assert opt.defaults["fused"] is (True if fused else None)
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs[fused] = model.state_dict()
    # the default (None) picks by device: foreach for CPU parameters
    assert build_optimizer(Tiny(), load_config(None, []).train).defaults["fused"] is None
    moved = [k for k in runs["init"] if not torch.equal(runs["init"][k], runs[False][k])]
    assert moved
    for k in runs[False]:
        torch.testing.assert_close(runs[True][k], runs[False][k], rtol=1e-5, atol=1e-6)


def test_merge_matches_peft_merge_and_unload():
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    base = Tiny()
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, lora_alpha=6,
                                                           target_modules=["to_q", "ff"]))
    for n, p in model.named_parameters():  # make B non-zero so the merge matters
        if "lora_B" in n:
            p.data.normal_()
    ours = dict(merged_full_tensors(model, scaling=6 / 2))
    ref = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(ours) == set(ref)
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-6, atol=1e-6)
    only = dict(named_full_tensors(model, only_lora=True))
    assert only and all("lora_" in k for k in only)


def test_activation_checkpoint_names_are_stripped():
    m = Tiny()
    names_before = [n for n, _ in m.named_parameters()]
    apply_activation_checkpointing(m, list(m.blocks))
    wrapped = [n for n, _ in m.named_parameters()]
    assert any("_checkpoint_wrapped_module" in n for n in wrapped)
    assert [strip_wrapper_names(n) for n in wrapped] == names_before
    assert [n for n, _ in named_full_tensors(m)] == names_before


def test_trainable_boundary():
    m = Tiny()
    assert_trainable_boundary(m, lora=False)
    m.norm.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="frozen in full mode"):
        assert_trainable_boundary(m, lora=False)
    with pytest.raises(RuntimeError, match="no lora_ parameters"):
        assert_trainable_boundary(m, lora=True)
