"""trainer.ema (the reference's EMA schedule, float64 oracle; swap in/out; exact checkpoint
round trip; export of the EMA tensors) and trainer.evaluation (eval tables, EMA weights)."""
from __future__ import annotations


import pytest
import torch
from torch import nn

from trainer.config import load_config
from trainer.ema import ParameterEMA, ema_model_tensors
from trainer.evaluation import eval_sampling, eval_weights
from trainer.config.sampling import SamplingConfig


def _model(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)  # frozen: not averaged
    return model


def _set(model, value_fn):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if p.requires_grad:
                p.copy_(value_fn(i, p))


def test_schedule_is_the_references_in_float64():
    model = _model()
    ema = ParameterEMA(model, decay=0.9, update_interval=3)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    want = {n: p.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}
    for step in range(10):
        _set(model, lambda i, p: p + 0.1 * (i + 1) * (step + 1))
        moved = ema.step(step)
        assert moved == ((step + 1) % 3 == 0)
        if moved:
            d = min((1 + step) / (10 + step), 0.9)
            for n, p in model.named_parameters():
                if n in want:
                    want[n] = want[n] + (1 - d) * (p.detach().double() - want[n])
    assert ema.updates == 3 and set(ema.shadow) == set(names)
    for n in names:
        torch.testing.assert_close(ema.shadow[n].double(), want[n], rtol=1e-6, atol=1e-6)
    assert "1.bias" not in ema.shadow


def test_swapped_in_uses_the_average_and_restores_the_live_bits():
    model = _model()
    ema = ParameterEMA(model, decay=0.5, update_interval=1)
    _set(model, lambda i, p: p * 3.0 + 1.0)
    ema.step(20)
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped_in():
        for n, p in model.named_parameters():
            if n in ema.shadow:
                assert torch.equal(p.detach(), ema.shadow[n]) and not torch.equal(p, live[n])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), live[n])


def test_checkpoint_round_trip_is_exact_and_export_takes_the_average(tmp_path):
    model = _model()
    ema = ParameterEMA(model, decay=0.9, update_interval=2)
    for step in range(6):
        _set(model, lambda i, p: p + 0.01 * step)
        ema.step(step)
    ema.save(tmp_path / "iter" / "ema")
    other = ParameterEMA(_model(seed=1), decay=0.9, update_interval=2)
    other.load(tmp_path / "iter" / "ema")
    assert other.updates == ema.updates == 3
    for n, t in ema.shadow.items():
        assert torch.equal(other.shadow[n], t)
    tensors = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    exported = ema_model_tensors(tmp_path / "iter", tensors)
    assert torch.equal(exported["0.weight"], ema.shadow["0.weight"].to(torch.bfloat16))
    assert torch.equal(exported["1.bias"], tensors["1.bias"])  # frozen: the model's own
    with pytest.raises(FileNotFoundError, match="no EMA state"):
        ema_model_tensors(tmp_path / "elsewhere", tensors)


def test_eval_weights_syncs_the_average_then_the_live_weights():
    model = _model()
    ema = ParameterEMA(model, decay=0.5, update_interval=1)
    _set(model, lambda i, p: p + 1.0)
    ema.step(30)
    seen = []

    def sync():
        seen.append(model[0].weight.detach().clone())
        return {"ok": 1.0}
    with eval_weights(ema, True, sync):
        pass
    assert len(seen) == 2
    assert torch.equal(seen[0], ema.shadow["0.weight"]) and torch.equal(seen[1], model[0].weight)
    with eval_weights(ema, False, sync):
        pass
    assert len(seen) == 2  # no swap, no sync
    with eval_weights(None, True, sync):
        pass
    assert len(seen) == 2  # no EMA: nothing to swap in
    live = model[0].weight.detach().clone()
    # an engine without weight sync: refuse, restore the live weights
    with pytest.raises(RuntimeError, match="eval_use_ema"):
        with eval_weights(ema, True, lambda: {}):
            pass
    assert torch.equal(model[0].weight, live)


def test_eval_tables():
    ode = load_config("tiny", ["data.eval_mode=ode", "data.eval_num_inference_steps=40",
                               "data.eval_guidance_scale=4.5"])
    table = SamplingConfig.from_dict(eval_sampling(ode.data, ode.rollout.sampling))
    assert table.sde_step_mode == "ode" and table.num_inference_steps == 40
    assert table.guidance_scale == 4.5 and table.noise_steps(None) == []
    sde = load_config("tiny", ["data.eval_sde_indices=[2, 3]"])
    table = SamplingConfig.from_dict(eval_sampling(sde.data, sde.rollout.sampling))
    assert table.noise_steps(None) == [2, 3] and table.noise_steps(5) == [2, 3]  # never resampled
    default = load_config("tiny")
    table = SamplingConfig.from_dict(eval_sampling(default.data, default.rollout.sampling))
    assert table.noise_steps(4) == \
        SamplingConfig.from_dict(default.rollout.sampling).noise_steps(None)
