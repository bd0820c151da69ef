"""Learning curves of the toy task: recipe variants side by side, each in its own process.

    python bench/bench_toy_learning.py --rollouts 60 --eval-every 20 \\
        --variant base --variant "shared: rollout.sampling={\\"init_same_noise\\": true}" \\
        --out toy_curves.json

A variant is ``NAME`` or ``NAME: --set override; --set override; ...`` on top of the ``toy``
recipe (``--recipe``). Every variant runs the same loop as ``python -m trainer launch`` (one
rank) and evaluates the same held-out prompts with the same seeds at rollout 0 and every
``--eval-every`` rollouts, so the curves are paired: a difference between two evals of one run
is a change of the policy, not of the eval's noise. ``--noise-seeds`` also re-runs the first
eval under other generation seeds, which measures that noise (the spread of the eval at fixed
weights). Variants run ``--parallel`` at a time (one CPU thread each; on a GPU machine they
share the GPU). Results: one JSON object per variant (eval curve per component, the training
reward per rollout, seconds per rollout).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record_rows import record_toy


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition(":")
    overrides = [o.strip() for o in rest.split(";") if o.strip()]
    return name.strip(), overrides


def worker(args: argparse.Namespace) -> None:
    import torch

    from trainer.config import load_config
    from trainer.loop import Trainer

    torch.set_num_threads(1)
    name, overrides = parse_variant(args.worker)
    run_dir = Path(tempfile.mkdtemp(prefix=f"toycurve_{name}_"))
    cfg = load_config(args.recipe, [
        f"train.num_rollouts={args.rollouts}", f"data.eval_max_prompts={args.eval_prompts}",
        f"data.n_samples_per_eval_prompt={args.eval_samples}", f"logging.run_dir={run_dir}",
        "logging.progress=false", "logging.tensorboard=false", f"launch.device={args.device}",
        *overrides])
    trainer = Trainer(cfg, rank=0, world=1, device=args.device)
    out = {"name": name, "overrides": overrides, "device": args.device, "evals": [],
           "train_reward": [], "noise": []}

    def evaluate(rollout: int) -> None:
        m = trainer.evaluate(rollout, tag="curve")
        point = {"rollout": rollout, **{k[5:]: round(v, 5) for k, v in m.items()}}
        if args.paired_seeds and rollout > 0:  # the noise seeds again: a paired gain per seed
            point["noise_seeds"] = [round(v, 5) for v in trainer.eval_over_seeds(args.noise_seeds)]
        out["evals"].append(point)
        print(f"[{name}] eval@{rollout} {m['eval/reward_mean']:.4f}"
              + (f" seeds {point['noise_seeds']}" if "noise_seeds" in point else ""), flush=True)

    try:
        evaluate(0)
        out["noise"] = trainer.eval_over_seeds(args.noise_seeds)
        t0 = time.perf_counter()
        for rollout in range(args.rollouts):
            m = trainer.train_step(rollout)
            out["train_reward"].append(round(m["reward/mean"], 5))
            out.setdefault("train_components", []).append(
                {k[7:-5]: round(v, 4) for k, v in m.items()
                 if k.startswith("reward/") and k.endswith("_mean") and k != "reward/mean"})
            if (rollout + 1) % args.eval_every == 0 or rollout + 1 == args.rollouts:
                out["seconds_per_rollout"] = round((time.perf_counter() - t0) / (rollout + 1), 3)
                evaluate(rollout + 1)
                Path(args.out).write_text(json.dumps(out))
    finally:
        trainer.close()
    Path(args.out).write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="toy")
    ap.add_argument("--variant", action="append", default=[], help="NAME[: override; override ...]")
    ap.add_argument("--variants-file", help="one variant per line (# comments)")
    ap.add_argument("--rollouts", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--noise-seeds", type=int, nargs="*", default=[])
    ap.add_argument("--paired-seeds", action="store_true",
                    help="re-run every later eval under the noise seeds too (paired gains)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--out", default="toy_curves.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    variants = list(args.variant)
    if args.variants_file:
        variants += [line.strip() for line in Path(args.variants_file).read_text().splitlines()
                     if line.strip() and not line.lstrip().startswith("#")]
    variants = variants or ["base"]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    pending = list(enumerate(variants))
    running: list[tuple[subprocess.Popen, Path, str]] = []
    results = []
    root = str(Path(__file__).resolve().parents[1])  # the workers import trainer from here
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    while pending or running:
        while pending and len(running) < args.parallel:
            i, v = pending.pop(0)
            part = out_path.with_name(f"{out_path.stem}.part{i}.json")  # survives a kill
            part.unlink(missing_ok=True)  # never report an earlier run's curve
            cmd = [sys.executable, __file__, "--worker", v, "--out", str(part)]
            for flag in ("recipe", "rollouts", "eval_every", "eval_prompts", "eval_samples", "device"):
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            cmd += ["--noise-seeds", *map(str, args.noise_seeds)]
            cmd += ["--paired-seeds"] if args.paired_seeds else []
            running.append((subprocess.Popen(cmd, env=env), part, v))
        time.sleep(2)
        for entry in list(running):
            proc, part, v = entry
            if proc.poll() is not None:
                running.remove(entry)
                res = json.loads(part.read_text()) if part.exists() else {}
                res.setdefault("name", parse_variant(v)[0])  # a worker that died early wrote nothing
                res["returncode"] = proc.returncode
                results.append(res)
                Path(args.out).write_text(json.dumps(results, indent=1))
    for r in results:
        curve = " ".join(f"{e['rollout']}:{e['reward_mean']:.3f}" for e in r.get("evals", []))
        print(f"{r.get('name')}: rc={r['returncode']} {r.get('seconds_per_rollout')} s/rollout "
              f"noise={r.get('noise')} eval {curve}")
    record_toy(results, args)
    return max((abs(r["returncode"]) for r in results), default=0)


if __name__ == "__main__":
    raise SystemExit(main())
