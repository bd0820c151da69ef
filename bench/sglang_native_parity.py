"""SGLang's native pipeline against the trainer's replay, and the stock sync's hash rate, on a CPU
(CPU-only and needs sglang: not one of gpu.sh's bench_*.py scripts).

    python bench/sglang_native_parity.py [--family qwen_image] [--rollouts 3]

Serves a tiny model with SGLang's own native pipeline (tests/sglang_fixtures.py: its native DiT,
stages, updater and checker; fp32), samples ``--rollouts`` batches of 4 candidates through the
trainer's SGLang client, and replays each with the trainer's own diffusers transformer loaded
from the same checkpoint. Rows (bench/results.csv):

- ``logp_gap_max``: max |engine log-prob - replay log-prob| over every trained step, the
  cross-implementation gap (SGLang's native DiT vs diffusers, same weights, fp32);
- ``first_ratio_dev_max``: max |exp(replay - engine) - 1|, the first PPO ratio's distance from 1;
- ``sha256_gbps``: the host SHA-256 rate of this machine, what the stock path's verification
  pays per GB on each side (sender manifest, SGLang's checker). A sync of the tiny DiT itself is
  all per-request cost, so it gives no per-GB figure; the stock syncs here only check that the
  path runs (three verified syncs).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the native server lives with the tests


def _parity(server, rollouts: int) -> tuple[list[float], list[float]]:
    from trainer.actor.replay import replay_log_probs
    from trainer.engine.sglang.client import SGLangEngineClient

    adapter = server.adapter
    model = adapter.load_train_model().eval()
    client = SGLangEngineClient(server.url)
    sampling = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                "driver_sigmas": False, "driver_xt": False}
    gaps, ratios = [], []
    for r in range(rollouts):
        ids = [f"bench:{r}:{k}" for k in range(4)]
        request = adapter.build_rollout_request(["a red panda", "a teacup"] * 2, ids, sampling,
                                                rollout_id=r, seed=11, sde_indices=[1, 2])
        batch = adapter.pack_trajectory(client.generate(request), request)
        with torch.no_grad():
            replay = replay_log_probs(adapter, model, batch, backend="torch")
        diff = replay - batch.log_probs
        gaps.append(float(diff.abs().max()))
        ratios.append(float(diff.exp().sub(1).abs().max()))
    return gaps, ratios


def _stock_sync(server, repeats: int) -> None:
    from trainer.engine.sglang.client import SGLangEngineClient
    from trainer.engine.sglang.sync import SGLangWeightSync

    model = server.adapter.load_train_model()
    sender = SGLangWeightSync(SGLangEngineClient(server.url),
                              served_dit=server.adapter.sglang_dit)
    for version in range(1, repeats + 1):
        sender.sync(version, model.named_parameters())
        assert sender.client.committed_version == version


def _sha256_gbps(nbytes: int = 256 << 20, repeats: int = 3) -> list[float]:
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy().tobytes()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        rates.append(nbytes / 1e9 / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen_image")
    parser.add_argument("--rollouts", type=int, default=3)
    args = parser.parse_args()
    from bench.results import Recorder, device_name
    from sglang_fixtures import serve_sglang
    from tiny_models import build_tiny_model_dir

    torch.set_num_threads(1)
    rec = Recorder("sglang_native_parity", device=device_name("cpu"))
    case = f"{args.family}-tiny-fp32-32x32-4steps"
    with tempfile.TemporaryDirectory() as root:
        with serve_sglang(build_tiny_model_dir(args.family, root)) as server:
            gaps, ratios = _parity(server, args.rollouts)
            _stock_sync(server, 3)
    rec.add(case, "logp_gap_max", max(gaps), "nats", samples=gaps)
    rec.add(case, "first_ratio_dev_max", max(ratios), "ratio", samples=ratios)
    rates = _sha256_gbps()
    rec.add("host-sha256-256mb", "sha256_gbps", sorted(rates)[1], "GB/s", samples=rates)
    for row in rec.rows:
        print(f"{row['case']:40s} {row['metric']:22s} {row['value']} {row['unit']}")
    print("appended to", rec.write())


if __name__ == "__main__":
    main()
