"""--lora-init-path: a PEFT directory and a diffusers LoRA file load into the run's LoRA exactly;
every mismatch (rank, alpha, missing or foreign tensors) is one error."""
from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from torch import nn

from trainer.lora_init import load_lora_init


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q, self.to_k, self.proj = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.proj(self.to_q(x) + self.to_k(x))


def _lora(rank=4, alpha=8, random=False, targets=("to_q", "to_k")):
    torch.manual_seed(0)
    base = Block()
    torch.manual_seed(1)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                     init_lora_weights=not random)
    model = get_peft_model(base, cfg)
    if random:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_()
    return model


def _same_lora(a, b):
    la = {n: p for n, p in a.named_parameters() if "lora_" in n}
    lb = {n: p for n, p in b.named_parameters() if "lora_" in n}
    assert la.keys() == lb.keys()
    return all(torch.equal(la[n], lb[n]) for n in la)


def test_peft_directory(tmp_path):
    trained = _lora(random=True)
    trained.save_pretrained(tmp_path / "peft")
    fresh = _lora()
    assert not _same_lora(trained, fresh)
    assert load_lora_init(fresh, tmp_path / "peft", rank=4, alpha=8) == 4
    assert _same_lora(trained, fresh)
    x = torch.randn(2, 6)
    torch.testing.assert_close(fresh(x), trained(x), rtol=0, atol=0)


@pytest.mark.parametrize("as_dir", [False, True])
def test_diffusers_file(tmp_path, as_dir):
    trained = _lora(random=True)
    state = {f"transformer.{k.removeprefix('base_model.model.')}": v.contiguous()
             for k, v in get_peft_model_state_dict(trained).items()}
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "pytorch_lora_weights.safetensors"
    save_file(state, str(path))
    fresh = _lora()
    load_lora_init(fresh, tmp_path / "d" if as_dir else path, rank=4, alpha=8)
    assert _same_lora(trained, fresh)


def test_mismatches_are_listed_together(tmp_path):
    _lora(rank=2, alpha=2, random=True).save_pretrained(tmp_path / "r2")
    with pytest.raises(ValueError) as info:
        load_lora_init(_lora(), tmp_path / "r2", rank=4, alpha=8)
    assert "r=2 != lora.rank=4" in str(info.value) and "lora_alpha=2" in str(info.value)
    # a rank-matching adapter on other modules: missing and foreign tensors, nothing copied
    other = _lora(random=True, targets=("to_q", "proj"))
    other.save_pretrained(tmp_path / "other")
    fresh = _lora()
    before = {n: p.clone() for n, p in fresh.named_parameters()}
    with pytest.raises(ValueError) as info:
        load_lora_init(fresh, tmp_path / "other", rank=4, alpha=8)
    text = str(info.value)
    assert "not in the file" in text and "to_k.lora_A.weight" in text
    assert "match no LoRA parameter" in text and "proj.lora_A.weight" in text
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())
    with pytest.raises(ValueError, match="does not exist"):
        load_lora_init(fresh, tmp_path / "nowhere.safetensors", rank=4, alpha=8)
    (tmp_path / "cfg_only").mkdir()
    (tmp_path / "cfg_only" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(ValueError, match="adapter_model.safetensors does not exist"):
        load_lora_init(fresh, tmp_path / "cfg_only", rank=4, alpha=8)
