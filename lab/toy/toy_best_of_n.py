"""Does the toy model learn a reward component from its own best samples? Best-of-N fine-tuning.

    python lab/toy/toy_best_of_n.py --select count [--rounds 5] [--groups 192] [--out FILE.json]

The most direct supervised use of the signal a group-relative policy gradient sees: each round
samples ``--groups`` train prompts x ``--k`` images from the current model, keeps each group's
best image by one reward component (``--select``; ``random`` keeps any one, the control for
what training on its own images does to the model), fine-tunes the transformer on the kept
(prompt, image) pairs with the pretraining's rectified-flow loss (AdamW, ``--steps`` batches of
``--batch``), then evaluates every component on held-out prompts (the recipe's ODE eval).
A component that rises here against the control can be learnt from the model's own samples;
one that does not is limited by the model, whatever the estimator. Rows go to the benchmark
results (``eval_<component>_round_<r>``, case ``toy-best-of-<k>-<select>``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: trainer, bench

from bench.results import Recorder  # noqa: E402
from toy_diagnostics import print_and_save  # noqa: E402
from trainer.toy import world  # noqa: E402
from trainer.toy.adapter import ToyAdapter  # noqa: E402
from trainer.toy.evaluate import sample_images  # noqa: E402
from trainer.toy.pretrain import flow_matching_loss  # noqa: E402
from trainer.toy.reward import ToyCompositionScorer  # noqa: E402

SELECTS = ("color", "count", "position", "random")


def evaluate(adapter, transformer, frozen, records) -> dict[str, float]:
    transformer.eval()
    images = sample_images(adapter, transformer, frozen, [r["prompt"] for r in records],
                           [r["metadata"]["sample_id"] for r in records], num_steps=10, seed=0)
    scores = ToyCompositionScorer().score(images, [r["prompt"] for r in records],
                                          [r["metadata"] for r in records])
    return {k: round(float(v.mean()), 4) for k, v in scores.items()}


def best_of_groups(scores: dict[str, torch.Tensor], select: str, groups: int, k: int,
                   gen: torch.Generator) -> list[int]:
    """One row per group: the best by ``select`` (ties broken at random), or a random one."""
    keep = []
    for g in range(groups):
        if select == "random":
            keep.append(g * k + int(torch.randint(k, (1,), generator=gen)))
            continue
        values = scores[select][g * k:(g + 1) * k].float()
        keep.append(g * k + int(torch.argmax(values + 1e-6 * torch.rand(k, generator=gen))))
    return keep


def sample_round(adapter, transformer, frozen, args, rnd: int):
    """(images, prompts, metadata, scores) of one round's groups, ODE from distinct x_T."""
    records = world.make_prompt_records(args.groups, seed=100 + rnd, split="train")
    prompts = [r["prompt"] for r in records for _ in range(args.k)]
    metas = [r["metadata"] for r in records for _ in range(args.k)]
    ids = [f"{r['metadata']['sample_id']}#{j}" for r in records for j in range(args.k)]
    transformer.eval()
    images = sample_images(adapter, transformer, frozen, prompts, ids, num_steps=10, seed=rnd)
    return images, prompts, ToyCompositionScorer().score(images, prompts, metas)


def fine_tune(transformer, frozen, optimizer, images, prompts, args, gen) -> float:
    x0 = images.permute(0, 3, 1, 2).float() / 127.5 - 1
    transformer.train()
    for _ in range(args.steps):
        idx = torch.randint(len(prompts), (args.batch,), generator=gen)
        loss = flow_matching_loss(transformer, frozen["text_encoder"], frozen["tokenizer"],
                                  [prompts[i] for i in idx], x0[idx], gen, "logit_normal")
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
    return float(loss)


def run(args) -> dict:
    torch.set_num_threads(1)
    adapter = ToyAdapter(args.model)
    transformer = adapter.load_train_model(device="cpu")
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.lr, weight_decay=0.0)
    eval_records = world.make_prompt_records(args.eval_prompts, seed=0, split="eval")
    gen = torch.Generator().manual_seed(1)
    rounds = [{"round": 0, "eval": evaluate(adapter, transformer, frozen, eval_records)}]
    for rnd in range(1, args.rounds + 1):
        t0 = time.perf_counter()
        images, prompts, scores = sample_round(adapter, transformer, frozen, args, rnd)
        keep = best_of_groups(scores, args.select, args.groups, args.k, gen)
        loss = fine_tune(transformer, frozen, optimizer, images[keep], [prompts[i] for i in keep],
                         args, gen)
        rounds.append({"round": rnd, "eval": evaluate(adapter, transformer, frozen, eval_records),
                       "sampled": {c: round(float(v.float().mean()), 4) for c, v in scores.items()},
                       "kept": {c: round(float(v[keep].float().mean()), 4)
                                for c, v in scores.items()},
                       "last_loss": round(loss, 4), "seconds": round(time.perf_counter() - t0, 1)})
        print(rounds[-1], flush=True)
    return {"args": vars(args), "rounds": rounds}


def record(result: dict) -> None:
    args = result["args"]
    rec = Recorder("toy_best_of_n", device="cpu")
    case = f"toy-best-of-{args['k']}-{args['select']}"
    for r in result["rounds"]:
        for component, value in r["eval"].items():
            rec.add(case, f"eval_{component}_round_{r['round']}", value, "reward")
    rec.write()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--select", choices=SELECTS, required=True)
    p.add_argument("--model", default=None, help="toy model directory (default: the shipped one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--groups", type=int, default=192, help="train prompts per round")
    p.add_argument("--k", type=int, default=8, help="images per prompt")
    p.add_argument("--steps", type=int, default=12, help="fine-tuning batches per round")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--eval-prompts", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    problems = [f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
                for name in ("rounds", "groups", "k", "steps", "batch", "eval_prompts")
                if getattr(args, name) < 1]
    if problems:
        p.error("; ".join(problems))
    result = run(args)
    print_and_save(result, args.out)
    record(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
