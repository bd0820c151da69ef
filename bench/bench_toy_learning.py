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

Time to reward (``--stop-after-gain 0.10``): every eval point also carries the seconds the run
has spent in training alone (``train_s``) and in all (``wall_s``, from the worker's start: model
load and every eval included, as a user's run would spend them); a variant stops once its eval
mean of the components has risen by the gain over its rollout-0 eval and two more evals have
confirmed the curve after it. The results rows then carry, per variant and per algorithm over
its seeds (variants named ``ALGO_s0``, ``ALGO_s1``, ...), the rollouts and seconds to the gain
and each component's change there (record_rows.record_time_to_reward); a markdown table of
them is printed at the end. ``--record-from curves.json`` writes those rows again from a
finished (or killed: its ``.partN.json`` files) run without training.
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

from record_rows import record_time_to_reward, record_toy, time_to_gain, time_to_reward_table

# evals after the one that first reached --stop-after-gain before a variant stops: one more
# eval could be the noise's best draw; two show whether the curve holds
CONFIRMING_EVALS = 2


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition(":")
    overrides = [o.strip() for o in rest.split(";") if o.strip()]
    return name.strip(), overrides


def worker(args: argparse.Namespace) -> None:
    import torch

    from trainer.config import load_config
    from trainer.loop import Trainer

    started = time.perf_counter()
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

    train_s = 0.0

    def evaluate(rollout: int) -> None:
        m = trainer.evaluate(rollout, tag="curve")
        point = {"rollout": rollout, **{k[5:]: round(v, 5) for k, v in m.items()},
                 "train_s": round(train_s, 2), "wall_s": round(time.perf_counter() - started, 2)}
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
            step_start = time.perf_counter()
            m = trainer.train_step(rollout)
            train_s += time.perf_counter() - step_start
            out["train_reward"].append(round(m["reward/mean"], 5))
            out.setdefault("train_components", []).append(
                {k[7:-5]: round(v, 4) for k, v in m.items()
                 if k.startswith("reward/") and k.endswith("_mean") and k != "reward/mean"})
            if (rollout + 1) % args.eval_every == 0 or rollout + 1 == args.rollouts:
                out["seconds_per_rollout"] = round((time.perf_counter() - t0) / (rollout + 1), 3)
                evaluate(rollout + 1)
                Path(args.out).write_text(json.dumps(out))
                if args.stop_after_gain is not None and confirmed_gain(
                        out["evals"], args.stop_after_gain):
                    out["stopped_at"] = rollout + 1
                    print(f"[{name}] +{args.stop_after_gain} reached and confirmed: stopping",
                          flush=True)
                    break
    finally:
        trainer.close()
    Path(args.out).write_text(json.dumps(out))


def confirmed_gain(evals: list[dict], gain: float) -> bool:
    """Whether the eval mean has reached ``gain`` over the first eval and CONFIRMING_EVALS
    evals have been taken since it first did."""
    hit = time_to_gain(evals, gain)
    return hit is not None and sum(p["rollout"] > hit["rollout"] for p in evals) >= CONFIRMING_EVALS


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
    ap.add_argument("--stop-after-gain", type=float, default=None,
                    help="stop a variant once its eval mean has risen by this much over its "
                         "rollout-0 eval and two more evals followed; record the time to it")
    ap.add_argument("--record-from", metavar="CURVES_JSON",
                    help="write the results rows of a finished run's JSON (or, when it is "
                         "missing, of its .partN.json files) and exit; needs --stop-after-gain "
                         "for the time-to-reward rows")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.record_from:
        results = load_curves(Path(args.record_from))
        report(results, args)
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
            if args.stop_after_gain is not None:
                cmd += ["--stop-after-gain", str(args.stop_after_gain)]
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
    report(results, args)
    return max((abs(r["returncode"]) for r in results), default=0)


def report(results: list[dict], args: argparse.Namespace) -> None:
    for r in results:
        curve = " ".join(f"{e['rollout']}:{e['reward_mean']:.3f}" for e in r.get("evals", []))
        print(f"{r.get('name')}: rc={r.get('returncode')} {r.get('seconds_per_rollout')} "
              f"s/rollout noise={r.get('noise')} eval {curve}")
    record_toy(results, args)
    if args.stop_after_gain is not None:
        record_time_to_reward(results, args, args.stop_after_gain)
        print("\n".join(time_to_reward_table(results, args.stop_after_gain)))


def load_curves(path: Path) -> list[dict]:
    """A run's results: its JSON when the run finished, else what its workers left (a worker's
    .partN.json is rewritten at every eval, so a killed run keeps its curves so far)."""
    if path.exists():
        return json.loads(path.read_text())
    parts = sorted(path.parent.glob(f"{path.stem}.part*.json"))
    if not parts:
        raise SystemExit(f"--record-from: neither {path} nor {path.stem}.partN.json exists")
    # a part has no returncode: the worker was killed or still running; its evals stand
    return [{**json.loads(p.read_text()), "returncode": 0, "incomplete": True} for p in parts]


if __name__ == "__main__":
    raise SystemExit(main())
