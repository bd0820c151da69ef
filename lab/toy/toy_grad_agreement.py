"""Does a toy reward component's policy gradient point the same way in two halves of a batch?

    python lab/toy/toy_grad_agreement.py [--groups 64] [--out FILE.json] [--set KEY=VALUE ...]

One rollout of the toy recipe (``--groups`` prompts x the recipe's group size, its sampler)
is scored; for each component alone, its group advantages are computed as the recipe
computes them and the gradient of the clipped policy loss at ratio 1 (the first update's
gradient, KL off) is taken over each half of the groups. Prints per component the cosine of
its two halves' gradients (split-half agreement: near 0 when a half-batch gradient is mostly
noise, near 1 when the signal dominates) and its full-batch gradient norm, and the cosines
between the components' full-batch gradients.
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from toy_diagnostics import print_and_save
from trainer.actor.micro_step import forward_backward
from trainer.config import load_config
from trainer.loop import Trainer
from trainer.rewards import compute_advantages


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-30))


def policy_gradient(trainer, batch, advantages: torch.Tensor, rows: torch.Tensor,
                    micro: int = 8) -> torch.Tensor:
    """Flattened gradient of the mean clipped loss over ``rows`` at ratio 1."""
    params = [p for g in trainer.actor.optimizer.param_groups for p in g["params"]]
    trainer.actor.optimizer.zero_grad(set_to_none=True)
    for chunk in rows.split(micro):
        forward_backward(trainer.actor, batch.select(chunk), advantages[chunk],
                         len(chunk) / len(rows), None)
    grad = torch.cat([p.grad.detach().flatten().double() for p in params])
    trainer.actor.optimizer.zero_grad(set_to_none=True)
    return grad


def agreement(trainer, groups: int) -> dict:
    batch = trainer.rollout(0)
    components, _ = trainer.reward.score(batch.images, batch.prompts, batch.metadata)
    r = trainer.cfg.reward
    half = batch.group_index < batch.group_index.unique().sort().values[groups // 2]
    halves = [torch.nonzero(half).flatten(), torch.nonzero(~half).flatten()]
    trainer.model.train()
    out, full = {"components": {}}, {}
    for name in components:
        adv, _, _ = compute_advantages(components, batch.group_index, weights={name: 1.0},
                                       required=[name], std_mode=r.std_mode, eps=r.adv_eps,
                                       clip_max=r.adv_clip_max,
                                       zero_degenerate_groups=r.zero_degenerate_groups)
        g1, g2 = (policy_gradient(trainer, batch, adv, rows) for rows in halves)
        full[name] = (g1 + g2) / 2
        out["components"][name] = {"split_half_cosine": round(cosine(g1, g2), 4),
                                   "grad_norm": float(full[name].norm()),
                                   "mean": round(float(components[name].float().mean()), 4)}
    names = list(full)
    out["cosine_between"] = {f"{a}/{b}": round(cosine(full[a], full[b]), 4)
                             for i, a in enumerate(names) for b in names[i + 1:]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=64, help="prompts in the rollout (even)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.groups < 2 or args.groups % 2:
        p.error(f"--groups must be an even number >= 2, got {args.groups}")
    run_dir = tempfile.mkdtemp(prefix="toy_grad_agreement_")
    cfg = load_config("toy", [f"rollout.rollout_batch_size={args.groups}", "train.kl_coef=0",
                              f"logging.run_dir={run_dir}", "logging.progress=false",
                              "logging.tensorboard=false", *args.set])
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        result = {"args": vars(args), **agreement(trainer, args.groups)}
    finally:
        trainer.close()
    print_and_save(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
