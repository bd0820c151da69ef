"""Colocated PickScore throughput: 256 images of 384x384 through the real PickScoreScorer.

    python bench/bench_rewards.py --out rewards.json            # the H200 figure (bf16)
    python bench/bench_rewards.py --tiny --device cpu --images 8 --out smoke.json   # CI smoke

The model is PickScore's architecture (transformers CLIPModel shaped like LAION CLIP ViT-H-14:
32 x 1280 vision layers at 224 px / patch 14, 24 x 1024 text layers, 1024-d projection) with
random weights built from its config, saved in the published directory layout and loaded back
through build_reward_manager(runtime="colocate"), so the timed path is the training one:
uint8 images already on the GPU -> batched torch preprocessing -> image and text towers ->
scores on the host. Needs only torch and transformers (no open_clip, no diffusers).

The tokenizer is byte-level (no BPE merges; ids padded to CLIP's 49408 with the real special
ids), so prompts are a few times more tokens than with CLIP's vocabulary: text cost is, if
anything, overstated. The GRPO geometry of the Qwen-Image recipes is kept: 32 prompts x 8 images.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer, CLIPConfig, CLIPModel  # noqa: E402

from bench.results import Recorder  # noqa: E402
from trainer.rewards import build_reward_manager  # noqa: E402

TARGET_IMAGES_PER_S = 200.0
CPU_PATH_S_PER_ROLLOUT = 104.0  # a CPU scoring path: reward + convert + transfer, 256 samples
VOCAB_SIZE = 49408


def byte_level_vocab() -> dict[str, int]:
    """Byte-level BPE symbols (printable bytes as themselves, the rest shifted past 255, the
    usual reversible byte-to-unicode map), each also with the end-of-word suffix, filler up to
    CLIP's vocabulary size, and CLIP's special tokens at their real ids."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    symbols, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + shift)
            shift += 1
    tokens = [symbols[b] for b in range(256)] + [symbols[b] + "</w>" for b in range(256)]
    tokens += [f"<|filler_{i}|>" for i in range(VOCAB_SIZE - 2 - len(tokens))]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}


def build_model_dir(directory: str, *, tiny: bool, device: torch.device) -> float:
    """Random-weight CLIP in the transformers layout (model + tokenizer + processor)."""

    if tiny:
        text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4)
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4)
        projection = 32
    else:  # LAION CLIP-ViT-H-14 (what PickScore_v1 fine-tunes)
        text = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                    num_attention_heads=16)
        vision = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                      num_attention_heads=16)
        projection = 1024
    config = CLIPConfig(
        text_config=dict(vocab_size=VOCAB_SIZE, max_position_embeddings=77, hidden_act="gelu",
                         bos_token_id=49406, eos_token_id=49407, pad_token_id=49407, **text),
        vision_config=dict(image_size=224, patch_size=14, hidden_act="gelu", **vision),
        projection_dim=projection)
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = CLIPModel(config)
    model.to(torch.bfloat16).save_pretrained(directory)
    del model
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(byte_level_vocab(), f)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": 77}, f)
    AutoTokenizer.from_pretrained(directory).save_pretrained(directory)
    with open(os.path.join(directory, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump({"image_processor_type": "CLIPImageProcessor", "do_resize": True,
                   "size": {"shortest_edge": 224}, "resample": 3, "do_center_crop": True,
                   "crop_size": {"height": 224, "width": 224}, "do_rescale": True,
                   "rescale_factor": 1 / 255, "do_normalize": True,
                   "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711]}, f)
    return time.perf_counter() - start


def check_preprocessing(transform, images: torch.Tensor) -> dict:
    """The timed path's preprocessing (two-pass float on CUDA) against the CPU uint8 path,
    in uint8 levels: each is within one level of PIL, so they may differ by at most two."""
    levels = 255.0 * torch.tensor(transform.std).view(1, 3, 1, 1)
    here = transform(images).float().cpu() * levels
    cpu = transform(images.cpu()).float() * levels
    diff = (here - cpu).abs()
    return {"max_levels": round(diff.max().item(), 3), "mean_levels": round(diff.mean().item(), 5),
            "ok": diff.max().item() <= 2.0 + 1e-3}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--resolution", type=int, default=384)
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts (groups)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[32, 64, 128, 256],
                        help="scorer batch sizes to sweep (images per forward)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test)")
    return parser.parse_args(argv)


def load_manager(args, device: torch.device, runtime: str, result: dict):
    """The reward manager around a freshly built random-weight scorer; build and load seconds
    go into ``result``."""
    with tempfile.TemporaryDirectory(prefix="bench_pickscore_") as directory:
        result["build_s"] = build_model_dir(directory, tiny=args.tiny, device=device)
        start = time.perf_counter()
        # dtype left to the scorer's default: bf16 on CUDA (the figure), fp32 on CPU.
        manager = build_reward_manager(scorer_path="trainer.rewards.pickscore.PickScoreScorer",
                                       model_path=directory, runtime=runtime, device=device)
        result["load_s"] = time.perf_counter() - start
    return manager


def sweep_batch_sizes(manager, images, prompts, args) -> dict[int, dict]:
    """Median scoring time of the whole rollout per scorer batch size (the default first)."""
    scorer, metadata = manager.scorers[0], [{} for _ in prompts]
    sweep = {}
    default_batch = scorer.clip.batch_size
    for batch_size in dict.fromkeys([default_batch, *args.batch_sizes]):
        scorer.clip.batch_size = batch_size
        manager.score(images, prompts, metadata)  # warm-up (kernel selection, allocator)
        times = [manager.score(images, prompts, metadata)[1]["reward/score_time"]
                 for _ in range(args.repeats)]
        sweep[batch_size] = {"median_s": statistics.median(times), "min_s": min(times),
                             "images_per_s": args.images / statistics.median(times),
                             "times_s": times}
        print(f"batch_size {batch_size:>4}: {sweep[batch_size]['median_s'] * 1e3:8.1f} ms "
              f"median of {args.repeats} -> {sweep[batch_size]['images_per_s']:8.1f} images/s",
              flush=True)
    scorer.clip.batch_size = default_batch
    return sweep


def markdown_row(result: dict, args, runtime: str) -> str:
    arch = "tiny CLIP (smoke test)" if args.tiny else "PickScore arch (CLIP ViT-H-14, random)"
    return (f"| {arch}, {result['dtype']}, {args.images} x {args.resolution}², "
            f"{args.prompts} prompts, {runtime}, batch {result['default_batch_size']} | "
            f"{result['device']} | {result['images_per_s']:.0f} images/s "
            f"({result['s_per_rollout']:.2f} s per rollout; peak "
            f"{result.get('peak_gb', float('nan')):.1f} GB) | target ≥ "
            f"{TARGET_IMAGES_PER_S:.0f} images/s; CPU path ≈ {CPU_PATH_S_PER_ROLLOUT:.0f} s "
            f"per rollout |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    runtime = "colocate" if device.type == "cuda" else "cpu"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result: dict = {"device": name, "torch": torch.__version__,
                    "transformers": transformers.__version__, "images": args.images,
                    "resolution": args.resolution, "prompts": args.prompts, "tiny": args.tiny}
    manager = load_manager(args, device, runtime, result)
    scorer = manager.scorers[0]
    result["attn_implementation"] = getattr(scorer.clip.model.config, "_attn_implementation", None)
    result["dtype"] = str(scorer.clip.dtype).removeprefix("torch.")
    generator = torch.Generator(device=device).manual_seed(0)
    images = torch.randint(0, 256, (args.images, args.resolution, args.resolution, 3),
                           dtype=torch.uint8, device=device, generator=generator)
    prompts = [f"prompt {i % args.prompts}: a red panda drinking tea in a garden, detailed"
               for i in range(args.images)]
    result["preprocess_check"] = check_preprocessing(scorer.clip.transform, images)
    print(f"preprocessing on {device.type} vs the CPU uint8 path: "
          f"{result['preprocess_check']}", flush=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_mem = torch.cuda.memory_allocated(device)
    sweep = sweep_batch_sizes(manager, images, prompts, args)
    default_batch = scorer.clip.batch_size
    result["sweep"] = {str(k): v for k, v in sweep.items()}
    result["default_batch_size"] = default_batch
    result["images_per_s"] = sweep[default_batch]["images_per_s"]
    result["s_per_rollout"] = sweep[default_batch]["median_s"]
    if device.type == "cuda":
        result["weights_gb"] = base_mem / 1e9
        result["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    result["target_images_per_s"] = TARGET_IMAGES_PER_S
    result["meets_target"] = result["images_per_s"] >= TARGET_IMAGES_PER_S
    result["markdown_row"] = markdown_row(result, args, runtime)
    print(result["markdown_row"])
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    record(result, sweep, args)
    return 0


def record(result: dict, sweep: dict, args) -> None:
    """The run's figures as rows of bench/results.csv (bench/results.py)."""
    rec = Recorder("bench_rewards", device=result["device"])
    model = "tiny-clip" if args.tiny else "pickscore-arch"
    case = f"{model}-{result['dtype']}-{args.images}x{args.resolution}-{args.prompts}prompts"
    for batch_size, figures in sweep.items():
        per_s = [args.images / t for t in figures["times_s"]]
        default = batch_size == result["default_batch_size"]
        rec.add(case if default else f"{case}-batch{batch_size}", "images_per_s",
                figures["images_per_s"], "images/s", samples=per_s)
    rec.add(case, "s_per_rollout", result["s_per_rollout"], "s",
            samples=sweep[result["default_batch_size"]]["times_s"])
    if "peak_gb" in result:
        rec.add(case, "peak_memory", result["peak_gb"], "GB")
    rec.write()


if __name__ == "__main__":
    raise SystemExit(main())
