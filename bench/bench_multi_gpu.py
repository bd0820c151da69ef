"""The recipes' step on 1..N GPUs through the real launcher, and a two-"node" dry run (issue:
multi-GPU run).

    python bench/bench_multi_gpu.py --out FILE [--gpus 1 2] [--modes lora full] [--layers 8]
    python bench/bench_multi_gpu.py --out FILE --tiny --device cpu --gpus 1 2   # CPU smoke

For every (mode, N): `python -m trainer launch --config qwen-image-t2i-{lora,full} --nproc N`
on the Qwen-shaped model of bench_step.py (real width, reduced depth, random weights), one
prompt x 8 candidates PER GPU (weak scaling: --rollout-batch-size N), 384², 12 steps, 3
trained SDE steps, JPEG reward, colocate offload off unless --offload. torchrun starts the
ranks; each rank spawns its own engine on its GPU (matched by device UUID) and syncs its own
engine through ipc/ after every step (FSDP2 all-gather, then the copy).

Read back from the run's metrics.jsonl (rank 0 writes the values all-reduced over ranks:
means, memory by MAX), the first rollout is warm-up: step time by stage, weight-sync seconds
and GB/s per GPU (gather + transport, each rank into its own engine), peak memory per GPU,
samples/s summed over GPUs, and the weak-scaling efficiency samples/s(N) / (N x samples/s(1)).

`--nnodes-dry-run`: the same launcher as two "nodes" on one host (`--nnodes 2 --node-rank
{0,1} --rdzv-endpoint 127.0.0.1:PORT`, one GPU each through CUDA_VISIBLE_DEVICES), 2 rollouts
of the LoRA recipe: both must exit 0 and rank 0 must log both steps with world 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.results import Recorder  # noqa: E402
from bench_step import prepare_work, step_overrides, summarize  # noqa: E402
from trainer.launch import free_port  # noqa: E402


def _launch_cmd(recipe: str, sets: list[str], extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "trainer", "launch", "--config", recipe, *extra]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "perf/step_time" in r]


def _env(visible: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def run_one(mode: str, gpus: int, model_dir: Path, args, work: Path) -> dict:
    run_dir = work / f"run_{mode}_{gpus}"
    recipe, sets = step_overrides(mode, model_dir, None, args, work, groups=gpus * args.groups,
                                  run_dir=run_dir)
    cmd = _launch_cmd(recipe, sets, ["--nproc", str(gpus),
                                     "--rdzv-endpoint", f"127.0.0.1:{free_port()}"])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=args.timeout)
    wall = time.perf_counter() - t0
    (Path(args.out).parent / f"{mode}_{gpus}.log").write_text(proc.stdout + proc.stderr)
    rows = _rows(run_dir)
    if proc.returncode != 0 or len(rows) < args.rollouts:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"mode": mode, "gpus": gpus, "ok": False, "rc": proc.returncode, "wall_s": wall,
                "log_tail": tail}
    out = summarize(mode, rows)
    out.update(gpus=gpus, ok=True, wall_s=wall,
               sync_gb_per_s=out["weight_sync_gb"] / out["weight_sync_s"])
    return out


def nnodes_dry_run(model_dir: Path, args, work: Path) -> dict:
    """Two launcher processes as node 0 and node 1 of one rendezvous, one GPU each."""
    run_dir = work / "run_nnodes"
    sub = argparse.Namespace(**{**vars(args), "rollouts": 2})
    recipe, sets = step_overrides("lora", model_dir, None, sub, work, groups=2, run_dir=run_dir)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = []
    for node in (0, 1):
        cmd = _launch_cmd(recipe, sets, ["--nproc", "1", "--nnodes", "2", "--node-rank",
                                         str(node), "--rdzv-endpoint", endpoint])
        visible = str(node) if args.device == "cuda" else None
        log = open(Path(args.out).parent / f"nnodes_node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=_env(visible), stdout=log,
                                       stderr=subprocess.STDOUT), log))
    rcs = []
    for proc, log in procs:
        try:
            rcs.append(proc.wait(timeout=args.timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            rcs.append(None)
        log.close()
    rows = _rows(run_dir)
    cfg_text = run_dir / "config.toml"
    return {"return_codes": rcs, "steps_logged": len(rows),
            "ok": rcs == [0, 0] and len(rows) == 2,
            "samples_per_s": [r.get("perf/samples_per_s") for r in rows],
            "config_written": cfg_text.exists()}


def weak_scaling(runs: list[dict], run: dict) -> float | None:
    """samples/s(N) / (N x samples/s(1)) against the same mode's one-GPU run, if it passed."""
    base = next((r for r in runs if r["mode"] == run["mode"] and r["gpus"] == 1 and r["ok"]), None)
    return run["samples_per_s"] / (run["gpus"] * base["samples_per_s"]) if base else None


def print_table(runs: list[dict], modes: list[str]) -> None:
    print("\n| mode | GPUs | step s | rollout s | train s | sync s (GB) | sync GB/s per GPU | "
          "peak GB per GPU | samples/s | weak-scaling eff. | outside |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        for r in runs:
            if r["mode"] != mode or not r["ok"]:
                continue
            st = r["stage_times"]
            eff = weak_scaling(runs, r)
            print(f"| {mode} | {r['gpus']} | {r['step_time']:.3f} | "
                  f"{st.get('perf/rollout_time', float('nan')):.3f} | "
                  f"{st.get('perf/train_time', float('nan')):.3f} | {r['weight_sync_s']:.4f} "
                  f"({r['weight_sync_gb']:.2f}) | {r['sync_gb_per_s']:.1f} | "
                  f"{r['peak_gb']:.1f} | {r['samples_per_s']:.2f} | "
                  f"{'-' if eff is None else f'{100 * eff:.1f} %'} | "
                  f"{100 * r['share_outside']:.1f} % |")
            print("  outside parts:", {k: round(v, 4) for k, v in r["outside_parts"].items()})
            print("  step times:", [round(t, 3) for t in r["step_times"]])


def record(results: dict, args) -> None:
    """Each passed run's figures as rows of bench/results.csv (bench/results.py)."""
    rec = Recorder("bench_multi_gpu", device=results["device"])
    for r in results["runs"]:
        if not r["ok"]:
            continue
        case = f"{'tiny-' if args.tiny else ''}qwen{args.layers}l-{r['mode']}-x{r['gpus']}"
        times = [t for t in r["step_times"] if t is not None]
        kept = times[1:] or times  # the first step is warm-up
        rec.add(case, "step_s", r["step_time"], "s", samples=kept)
        for metric, key in (("rollout_s", "perf/rollout_time"), ("train_s", "perf/train_time")):
            if key in r["stage_times"]:
                rec.add(case, metric, r["stage_times"][key], "s")
        rec.add(case, "weight_sync_s", r["weight_sync_s"], "s")
        rec.add(case, "sync_per_gpu", r["sync_gb_per_s"], "GB/s")
        rec.add(case, "peak_memory_per_gpu", r["peak_gb"], "GB")
        rec.add(case, "samples_per_s", r["samples_per_s"], "samples/s")
        rec.add(case, "outside_compute_share", 100 * r["share_outside"], "%")
        eff = weak_scaling(results["runs"], r)
        if eff is not None and r["gpus"] > 1:
            rec.add(case, "weak_scaling_efficiency", 100 * eff, "%")
    rec.write()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", default=["lora", "full"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rollouts", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--groups", type=int, default=1, help="prompts per GPU per step (x 8)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--offload", action="store_true", help="colocate offload on (default off)")
    p.add_argument("--nnodes-dry-run", action="store_true")
    p.add_argument("--skip-steps", action="store_true", help="only the --nnodes-dry-run")
    p.add_argument("--timeout", type=int, default=420, help="seconds per launch")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    args.no_offload = not args.offload
    work, model_dir = prepare_work("bench_multi_", args.layers, args.tiny)
    results: dict = {"runs": [], "nnodes": None, "device": (torch.cuda.get_device_name()
                                                            if args.device == "cuda" else "cpu")}
    if not args.skip_steps:
        for mode in args.modes:
            for n in args.gpus:
                r = run_one(mode, n, model_dir, args, work)
                results["runs"].append(r)
                print(f"[{mode} x{n}] ok={r['ok']} wall {r['wall_s']:.0f}s"
                      + ("" if r["ok"] else "\n" + r["log_tail"]), flush=True)
                Path(args.out).write_text(json.dumps(results, indent=2))
    if args.nnodes_dry_run:
        results["nnodes"] = nnodes_dry_run(model_dir, args, work)
        print("nnodes dry run:", results["nnodes"], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print_table(results["runs"], args.modes)
    record(results, args)
    ok = all(r["ok"] for r in results["runs"]) and (results["nnodes"] is None
                                                      or results["nnodes"]["ok"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
