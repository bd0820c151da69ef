"""bench/peer_step.py --strong (compiled blocks, batched trained steps, the best attention
kernel) computes the plain peer's loss and gradients: the same algorithm, only faster. CPU,
tiny Qwen-Image, fp32; the blocks compile with the aot_eager backend (torch.compile's graph
capture and autograd tracing without inductor's C++ build, which a 2-core CPU cannot afford in
a test; the GPU bench uses inductor)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_strong_peer_loss_and_gradients_equal_the_plain_peers_on_the_same_rollout(tmp_path):
    sys.path[:0] = [str(ROOT / "bench")]
    from peer_step import PeerLoop, best_attention_backend

    from tests.tiny_models import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir("qwen_image", tmp_path))
    geometry = dict(height=64, width=64, steps=4, sde_indices=(1, 2), rank=4, device="cpu",
                    dtype=torch.float32)
    loops = []
    for strong in (False, True):
        torch.manual_seed(0)  # the same LoRA init in both
        loop = PeerLoop(model_dir, strong=strong, compile_backend="aot_eager", **geometry)
        with torch.no_grad():  # B != 0, so the adapters shape the velocity and get gradients
            for name, p in loop.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        loops.append(loop)
    plain, strong = loops
    assert best_attention_backend("cpu") is None
    blocks = strong.adapter.transformer_blocks(strong.model)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    prompts = ["a red panda", "a teacup", "a red panda", "a teacup"]
    cond, xs, nexts, old, _ = plain.sample(prompts, seed=3)
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75])
    old = old - 1e-5  # ratios just off 1: some rows clipped, some not
    rows = torch.tensor([2, 0, 3, 1])
    losses = [loop.accumulate(cond, xs, nexts, old, adv, rows, micro_batch=2) for loop in loops]
    assert abs(losses[0] - losses[1]) <= 1e-6 * max(1.0, abs(losses[0]))
    # a parameter no path reaches: None eagerly, zeros from the compiled graph; the same
    grads = [{n: torch.zeros_like(p) if p.grad is None else p.grad
              for n, p in loop.model.named_parameters() if p.requires_grad} for loop in loops]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert any(g.abs().max() > 0 for g in grads[0].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-7)
