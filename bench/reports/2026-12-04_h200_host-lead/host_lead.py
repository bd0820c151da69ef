"""How far the host runs ahead of the GPU in one traced train stage (the Chrome trace that
``bench/profile_train.py`` writes as ``train.json.gz``).

    python host_lead.py train.json.gz [--window-ms 5]

Prints three tables:
- per time window: GPU busy share, the lead of the host (for each kernel launched in the
  window, the time from its launch call to the kernel's start; near zero means the GPU ran each
  kernel as soon as the host asked, i.e. the host set the pace) and the host's top-level ops;
- per compiled block call (``Torch-Compiled Region``): host time, launch calls inside it, and
  the guard evaluation before it (``TorchDynamo Cache Lookup``);
- the host's top-level ops between the last backward kernel of each update and the next
  forward (FSDP2's post-backward, the clip and optimizer step, the next pre-forward).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

LAUNCHES = ("cuda_runtime", "cuda_driver")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> tuple[list[dict], list[dict], list[dict], float]:
    events = json.load(gzip.open(path))["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_WORK), key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("ph") == "X"
                   and e.get("cat") in ("cpu_op", "user_annotation") + LAUNCHES),
                  key=lambda e: e["ts"])
    t0 = min(gpu[0]["ts"], host[0]["ts"])
    return events, gpu, host, t0


def top_level(ops: list[dict]) -> list[dict]:
    """Ops not nested inside an earlier op (``ops`` sorted by start)."""
    out, end = [], -1.0
    for e in ops:
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def windows(events, gpu, host, t0, window_us: float) -> None:
    launch_at = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    end = max(k["ts"] + k["dur"] for k in gpu)
    n = int((end - t0) // window_us) + 1
    busy, leads = [0.0] * n, [[] for _ in range(n)]
    names = [collections.Counter() for _ in range(n)]
    for k in gpu:
        start, stop = k["ts"] - t0, k["ts"] - t0 + k["dur"]
        for i in range(int(start // window_us), min(int(stop // window_us), n - 1) + 1):
            busy[i] += min(stop, (i + 1) * window_us) - max(start, i * window_us)
        launched = launch_at.get(k.get("args", {}).get("correlation"))
        if launched is not None:
            leads[int((launched - t0) // window_us)].append(k["ts"] - launched)
    for e in top_level([e for e in host if e.get("cat") == "cpu_op"]):
        i = int((e["ts"] - t0) // window_us)
        if i < n:
            names[i][e["name"][:40]] += e["dur"]
    print(f"window | GPU busy | kernels launched | host lead median / min (ms) | host's top-level ops (ms)")
    for i in range(n):
        lead = sorted(leads[i])
        median = f"{lead[len(lead) // 2] / 1e3:5.2f} / {lead[0] / 1e3:5.2f}" if lead else "  -"
        ops = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in names[i].most_common(3))
        print(f"{i * window_us / 1e3:6.0f} ms | {busy[i] / window_us * 100:5.1f} % | {len(lead):4d} | "
              f"{median} | {ops}")


def compiled_calls(host) -> None:
    starts = [e["ts"] for e in host]
    per_graph = collections.defaultdict(list)
    for r in (e for e in host if e["name"].startswith("Torch-Compiled Region")):
        i, j = bisect.bisect_left(starts, r["ts"]), bisect.bisect_right(starts, r["ts"] + r["dur"])
        launches = [e for e in host[i:j] if e.get("cat") in LAUNCHES]
        per_graph[r["name"]].append((r["dur"], len(launches), sum(e["dur"] for e in launches)))
    print("\ncompiled block call | calls | host ms (median) | launch calls | time in launch calls (ms)")
    for name, calls in sorted(per_graph.items()):
        calls.sort()
        dur, count, api = calls[len(calls) // 2]
        print(f"{name} | {len(calls)} | {dur / 1e3:.2f} | {count} | {api / 1e3:.2f}")
    lookups = sorted(e["dur"] for e in host if e["name"] == "TorchDynamo Cache Lookup")
    if lookups:
        print(f"guard evaluation (TorchDynamo Cache Lookup): {len(lookups)} calls, median "
              f"{lookups[len(lookups) // 2] / 1e3:.3f} ms, {sum(lookups) / 1e3:.1f} ms in all")


def update_boundaries(gpu, host, t0) -> None:
    """From each FSDP2 post-backward callback to the next compiled forward block."""
    ops = top_level([e for e in host if e.get("cat") in ("cpu_op", "user_annotation")])
    for k, cb in enumerate(e for e in ops if e["name"] == "FSDP::root_post_backward_callback"):
        nxt = next((e for e in ops if e["ts"] > cb["ts"]
                    and e["name"].startswith("Torch-Compiled Region")), ops[-1])
        stop = nxt["ts"]
        idle = stop - cb["ts"] - sum(min(g["ts"] + g["dur"], stop) - max(g["ts"], cb["ts"])
                                     for g in gpu if g["ts"] < stop and g["ts"] + g["dur"] > cb["ts"])
        print(f"\nupdate boundary {k + 1}: {(stop - cb['ts']) / 1e3:.1f} ms of host time, "
              f"GPU idle {idle / 1e3:.1f} ms of it; top-level ops over 0.1 ms:")
        for e in ops:
            if cb["ts"] <= e["ts"] < stop and e["dur"] > 100:
                print(f"  {(e['ts'] - t0) / 1e3:7.2f} ms  {e['dur'] / 1e3:5.2f} ms  {e['name'][:60]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--window-ms", type=float, default=5.0)
    args = p.parse_args(argv)
    events, gpu, host, t0 = load(args.trace)
    print(f"trace: {(max(k['ts'] + k['dur'] for k in gpu) - t0) / 1e3:.1f} ms, "
          f"{len(gpu)} GPU events")
    windows(events, gpu, host, t0, args.window_ms * 1e3)
    compiled_calls(host)
    update_boundaries(gpu, host, t0)


if __name__ == "__main__":
    main()
