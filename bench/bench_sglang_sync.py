"""Weight-sync cost per GB into SGLang, both paths, on the CPU (shared memory), with its verification.

    python bench/bench_sglang_sync.py                  # ~256 MB of DiT-shaped bf16 weights
    python bench/bench_sglang_sync.py --mb 64 --repeats 2 --no-record   # quick look

Paths:
- extension (trainer/engine/sglang/transport.py): ipc's WeightSender into a WeightReceiver in a
  spawned process, over /dev/shm, verify="full". Of each sync's own timings, ``copy`` is the
  write phase (the copy and the sender's checksum of what it wrote) and ``verify`` the commit
  phase (the receiver re-reads every synced byte for its checksum, compares, commits). On the
  CPU the checksums are numpy passes, not the GPU's fused copy kernel.
- stock (trainer/engine/sglang/sync.py): the transfer is SGLang's payload as the trainer makes
  it (``flattened_bucket`` + ``serialize_payload``: the tensors moved into shared memory and
  pickled with torch's reductions), read back with pickle and copied in place as SGLang's
  updater does (in this process: the server's unpickler and HTTP hop are not timed); ``hash`` is
  ``tensor_sha256`` of every tensor on one side (the checker hashes the same on the other), and
  ``hash_sampled`` what trainer/engine/sglang/verify.py's policy hashes in a sampled sync at its
  default budget at most (budget + 2 of Qwen-Image's largest tensors per side), beside the
  full hash, both projected onto Qwen-Image's 41 GB with this run's transfer rate.

Prints seconds per GB for each and appends rows to bench/results.csv (bench/results.py).
"""
from __future__ import annotations

import argparse
import base64
import multiprocessing as mp
import pickle
import sys
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import ipc  # noqa: E402
from bench.results import Recorder  # noqa: E402
from trainer.engine.sglang.sync import flattened_bucket, serialize_payload, tensor_sha256  # noqa: E402
from trainer.engine.sglang.verify import VerifyPolicy  # noqa: E402

GB = 1e9
QWEN_IMAGE_BYTES = 41e9


def dit_shaped(total_mb: int, seed: int) -> dict[str, torch.Tensor]:
    """bf16 matrices shaped like a scaled-down DiT block (square attention, 4x MLP) plus norms."""
    g = torch.Generator().manual_seed(seed)
    out, used, k, d = {}, 0, 0, 1536
    while used < total_mb * 1e6:
        for name, shape in ((f"b{k}.attn.to_q.weight", (d, d)), (f"b{k}.mlp.up.weight", (4 * d, d)),
                            (f"b{k}.norm.weight", (d,))):
            out[name] = torch.randn(shape, generator=g).to(torch.bfloat16)
            used += out[name].numel() * 2
        k += 1
    return out


def _receiver_host(conn, total_mb: int, verify: str, ready) -> None:
    torch.set_num_threads(1)
    r = ipc.WeightReceiver(conn, dit_shaped(total_mb, 0), verify=verify).start()
    ready.send("ok")
    ready.recv()  # until the bench is done
    r.close()


def extension_seconds(total_mb: int, verify: str, repeats: int
                      ) -> tuple[dict[str, list[float]], int]:
    ctx = mp.get_context("spawn")
    s_end, r_end = ipc.channel_pair()
    ready, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_host, args=(r_end, total_mb, verify, child), daemon=True)
    proc.start()
    r_end.close()
    ready.recv()
    sender = ipc.WeightSender(s_end, bucket_bytes=64 << 20, timeout_s=600.0)
    times, nbytes = {"sync": [], "write": [], "commit": []}, 0
    try:
        for v in range(1, repeats + 2):
            stats = sender.sync(v, dit_shaped(total_mb, v))
            nbytes = stats.bytes
            if v > 1:  # the first sync opens the memory; later ones are the steady state
                times["sync"].append(stats.seconds)
                times["write"].append(stats.timings["write"])
                times["commit"].append(stats.timings["commit"])
    finally:
        sender.close()
        ready.send("done")
        proc.join(30)
    return times, nbytes


def stock_seconds(tensors: dict[str, torch.Tensor], repeats: int) -> dict[str, list[float]]:
    targets = {n: torch.empty_like(t) for n, t in tensors.items()}
    out = {"transfer": [], "hash": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        payload = serialize_payload({"transformer": flattened_bucket(list(tensors.items()))})
        bucket = pickle.loads(base64.b64decode(payload))["transformer"]
        flat = bucket["flattened_tensor"]
        for meta in bucket["metadata"]:
            dst = targets[meta.name]
            dst.view(-1).view(torch.uint8).copy_(flat[meta.start_idx:meta.end_idx])
        out["transfer"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in tensors.values():
            tensor_sha256(t)
        out["hash"].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="model size in MB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-record", action="store_true", help="print only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rec = Recorder("bench_sglang_sync", device="cpu")
    rows = []

    def add(case, metric, samples, nbytes):
        per_gb = [s * GB / nbytes for s in samples]
        value = sorted(per_gb)[len(per_gb) // 2]
        rec.add(case, metric, value, "s/GB", samples=per_gb)
        rows.append((case, metric, value))
        return value

    ext, nbytes = extension_seconds(args.mb, "full", args.repeats)
    copy = add("extension-shm", "copy_s_per_gb", ext["write"], nbytes)
    verify = add("extension-shm", "verify_s_per_gb", ext["commit"], nbytes)
    total = add("extension-shm", "sync_verified_s_per_gb", ext["sync"], nbytes)

    tensors = dit_shaped(args.mb, 1)
    stock = stock_seconds(tensors, args.repeats)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    transfer = add("stock-shm", "transfer_s_per_gb", stock["transfer"], nbytes)
    hash_gb = add("stock-shm", "sha256_one_side_s_per_gb", stock["hash"], nbytes)
    budget = VerifyPolicy().budget_bytes
    # a sampled sync of a 41 GB model hashes the window (whole tensors: up to 2 more of the
    # largest, 75 MB in Qwen-Image's 60 blocks) on each side
    sampled_bytes = budget + 2 * 3072 * 12288 * 2
    for label, hashed in (("full", QWEN_IMAGE_BYTES), ("sampled", sampled_bytes)):
        seconds = transfer * QWEN_IMAGE_BYTES / GB + 2 * hash_gb * hashed / GB
        rec.add(f"stock-shm-qwen-image-41gb-verify={label}", "projected_sync_s", seconds, "s")
        rows.append((f"stock-shm-qwen-image-41gb-verify={label}", "projected_sync_s", seconds))
    rec.add("extension-shm-qwen-image-41gb", "projected_sync_s", total * QWEN_IMAGE_BYTES / GB, "s")
    rows.append(("extension-shm-qwen-image-41gb", "projected_sync_s", total * QWEN_IMAGE_BYTES / GB))

    print(f"{'case':45s} {'metric':28s} value")
    for case, metric, value in rows:
        print(f"{case:45s} {metric:28s} {value:.4g}")
    print(f"extension verify/copy = {verify / copy:.2f} (must be <= 1)")
    if not args.no_record:
        print("rows ->", rec.write())
    if verify > copy:
        sys.exit(1)


if __name__ == "__main__":
    main()
