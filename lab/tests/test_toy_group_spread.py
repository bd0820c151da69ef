"""lab/toy/toy_group_spread.py: the within-group spread arithmetic and one tiny real run."""
import json

import torch

import toy_group_spread


def test_spread_is_the_mean_within_group_std_per_component():
    scores = {"color": torch.tensor([1.0, 1.0, 0.0, 1.0]),     # group 0 flat, group 1 spread
              "count": torch.tensor([0.0, 1.0, 1.0, 0.0]),
              "position": torch.tensor([0.5, 0.5, 0.5, 0.5])}
    out = toy_group_spread.spread(scores, prompts=2, group=2)
    std = torch.tensor([0.0, 1.0]).std().item()               # one pair differing by 1
    assert abs(out["color"]["within_group_std"] - std / 2) < 1e-4
    assert out["color"]["groups_with_spread"] == 0.5
    assert abs(out["count"]["within_group_std"] - std) < 1e-4
    assert out["position"]["groups_with_spread"] == 0.0
    # group 1: count (1, 0) against colour + position (0.5, 1.5): perfectly anti-correlated;
    # group 0 has no spread in colour + position and is left out
    assert out["corr_count_vs_color_position"] == -1.0


def test_a_tiny_run_on_the_shipped_model_writes_every_component(tmp_path):
    out = tmp_path / "spread.json"
    assert toy_group_spread.main(["--prompts", "2", "--group", "2", "--shared-init",
                                  "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for name in ("color", "count", "position"):
        assert 0.0 <= result[name]["mean"] <= 1.0
        assert result[name]["within_group_std"] >= 0.0
    assert result["args"]["shared_init"] is True
