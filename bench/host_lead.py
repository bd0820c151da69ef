"""How far the host runs ahead of the GPU in a traced train stage: the Chrome trace of
torch.profiler that ``bench/profile_train.py`` writes (``train.json.gz``; it also writes this
report beside it as ``host_lead.txt``).

    python bench/host_lead.py TRACE.json[.gz] [--window-ms 5]

Three tables:
- per time window: GPU busy share, the host's lead (for each kernel launched in the window,
  the time from its launch call to the kernel's start: near zero, the GPU ran each kernel as
  soon as the host asked, so the host set the pace) and the host's top-level ops;
- per compiled graph (``Torch-Compiled Region``): host time of a call, the launch calls inside
  it, and dynamo's guard evaluation before each call (``TorchDynamo Cache Lookup``);
- each update boundary, from FSDP2's post-backward callback to the next compiled call: its
  host time, the GPU idle time in it and the host's top-level ops there.

The profiler records every op, so the host times it shows are longer than an unprofiled run's.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

LAUNCHES = ("cuda_runtime", "cuda_driver")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_OPS = ("cpu_op", "user_annotation")


def top_level(ops: list[dict]) -> list[dict]:
    """The ops not nested inside an earlier one (``ops`` sorted by start)."""
    out, end = [], float("-inf")
    for e in ops:
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def _busy_per_window(gpu: list[dict], t0: float, window_us: float, n: int) -> list[float]:
    busy = [0.0] * n
    for k in gpu:
        start, stop = k["ts"] - t0, k["ts"] - t0 + k["dur"]
        for i in range(int(start // window_us), min(int(stop // window_us), n - 1) + 1):
            busy[i] += min(stop, (i + 1) * window_us) - max(start, i * window_us)
    return busy


def window_table(events: list[dict], gpu: list[dict], host: list[dict], t0: float,
                 window_us: float) -> list[str]:
    launch_at = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    n = int((max(k["ts"] + k["dur"] for k in gpu) - t0) // window_us) + 1
    busy = _busy_per_window(gpu, t0, window_us, n)
    leads: list[list[float]] = [[] for _ in range(n)]
    for k in gpu:
        launched = launch_at.get(k.get("args", {}).get("correlation"))
        if launched is not None and 0 <= int((launched - t0) // window_us) < n:
            leads[int((launched - t0) // window_us)].append(k["ts"] - launched)
    names = [collections.Counter() for _ in range(n)]
    for e in top_level([e for e in host if e.get("cat") == "cpu_op"]):
        if 0 <= int((e["ts"] - t0) // window_us) < n:
            names[int((e["ts"] - t0) // window_us)][e["name"][:40]] += e["dur"]
    lines = ["window | GPU busy | kernels launched | host lead median / min (ms) | "
             "host's top-level ops (ms)"]
    for i in range(n):
        lead = sorted(leads[i])
        shown = f"{lead[len(lead) // 2] / 1e3:5.2f} / {lead[0] / 1e3:5.2f}" if lead else "    -"
        ops = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in names[i].most_common(3))
        lines.append(f"{i * window_us / 1e3:6.0f} ms | {busy[i] / window_us * 100:5.1f} % | "
                     f"{len(lead):4d} | {shown} | {ops}")
    return lines


def compiled_calls(host: list[dict]) -> list[str]:
    starts = [e["ts"] for e in host]
    per_graph = collections.defaultdict(list)
    for r in (e for e in host if e["name"].startswith("Torch-Compiled Region")):
        inside = host[bisect.bisect_left(starts, r["ts"]):
                      bisect.bisect_right(starts, r["ts"] + r["dur"])]
        launches = [e for e in inside if e.get("cat") in LAUNCHES]
        per_graph[r["name"]].append((r["dur"], len(launches), sum(e["dur"] for e in launches)))
    lines = ["compiled graph | calls | host ms a call (median) | launch calls | "
             "ms inside those launch calls"]
    for name, calls in sorted(per_graph.items()):
        dur, count, api = sorted(calls)[len(calls) // 2]
        lines.append(f"{name} | {len(calls)} | {dur / 1e3:.2f} | {count} | {api / 1e3:.2f}")
    lookups = sorted(e["dur"] for e in host if e["name"] == "TorchDynamo Cache Lookup")
    if lookups:
        median, total = lookups[len(lookups) // 2] / 1e3, sum(lookups) / 1e3
        lines.append(f"guard evaluation (TorchDynamo Cache Lookup): {len(lookups)} calls, "
                     f"median {median:.3f} ms, {total:.1f} ms in all")
    return lines


def update_boundaries(gpu: list[dict], host: list[dict], t0: float) -> list[str]:
    ops = top_level([e for e in host if e.get("cat") in HOST_OPS])
    lines = []
    callbacks = [e for e in ops if e["name"] == "FSDP::root_post_backward_callback"]
    for k, cb in enumerate(callbacks):
        nxt = next((e for e in ops if e["ts"] > cb["ts"]
                    and e["name"].startswith("Torch-Compiled Region")), None)
        stop = nxt["ts"] if nxt else max(e["ts"] + e["dur"] for e in ops)
        busy = sum(min(g["ts"] + g["dur"], stop) - max(g["ts"], cb["ts"])
                   for g in gpu if g["ts"] < stop and g["ts"] + g["dur"] > cb["ts"])
        lines.append(f"update boundary {k + 1}: {(stop - cb['ts']) / 1e3:.1f} ms of host time, "
                     f"GPU idle {(stop - cb['ts'] - busy) / 1e3:.1f} ms of it; "
                     "top-level ops over 0.1 ms:")
        lines += [f"  {(e['ts'] - t0) / 1e3:7.2f} ms  {e['dur'] / 1e3:5.2f} ms  {e['name'][:60]}"
                  for e in ops if cb["ts"] <= e["ts"] < stop and e["dur"] > 100]
    return lines


def report(trace: dict, window_ms: float = 5.0) -> str:
    events = trace["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_WORK), key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("ph") == "X"
                   and e.get("cat") in HOST_OPS + LAUNCHES), key=lambda e: e["ts"])
    if not gpu or not host:
        return "no GPU work or no host ops in the trace"
    t0 = min(gpu[0]["ts"], host[0]["ts"])
    head = (f"trace: {(max(k['ts'] + k['dur'] for k in gpu) - t0) / 1e3:.1f} ms, "
            f"{len(gpu)} GPU events")
    return "\n".join([head, *window_table(events, gpu, host, t0, window_ms * 1e3), "",
                      *compiled_calls(host), "", *update_boundaries(gpu, host, t0)]) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--window-ms", type=float, default=5.0)
    args = p.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        print(report(json.load(f), args.window_ms), end="")


if __name__ == "__main__":
    main()
