"""One FlowGRPO training step on a Qwen-Image-shaped model, single GPU (issue: trainer figures).

    python bench/bench_step.py --out FILE [--layers 8] [--modes lora full] [--rollouts 3]
    python bench/bench_step.py --out FILE --tiny --device cpu      # CPU smoke of this script

Builds a random-weight Qwen-Image-shaped model directory (QwenImageTransformer2DModel at the
real width: 24 heads x 128, joint_attention_dim 3584, in 64 / out 16 channels, reduced depth;
the default AutoencoderKLQwenImage; a one-layer Qwen2.5-VL text encoder at the real hidden
size) and a reward (JPEG compressibility on the CPU; `--reward-model`: a PickScore-shaped CLIP
ViT-H-14 with random weights, whose equal scores leave nothing to train), then runs the real
Trainer (engine process, colocated reward, FSDP2 world 1, weight sync through ipc/) for a few rollouts
of 1 prompt x 8 candidates at 384², 12 steps, 3 trained SDE steps.

Reported per mode (the last rollouts, the first is warm-up): step time by stage, peak memory,
samples/s, transitions/s, and the share of the step outside model compute: the Trainer's own
perf/outside_compute_share, where model compute is measured in place by CUDA events around
every transformer forward and backward (engine and replay), the text encoder, the VAE decode
and the reward model (trainer.profiling.ComputeMeter). An earlier version timed those pieces
in isolation after the run; on the H200 their sum exceeded the step itself (FSDP and autograd
costs the pipelined step hides), so the share could not be read from it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,  # noqa: E402
                       QwenImagePipeline, QwenImageTransformer2DModel)
from transformers import (AutoTokenizer, Qwen2_5_VLConfig,  # noqa: E402
                          Qwen2_5_VLForConditionalGeneration)

from bench_rewards import build_model_dir  # noqa: E402
from floors import (diffusers_images_per_s, pcie_gb_per_s, text_tokens,  # noqa: E402
                    train_floors)
from peer_step import run_peer  # noqa: E402
from record_rows import record_step  # noqa: E402
from tiny_models import write_qwen2_tokenizer  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.loop import Trainer  # noqa: E402


def build_qwen_shaped(out: Path, layers: int, tiny: bool) -> Path:
    vocab = write_qwen2_tokenizer(out / "_tok")
    tokenizer = AutoTokenizer.from_pretrained(out / "_tok")
    heads, head_dim, hidden = (2, 16, 32) if tiny else (24, 128, 3584)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=1, num_attention_heads=2 if tiny else 28,
                             num_key_value_heads=1 if tiny else 4, max_position_embeddings=1024,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                              "mrope_section": [2, 3, 3] if tiny else
                                              [16, 24, 24]},
                             bos_token_id=None, eos_token_id=2, pad_token_id=0),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                               out_hidden_size=hidden, fullatt_block_indexes=[0])))
        vae = (AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2],
                                      num_res_blocks=1, temperal_downsample=[False])
               if tiny else AutoencoderKLQwenImage())
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=64, out_channels=16, num_layers=layers,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=hidden,
            axes_dims_rope=(4, 6, 6) if tiny else (16, 56, 56))
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
        max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
        time_shift_type="exponential")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                             tokenizer=tokenizer, transformer=transformer)
    pipe.to(torch.bfloat16).save_pretrained(out)
    del pipe, text_encoder, vae, transformer
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def prepare_work(prefix: str, layers: int, tiny: bool,
                 model_dir: Path | None = None) -> tuple[Path, Path]:
    """(work dir, model dir): a temporary work dir holding prompts.jsonl (64 prompts) and the
    Qwen-shaped model directory (``model_dir``: built there once, reused when present)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    (work / "prompts.jsonl").write_text("\n".join(json.dumps(
        {"prompt": f"a photo of a red panda number {i} in a teacup",
         "metadata": {"sample_id": f"p{i}"}}) for i in range(64)))
    if model_dir is not None and (model_dir / "model_index.json").exists():
        return work, model_dir
    t0 = time.perf_counter()
    model_dir = build_qwen_shaped(model_dir or work / "qwen", layers, tiny)
    print(f"built models in {time.perf_counter() - t0:.1f}s", flush=True)
    return work, model_dir


def step_overrides(mode: str, model_dir: Path, reward_dir: Path | None, args, work: Path,
                   groups: int = 1, run_dir: Path | None = None) -> tuple[str, list[str]]:
    """(recipe, --set overrides) of the benchmarked step: ``groups`` prompts x
    ``args.candidates`` candidates (bench_multi_gpu.py passes one group per GPU), prompts from
    ``work``, the run in ``run_dir`` (default ``work/run_<mode>``), everything else as the
    docstring says."""
    lora = mode == "lora"
    n = getattr(args, "candidates", 8)
    run_dir = run_dir or work / f"run_{mode}"
    sets = [f"model.model_path={model_dir}", f"rollout.rollout_batch_size={groups}",
            f"rollout.n_samples_per_prompt={n}", f"rollout.global_batch_size={groups * n}",
            f"train.num_rollouts={args.rollouts}",
            "data.eval_prompt_data=none", f"data.prompt_data={work / 'prompts.jsonl'}",
            f"logging.run_dir={run_dir}", "rollout.write_artifacts=false",
            "logging.progress=false", "logging.tensorboard=false", "fsdp.load_wave_size=0",
            # no checkpoint: the end-of-run save of the full model takes tens of seconds
            # and is not part of a step
            "checkpoint.save=none", "checkpoint.save_interval=-1",
            f"train.micro_batch_size={args.micro_batch}", f"launch.device={args.device}"]
    if args.tiny:
        sets += ['rollout.sampling={"height": 64, "width": 64}']
    elif getattr(args, "resolution", None):
        side = int(args.resolution)
        sets += [f'rollout.sampling={{"height": {side}, "width": {side}}}']
    if reward_dir is None:
        sets += ["reward.runtime=cpu", "reward.scorer_path=trainer.rewards.jpeg."
                 "JpegCompressibilityScorer", "reward.required_components=[]", "reward.model_path=none",
                 "reward.component_weights={}"]
    else:
        sets += [f"reward.model_path={reward_dir}"]
    if args.no_offload:
        sets += ["rollout.offload_rollout=false", "fsdp.offload_train=false"]
    if args.device == "cpu":
        sets += ["rollout.engine_dtype=fp32", "weight_sync.wire_dtype=fp32",
                 "fsdp.param_dtype=fp32", "rollout.offload_rollout=false",
                 "fsdp.offload_train=false"]
    recipe = "qwen-image-t2i-lora" if lora else "qwen-image-t2i-full"
    return recipe, sets + list(args.set)


def run_mode(mode: str, model_dir: Path, reward_dir: Path | None, args, work: Path) -> dict:
    cfg = load_config(*step_overrides(mode, model_dir, reward_dir, args, work,
                                      groups=args.groups))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0,
                                world_size=1)
    device = torch.device(args.device)
    trainer = Trainer(cfg, rank=0, world=1, device=device)
    steps = []
    try:
        busy = []
        for r in range(args.rollouts):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with GpuBusySampler(device) as sampler:
                steps.append(trainer.train_step(r))
            busy.append(sampler.mean)
    finally:
        trainer.close()
    # without this the previous mode's actor (reference cycles) stays allocated through the
    # next mode and inflates its memory figures
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summarize(mode, steps, busy) | {"anchor": cfg.train.anchor}


def summarize(mode: str, steps: list[dict], busy: list | None = None) -> dict:
    """The figures of one mode from its per-step metrics (the first step is warm-up)."""
    busy = busy or [None]
    trained = all(s.get("train/optimizer_steps", 0.0) > 0 for s in steps)
    if not trained:
        print(f"WARNING [{mode}]: some steps did not train (degenerate rewards): their step "
              "times are not training-step figures", flush=True)
    keep = steps[1:] or steps
    # the median of the kept steps, per metric (= the mean for 2 steps): a shared host can
    # show single steps several times slower than the rest
    avg = {k: statistics.median(s.get(k, 0.0) for s in keep) for k in keep[-1]}
    compute = {k.removeprefix("perf/compute/"): v for k, v in avg.items()
               if k.startswith("perf/compute/")}
    compute_total = avg["perf/model_compute_time"]
    return {"mode": mode, "trained": trained,
            "step_times": [s.get("perf/step_time") for s in steps],
            # each step's stages and model parts, so a single slow step can be attributed
            "step_parts": [{k.removeprefix("perf/"): round(v, 4) for k, v in s.items()
                            if k.startswith("perf/compute/") or (k.startswith("perf/")
                                                                and k.endswith("_time"))}
                           for s in steps],
            "stage_times": {k: v for k, v in avg.items() if k.startswith("perf/")
                            and not k.startswith("perf/compute/")},
            "step_time": avg["perf/step_time"], "samples_per_s": avg["perf/samples_per_s"],
            "transitions_per_s": avg["perf/train_transitions_per_s"],
            "peak_gb": avg.get("perf/mem_peak_gb", float("nan")),
            "weight_sync_s": avg.get("weight_sync/seconds", float("nan")),
            "weight_sync_gb": avg.get("train/weight_sync_gb", float("nan")),
            "compute": compute, "compute_total": compute_total,
            # named outside parts: optimizer (clip + step, GPU span) and the sync's phases
            "outside_parts": {k: v for k, v in avg.items() if k.startswith("perf/outside/")
                              or (k.startswith("weight_sync/") and k.endswith("_s")
                                  and k != "weight_sync/gb_per_s")},
            "share_outside": avg["perf/outside_compute_share"],
            "first_update_ratio": steps[-1].get("train/first_update_ratio_mean"),
            "micro_batch": steps[-1].get("train/micro_batch_size"),
            "updates": steps[-1].get("train/optimizer_steps"),
            "recompiles": [s.get("perf/recompiles") for s in steps],
            "train_ms_per_transition": 1000.0 / avg["perf/train_transitions_per_s"],
            "logp_parity": steps[-1].get("train/logp_parity"),
            # NVML's utilization: share of time at least one kernel ran on the device, from
            # any process (engine included), polled through the step; None if NVML is absent
            "gpu_busy_nvml": (sum(busy[1:] or busy) / len(busy[1:] or busy)
                              if all(b is not None for b in busy) else None)}


_POLL_NVML = """
import sys, time, pynvml
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(int(sys.argv[1]))
while True:
    print(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu, flush=True)
    time.sleep(0.02)
"""


class GpuBusySampler:
    """NVML's GPU utilization (percent of the last sample period with a kernel running),
    polled every 20 ms by a child process; ``mean`` is the average as a fraction, or None
    without NVML. A child, not a thread: a polling thread takes the GIL from the host-bound
    train stage it measures."""

    def __init__(self, device) -> None:
        self.device, self.mean, self._child = device, None, None

    def __enter__(self):
        if self.device.type != "cuda":
            return self
        try:
            import pynvml  # noqa: F401
            index = torch.cuda._get_nvml_device_index(self.device)
        except Exception:  # no pynvml / NVML on this machine
            return self
        self._child = subprocess.Popen([sys.executable, "-c", _POLL_NVML, str(index)],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True)
        return self

    def __exit__(self, *exc):
        if self._child is None:
            return
        self._child.terminate()
        out, _ = self._child.communicate()
        values = [int(v) for v in out.split() if v.isdigit()]
        self.mean = sum(values) / len(values) / 100.0 if values else None


def add_floors(results: list[dict], model_dir: Path, args) -> dict:
    """The floors of bench/floors.py, measured now, in this process, for each mode's
    micro-batch (rows = samples x trained steps), plus diffusers' eager generate.

    ``floor_ms_per_transition``: the bare compiled forward + backward per row. The work floor
    adds what the train stage must also do, each part measured bare: the no-grad forward of
    the pi_old anchor for the samples of updates after the first, and per update one clip +
    fused AdamW step over fp32 parameters of the trained shapes."""
    steps, tokens = 3, text_tokens(str(model_dir))
    samples = args.candidates * args.groups
    floors: dict = {}
    for r in results:
        rows = int(r["micro_batch"] or args.micro_batch) * steps
        key = f"{r['mode']} x{rows}"
        rank = 64 if r["mode"] == "lora" else 0
        if key not in floors:
            ms = train_floors(str(model_dir), rows, rank=rank, tokens=tokens)
            floors[key] = {"fwd_bwd": ms["fwd_bwd"] / rows, "fwd": ms["fwd"] / rows,
                           "adam": ms["adam"]}
        f, updates = floors[key], int(r["updates"] or 1)
        # no anchor forward when pi_old is the engine's recorded log-probs
        anchor_rows = (0 if r["anchor"] == "engine"
                       else samples * steps * (updates - 1) // updates)
        work_ms = (samples * steps * f["fwd_bwd"] + anchor_rows * f["fwd"]
                   + updates * f["adam"])
        r["floor_ms_per_transition"] = f["fwd_bwd"]
        r["floor_ratio"] = r["train_ms_per_transition"] / f["fwd_bwd"]
        r["work_floor_ms_per_transition"] = work_ms / (samples * steps)
        r["work_floor_ratio"] = r["train_ms_per_transition"] / r["work_floor_ms_per_transition"]
        r["floor_parts_ms"] = {"fwd_bwd_per_row": f["fwd_bwd"], "fwd_per_row": f["fwd"],
                               "adam_step": f["adam"], "anchor_rows": anchor_rows}
    out = {"floors": floors, "text_tokens": tokens}
    if args.diffusers:
        out["diffusers_images_per_s"] = diffusers_images_per_s(str(model_dir))
    return out


def add_pcie_floor(results: list[dict]) -> dict:
    """For each row whose actor was offloaded: the bytes that crossed PCIe each way, the time
    that takes out and back at the pinned copy rates measured now (``pcie_floor_s``), and the
    offload stage against its own share of it."""
    offloading = [r for r in results if r["stage_times"].get("perf/offload_gb")]
    if not offloading:
        return {}
    rates = pcie_gb_per_s()
    for r in offloading:
        gb = r["stage_times"]["perf/offload_gb"]
        r["pcie_floor_s"] = gb / rates["d2h"] + gb / rates["h2d"]
        r["offload_floor_ratio"] = r["stage_times"]["perf/offload_time"] / (gb / rates["d2h"])
    return {"pcie_gb_per_s": rates}


def mfu_line(r: dict, st: dict) -> list[str]:
    """The row's perf/mfu/* (trainer.compute.mfu) and, with --floors, the floor's own MFU: its
    forward + backward is 3 forwards per row, the train stage 3 + the anchor share
    (trainer.compute.mfu.anchor_forwards) per transition, so the floor's MFU is the train
    stage's times floor_ratio times 3 / (3 + anchor share)."""
    from trainer.compute.mfu import anchor_forwards

    mfu = {k.removeprefix("perf/mfu/"): round(v, 3) for k, v in st.items()
           if k.startswith("perf/mfu/")}
    if not mfu:
        return ["n/a (no peak known for this device; --set logging.peak_tflops=...)"]
    out = [str(mfu)]
    if "floor_ratio" in r and "train" in mfu:
        extra = anchor_forwards(r["anchor"], int(r["updates"] or 1))
        out.append(f"floor {mfu['train'] * r['floor_ratio'] * 3 / (3 + extra):.3f}")
    return out


def print_table(results: list[dict], extra: dict, args) -> None:
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n| row | step s | rollout s | train s | train ms/transition | floor ms/transition"
          f" | ratio / to work floor | engine img/s | micro-batch | peak GB | recompiles | ratio0 | parity |"
          f" ({dev}, {args.layers} layers, {args.candidates * args.groups} samples)")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        st = r["stage_times"]
        print(f"| {r['label']} | {r['step_time']:.3f} | {st.get('perf/rollout_time', 0):.3f} | "
              f"{st.get('perf/train_time', 0):.3f} | {r['train_ms_per_transition']:.2f} | "
              f"{r.get('floor_ms_per_transition', float('nan')):.2f} | "
              f"{r.get('floor_ratio', float('nan')):.2f} / "
              f"{r.get('work_floor_ratio', float('nan')):.2f} | "
              f"{args.candidates * args.groups / st.get('perf/rollout_time', float('nan')):.1f} | "
              f"{r['micro_batch']} | {r['peak_gb']:.1f} | {r['recompiles']} | "
              f"{r['first_update_ratio']} | {r['logp_parity']} |")
        print("  stages:", {k: round(v, 4) for k, v in st.items()})
        print("  compute:", {k: round(v, 4) for k, v in r["compute"].items()})
        print("  MFU:", *mfu_line(r, st))
        if "pcie_floor_s" in r:
            print(f"  offload: {st['perf/offload_gb']:.1f} GB each way; out and back at the pinned "
                  f"copy rates {r['pcie_floor_s']:.3f} s; the offload stage "
                  f"{r['offload_floor_ratio']:.2f}x its D2H floor")
        if "floor_parts_ms" in r:
            print("  work floor:", {k: round(v, 3) for k, v in r["floor_parts_ms"].items()},
                  f"= {r['work_floor_ms_per_transition']:.2f} ms/transition")
    if "diffusers_images_per_s" in extra:
        print(f"diffusers eager QwenImagePipeline: {extra['diffusers_images_per_s']:.1f} img/s")
    for key, kind in (("peer", "plain eager loop"), ("strong_peer", "strong peer")):
        print_peer(extra.get(key), kind)


def print_peer(peer: dict | None, kind: str) -> None:
    if peer:
        print(f"peer ({kind}, micro-batch {peer['micro_batch']}, {peer['updates']} "
              f"updates): step {peer['step']:.3f} s, rollout {peer['rollout']:.3f} s, train "
              f"{peer['train']:.3f} s = {peer['train_ms_per_transition']:.2f} ms/transition, "
              f"peak {peer['peak_gb']:.1f} GB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--modes", nargs="+", default=["lora", "full"])
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--micro-batch", default="auto")
    p.add_argument("--groups", type=int, default=1,
                   help="prompts per step (x --candidates); 8 x 8 = the recipes' global batch of 64")
    p.add_argument("--candidates", type=int, default=8,
                   help="samples per prompt (the GRPO group); VeRL-Omni's Qwen-Image runs use 16")
    p.add_argument("--resolution", type=int, default=None,
                   help="square side in pixels (default: the recipe's 384)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="build the model here once and reuse it on later runs")
    p.add_argument("--label", default="", help="prefix of this run's row names")
    p.add_argument("--floors", action="store_true",
                   help="measure the compiled fwd+bwd floor of each row's micro-batch (GPU)")
    p.add_argument("--diffusers", action="store_true",
                   help="time diffusers' eager pipeline on the same model (GPU)")
    p.add_argument("--peer", action="store_true",
                   help="run the plain eager loop (bench/peer_step.py) at --micro-batch (GPU)")
    p.add_argument("--strong-peer", action="store_true",
                   help="run the strong peer (peer_step.py --strong: compiled blocks, batched "
                        "trained steps, the best attention kernel) at --micro-batch (GPU)")
    # NOTE: the PickScore-shaped scorer has random weights and gives every candidate the same
    # score (to 1e-6), so every group is degenerate and training is skipped: the default
    # reward is JPEG compressibility on the CPU; the scorer is opt-in, to time it.
    p.add_argument("--reward-model", action="store_true",
                   help="score with the random-weight PickScore-shaped model (no training happens)")
    p.add_argument("--no-reward-model", action="store_true", help="the default; kept for old commands")
    p.add_argument("--no-offload", action="store_true",
                   help="keep actor and engine resident (no colocate offload)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for both modes, e.g. train.adam_fused=true")
    args = p.parse_args(argv)
    work, model_dir = prepare_work("bench_step_", args.layers, args.tiny, args.model_dir)
    reward_dir = None
    if args.reward_model and not args.no_reward_model:
        t0 = time.perf_counter()
        reward_dir = work / "pickscore"
        build_model_dir(str(reward_dir), tiny=args.tiny, device=torch.device(args.device))
        print(f"built the reward model in {time.perf_counter() - t0:.1f}s", flush=True)
    results = []
    for m in args.modes:
        results.append(run_mode(m, model_dir, reward_dir, args, work))
        results[-1]["label"] = f"{args.label}{m}"
        Path(args.out).write_text(json.dumps(results, indent=2))
    extra = add_floors(results, model_dir, args) if args.floors else {}
    if args.device == "cuda":
        extra |= add_pcie_floor(results)
    if args.peer:
        extra["peer"] = run_peer(str(model_dir), micro_batch=int(args.micro_batch),
                                 updates=2, rollouts=args.rollouts)
    if args.strong_peer:
        extra["strong_peer"] = run_peer(str(model_dir), micro_batch=int(args.micro_batch),
                                        updates=2, rollouts=args.rollouts, strong=True)
    Path(args.out).write_text(json.dumps({"rows": results, **extra,
                                          "args": vars(args) | {"model_dir": str(model_dir)}},
                                         indent=2, default=str))
    print_table(results, extra, args)
    record_step(results, extra, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
