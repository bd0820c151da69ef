"""How much each toy reward component varies inside a group: the signal GRPO can learn from.

    python lab/toy/toy_group_spread.py [--model DIR] [--prompts 96] [--group 8] [--eta 0.7]
                                       [--sde-steps 4 | --noisy-steps 0,2] [--shared-init]
                                       [--out FILE.json]

Samples ``--group`` images per train prompt the way the toy recipe's rollouts do (10 Euler
steps; the SDE with ``--eta`` at the first ``--sde-steps`` steps, sigma 1 clamped to the next
sigma; the rest ODE) and prints per component its mean, the mean within-group standard
deviation (what the group-normalised advantage sees), the share of groups with any spread and
the within-group correlation of count with colour + position. ``--shared-init`` gives every
sample of a group the same initial noise, so only the SDE steps' noise, which the policy
gradient can credit, makes the spread. ``--noisy-steps`` puts the SDE at the listed steps only
(which step's noise makes the spread).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from toy_diagnostics import print_and_save, sample_on_cpu
from trainer.toy import world
from trainer.toy.reward import ToyCompositionScorer


def spread(scores: dict[str, torch.Tensor], prompts: int, group: int) -> dict:
    out = {}
    for name, v in scores.items():
        v = v.view(prompts, group)
        out[name] = {"mean": round(float(v.mean()), 4),
                     "within_group_std": round(float(v.std(1).mean()), 4),
                     "groups_with_spread": round(float((v.std(1) > 1e-6).float().mean()), 4)}
    count = scores["count"].view(prompts, group).numpy()
    rest = (scores["color"] + scores["position"]).view(prompts, group).numpy()
    corr = [np.corrcoef(c, r)[0, 1] for c, r in zip(count, rest) if c.std() > 0 and r.std() > 0]
    out["corr_count_vs_color_position"] = round(float(np.mean(corr)), 4) if corr else None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="toy model directory (default: shipped)")
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--eta", type=float, default=0.7)
    p.add_argument("--sde-steps", type=int, default=4)
    p.add_argument("--noisy-steps", default=None,
                   help="comma-separated steps that get the SDE (instead of --sde-steps)")
    p.add_argument("--shared-init", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    records = world.make_prompt_records(args.prompts, seed=5, split="train")
    g = args.group
    prompts = [r["prompt"] for r in records for _ in range(g)]
    metadata = [r["metadata"] for r in records for _ in range(g)]
    ids = [f"{r['metadata']['sample_id']}_{j}" for r in records for j in range(g)]
    init_ids = [f"{r['metadata']['sample_id']}_0" for r in records for _ in range(g)] \
        if args.shared_init else ids
    steps = args.sde_steps if args.noisy_steps is None else \
        [int(k) for k in args.noisy_steps.split(",")]
    images = sample_on_cpu(args.model, prompts, ids, eta=args.eta, init_ids=init_ids,
                           sde_steps=steps, sigma_one="clamp_to_next")
    result = {"args": vars(args),
              **spread(ToyCompositionScorer().score(images, prompts, metadata), args.prompts, g)}
    print_and_save(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
