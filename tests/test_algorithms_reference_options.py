"""The reference's two behaviours offered as options: LoRA A drawn Gaussian (lora.init_a) and
the EMA stepped after every micro-batch (ema.per_micro_batch)."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from trainer.actor import update
from trainer.models.lora import apply_lora


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(64, 64)


@pytest.mark.parametrize("init_a", ["kaiming", "gaussian"])
def test_lora_a_init_follows_the_option_and_b_starts_at_zero(init_a):
    torch.manual_seed(0)
    model = apply_lora(Tiny(), rank=16, alpha=16, target_modules=["to_q"], init_a=init_a)
    a = next(p for n, p in model.named_parameters() if "lora_A" in n).detach()
    b = next(p for n, p in model.named_parameters() if "lora_B" in n).detach()
    assert torch.count_nonzero(b) == 0
    if init_a == "gaussian":   # peft's "gaussian": normal with std 1 / rank
        assert a.std().item() == pytest.approx(1 / 16, rel=0.1)
        assert a.abs().max().item() > 3 * a.std().item()   # unbounded tails: not a uniform
    else:                      # Kaiming-uniform (a=sqrt(5)): bounded by 1 / sqrt(fan_in)
        assert a.abs().max().item() <= 1 / 64 ** 0.5 + 1e-6
    with pytest.raises(ValueError, match="init_a"):
        apply_lora(Tiny(), rank=4, alpha=4, target_modules=["to_q"], init_a="xavier")


def _fake_actor(per_micro_batch: bool):
    """What run_updates reads of an Actor: its EMA (with its placement), step count, model."""
    calls = []
    actor = types.SimpleNamespace(
        ema=types.SimpleNamespace(step=calls.append, per_micro_batch=per_micro_batch),
        lr_steps=0, model=None, fsdp_cfg=None)
    return actor, calls


class _Steps:
    """An optimizer step that counts like optimizer_step and steps the EMA as it does."""

    def __init__(self, actor):
        self.actor = actor

    def step(self, params):
        self.actor.lr_steps += 1
        if not self.actor.ema.per_micro_batch:
            self.actor.ema.step(self.actor.lr_steps - 1)
        return torch.zeros(()), torch.zeros(())


@pytest.mark.parametrize("per_micro_batch", [False, True])
def test_ema_steps_after_every_micro_batch_with_the_optimizer_step_count(per_micro_batch,
                                                                          monkeypatch):
    monkeypatch.setattr(update, "accumulate_unsharded", lambda fsdp: False)
    monkeypatch.setattr(update, "forward_backward",
                        lambda *a: {"ratio_mean": torch.ones(()), "loss": torch.zeros(())})
    actor, calls = _fake_actor(per_micro_batch)
    selected = [[(None, None)] * 3, [(None, None)] * 3]  # 2 updates of 3 micro-batches
    scales = [[1.0] * 3] * 2
    pi_old = [[None] * 3] * 2
    update.run_updates(actor, selected, scales, pi_old, _Steps(actor), [])
    if per_micro_batch:  # the reference: ema.step(global_step) after each micro-batch
        assert calls == [0, 0, 1, 1, 1, 2]
    else:
        assert calls == [0, 1]
