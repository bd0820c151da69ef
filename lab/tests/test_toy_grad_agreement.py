"""lab/toy/toy_grad_agreement.py: its cosine, and a run on the shipped toy model with two groups
(every component's figures present, cosines in [-1, 1], finite norms, bad --groups refused)."""
from __future__ import annotations

import math

import pytest
import torch

import toy_grad_agreement as tga


def test_cosine_matches_torch():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, generator=gen, dtype=torch.float64), torch.randn(50, generator=gen,
                                                                            dtype=torch.float64)
    want = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    assert tga.cosine(a, b) == pytest.approx(want, rel=1e-12)
    assert tga.cosine(a, 3 * a) == pytest.approx(1.0, rel=1e-12)


def test_agreement_on_two_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "agreement.json"
    assert tga.main(["--groups", "2", "--out", str(out)]) == 0
    import json
    result = json.loads(out.read_text())
    assert set(result["components"]) == {"color", "count", "position"}
    for figures in result["components"].values():
        assert -1.0 <= figures["split_half_cosine"] <= 1.0
        assert math.isfinite(figures["grad_norm"]) and figures["grad_norm"] >= 0.0
    assert set(result["cosine_between"]) == {"color/count", "color/position", "count/position"}
    assert all(-1.0 <= c <= 1.0 for c in result["cosine_between"].values())
    with pytest.raises(SystemExit):
        tga.main(["--groups", "3"])
