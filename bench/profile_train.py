"""Where the train stage's time goes: torch.profiler over one train stage of the bench step,
beside the compiled floor it is judged against (GPU).

    python bench/profile_train.py --out DIR [--mode lora|full] [--model-dir D] [--set K=V ...]

Runs the bench step of ``bench_step.py`` (8-layer Qwen-Image-shaped model, micro-batch 4,
2 updates, no offload) for ``--rollouts`` steps and profiles the last step's train stage
(replay, loss, backward, optimizer; the rollout is not traced). Then profiles the bare
compiled forward + backward and the no-grad forward of the same model on one micro-batch of
rows (the floor, and what the pi_old anchor forward could cost at best).

Writes, per capture: ``<name>.txt`` (wall time, GPU span, GPU busy = union of kernel
intervals, the kernel table) and for the train stage ``gaps.txt`` (every GPU idle gap over
0.3 ms with the CPU ranges open at that moment), ``host_lead.txt`` (``bench/host_lead.py``:
how far the host runs ahead of the GPU, window by window) and ``train.json.gz`` (the Chrome
trace).
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_step  # noqa: E402
import floors  # noqa: E402
import host_lead  # noqa: E402
import trainer.actor.update as update_module  # noqa: E402
import trainer.loop as loop_module  # noqa: E402
from trainer.config import load_config  # noqa: E402

GAP_US = 300.0


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def gpu_summary(prof, name: str, wall_ms: float, out: Path) -> str:
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    span = max(e for _, e in spans) - min(s for s, _ in spans) if spans else 0.0
    head = (f"{name}: wall {wall_ms:.1f} ms, GPU span {span / 1e3:.1f} ms, GPU busy "
            f"{busy_us(spans) / 1e3:.1f} ms, {len(kernels)} kernels")
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40,
                                      max_name_column_width=90)
    (out / f"{name}.txt").write_text(head + "\n" + table)
    print(head, flush=True)
    return head


def idle_gaps(trace: dict) -> list[str]:
    """GPU idle gaps over GAP_US in a Chrome trace, each with the CPU ranges open then."""
    events = trace["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    cpu = [e for e in events if e.get("ph") == "X"
           and e.get("cat") in ("cpu_op", "user_annotation")]
    if not gpu:
        return []
    t0, end, gaps = gpu[0]["ts"], gpu[0]["ts"] + gpu[0]["dur"], []
    for k in gpu[1:]:
        gap = k["ts"] - end
        if gap > GAP_US:
            open_ranges = [e["name"][:60] for e in cpu
                           if e["ts"] <= end <= e["ts"] + e["dur"] and e["dur"] > gap / 2]
            gaps.append((end - t0, gap, k["name"][:40], open_ranges[:3]))
        end = max(end, k["ts"] + k["dur"])
    total = sum(g[1] for g in gaps)
    return [f"{len(gaps)} gaps over {GAP_US / 1e3} ms, {total / 1e3:.1f} ms in all"] + [
        f"{at / 1e3:8.1f} ms  idle {gap / 1e3:5.2f} ms  before {name!r}  cpu: {ranges}"
        for at, gap, name, ranges in gaps]


def profile_train_stage(args, out: Path) -> None:
    """The bench step for args.rollouts steps; the last step's train stage traced."""
    ns = argparse.Namespace(rollouts=args.rollouts, micro_batch="4", tiny=False,
                            no_offload=True, device="cuda", set=args.set, groups=1)
    work, model_dir = bench_step.prepare_work("profile_", 8, False, args.model_dir)
    args.model_dir = model_dir
    cfg = load_config(*bench_step.step_overrides(args.mode, model_dir, None, ns, work))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl", rank=0, world_size=1)
    trainer = loop_module.Trainer(cfg, rank=0, world=1, device=torch.device("cuda"))
    real_train_on, last = update_module.train_on, args.rollouts - 1

    def traced(tr, batch, advantages, rollout_id):
        if rollout_id != last:
            return real_train_on(tr, batch, advantages, rollout_id)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start.record()
            metrics = real_train_on(tr, batch, advantages, rollout_id)
            end.record()
            torch.cuda.synchronize()
        gpu_summary(prof, "train", start.elapsed_time(end), out)
        trace = out / "train.json"
        prof.export_chrome_trace(str(trace))
        traced_events = json.loads(trace.read_text())
        (out / "gaps.txt").write_text("\n".join(idle_gaps(traced_events)))
        (out / "host_lead.txt").write_text(host_lead.report(traced_events))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        return metrics

    update_module.train_on = traced  # the actor's update, which Actor.train_on calls
    try:
        for r in range(args.rollouts):
            m = trainer.train_step(r)
            print(f"step {r}: train {m['perf/train_time']:.4f} s", flush=True)
    finally:
        update_module.train_on = real_train_on
        trainer.close()
    del trainer
    gc.collect()
    torch.cuda.empty_cache()


def profile_floor(args, out: Path, rows: int, tokens: int) -> None:
    """The compiled fwd+bwd and no-grad forward of ``rows`` rows (bench/floors.py's model)."""
    rank = 64 if args.mode == "lora" else 0
    adapter, model = floors.lora_transformer(str(args.model_dir), rank, compiled=True)
    for name, forward_only in (("floor_fwd_bwd", False), ("floor_fwd", True)):
        fn = floors.floor_step(adapter, model, rows, tokens=tokens, forward_only=forward_only)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
        gpu_summary(prof, name, start.elapsed_time(end), out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=["lora", "full"], default="lora")
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    profile_train_stage(args, args.out)
    # one micro-batch of the bench step: 4 samples x 3 trained steps, the bench prompt's tokens
    profile_floor(args, args.out, rows=12, tokens=floors.text_tokens(str(args.model_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
