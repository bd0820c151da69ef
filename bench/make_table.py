"""Render the current benchmark figures from bench/results.csv into the READMEs.

    python bench/make_table.py            # rewrite the generated tables in place
    python bench/make_table.py --check    # exit 1 if a generated table is out of date

The tables, each between marker comments that nothing else writes inside:
- bench/README.md: every current figure (the last row of each bench, case, metric and
  device), one table per bench;
- README.md: the headline figures named in ``HEADLINES`` below, each line from the latest run
  that measured all of its figures, with the device and date.
- README.md, a second table: the algorithms' time to reward on the toy task, three seeds each
  (bench/time_to_reward.py says which rows it reads).
A headline whose figure is missing from results.csv is an error naming it, so a renamed case
cannot silently drop a figure from the README.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import DEFAULT_PATH, REPO, current, read_rows  # noqa: E402
from bench.time_to_reward import BEGIN as TTR_BEGIN, END as TTR_END  # noqa: E402
from bench.time_to_reward import time_to_reward_table  # noqa: E402

BEGIN, END = "<!-- results-table:begin (bench/make_table.py) -->", "<!-- results-table:end -->"
BENCH_README = REPO / "bench" / "README.md"
MAIN_README = REPO / "README.md"
H200 = "NVIDIA H200"


@dataclass(frozen=True)
class Headline:
    what: str
    keys: tuple[tuple[str, str, str], ...]  # (bench, case, metric), shown as "a / b"
    note: str = ""
    device: str = H200


HEADLINES = (
    # the main job (python -m trainer launch --config toy) on a 2-core CPU, one case per seed
    # triple (train, rollout, generation) of bench "toy_main_job"
    *(Headline(f"the main job (`--config toy`), seeds (train, rollout, generation) {seeds}: "
               "held-out eval reward at rollout 0 / 100 / the gain",
               (("toy_main_job", f"toy-seeds-{case}", "eval_reward_start"),
                ("toy_main_job", f"toy-seeds-{case}", "eval_reward_at_100"),
                ("toy_main_job", f"toy-seeds-{case}", "eval_gain_at_100")), note, device="cpu")
      for seeds, case, note in (("0, 42, 1234 (the default)", "0-42-1234",
                                 "CPU (the eval curve is the same on any CPU)"),
                                ("1, 43, 7", "1-43-7", ""), ("2, 44, 99", "2-44-99", ""))),
    Headline("same, default seeds: change of the colour / count / position components",
             (("toy_main_job", "toy-seeds-0-42-1234", "eval_color_change"),
              ("toy_main_job", "toy-seeds-0-42-1234", "eval_count_change"),
              ("toy_main_job", "toy-seeds-0-42-1234", "eval_position_change")), device="cpu"),
    Headline("same, default seeds: wall time of the whole run",
             (("toy_main_job", "toy-seeds-0-42-1234", "wall_s"),), "alone on 2 CPU cores",
             device="cpu"),
    Headline("one training step, 8-layer Qwen-Image-shaped model, 8 x 384², LoRA / full, "
             "recipe defaults",
             (("bench_step", "qwen8l-lora", "step_s"), ("bench_step", "qwen8l-full", "step_s"))),
    Headline("the plain eager loop / this trainer, LoRA, micro-batch 4, 2 updates, no offload",
             (("bench_step", "qwen8l-peer-mb4", "step_s"),
              ("bench_step", "qwen8l-mb4-no-offload-lora", "step_s")),
             "bench/peer_step.py"),
    Headline("the strong peer (compiled blocks, batched trained steps, best attention) / this "
             "trainer, same settings, same run",
             (("bench_step", "qwen8l-peer-strong-mb4", "step_s"),
              ("bench_step", "qwen8l-mb4-no-offload-lora", "step_s")),
             "bench/peer_step.py --strong"),
    Headline("one training step, full-size Qwen-Image (60 blocks, one-layer text encoder), one "
             "group of 16 at 512², LoRA r64, rollout / train / step",
             (("bench_step", "qwen60l-fullsize-512-g16-lora", "rollout_s"),
              ("bench_step", "qwen60l-fullsize-512-g16-lora", "train_s"),
              ("bench_step", "qwen60l-fullsize-512-g16-lora", "step_s")),
             "16 images per step: 1.52 images per GPU-second"),
    Headline("train stage per trained transition over the compiled fwd+bwd floor of the same "
             "run, LoRA / full",
             (("bench_step", "qwen8l-lora", "floor_ratio"),
              ("bench_step", "qwen8l-full", "floor_ratio")), "target ≤ 1.3x for the recipe (LoRA)"),
    Headline("same, over the work floor (that floor, the no-grad anchor forward, a clip + "
             "fused AdamW step per update, each bare), LoRA / full",
             (("bench_step", "qwen8l-lora", "work_floor_ratio"),
              ("bench_step", "qwen8l-full", "work_floor_ratio"))),
    Headline("one clip + AdamW step over the full model's fp32 parameters (2.76 B): torch's "
             "fused (the actor's) / compiled foreach / the copy floor of the same run",
             (("bench_optimizer", "qwen8l-full-fp32-fused", "clip_adamw_step_ms"),
              ("bench_optimizer", "qwen8l-full-fp32-compiled", "clip_adamw_step_ms"),
              ("bench_optimizer", "qwen8l-full-fp32", "copy_floor_ms")),
             "bench/bench_optimizer.py"),
    Headline("full step with the colocate offloads forced / moving its 33 GB out and back at "
             "the pinned copy rates of the same run",
             (("bench_step", "qwen8l-offload-always-full", "step_s"),
              ("bench_step", "qwen8l-offload-always-full", "pcie_floor_s")),
             "the recipe offloads only where actor and engine do not fit"),
    Headline("engine generate, same model, 8 x 384², 12 steps / diffusers' eager pipeline",
             (("bench_step", "qwen8l-lora", "engine_images_per_s"),
              ("bench_step", "qwen8l-diffusers-eager-pipeline", "images_per_s"))),
    Headline("share of the step outside model compute, measured in place, LoRA / full, "
             "recipe defaults",
             (("bench_step", "qwen8l-lora", "outside_compute_share"),
              ("bench_step", "qwen8l-full", "outside_compute_share")), "target ≤ 5 %"),
    Headline("same, no offload, fused AdamW, LoRA / full",
             (("bench_step", "qwen8l-lora-fused-adamw", "outside_compute_share"),
              ("bench_step", "qwen8l-full-fused-adamw", "outside_compute_share")),
             "target ≤ 5 %"),
    Headline("same, full, at the recipes' global batch on one GPU (8 prompts x 8 samples)",
             (("bench_step", "qwen8l-full-64samples", "outside_compute_share"),),
             "target ≤ 5 %"),
    Headline("weight sync inside the step, full 5.5 GB / LoRA adapter 0.10 GB",
             (("bench_step", "qwen8l-full-fused-adamw", "weight_sync_s"),
              ("bench_step", "qwen8l-lora-fused-adamw", "weight_sync_s"))),
    Headline("weak scaling 1 → 2 GPUs, one group of 8 per GPU, LoRA / full",
             (("bench_multi_gpu", "qwen8l-lora-x2", "weak_scaling_efficiency"),
              ("bench_multi_gpu", "qwen8l-full-x2", "weak_scaling_efficiency")),
             "target ≥ 90 %"),
    Headline("SDE log-prob fwd+bwd kernels, bf16 64 x 1,048,576: CUDA graph / eager torch / "
             "torch.compile",
             (("bench_kernels", "64x1048576/bf16/fwd+bwd", "triton_graph_ms"),
              ("bench_kernels", "64x1048576/bf16/fwd+bwd", "eager_ms"),
              ("bench_kernels", "64x1048576/bf16/fwd+bwd", "compile_ms"))),
    Headline("same, bf16 8 x 36,864: CUDA graph / one call from Python, host-inclusive",
             (("bench_kernels", "8x36864/bf16/fwd+bwd", "triton_graph_ms"),
              ("bench_kernels", "8x36864/bf16/fwd+bwd", "host_triton_ms")),
             "target ≤ 0.05 ms"),
    Headline("weight sync, 16 GB bf16, verify full / fused / SGLang's tensor path",
             (("bench_ipc", "ipc-full-sync-16gb-verify=full", "TBps"),
              ("bench_ipc", "ipc-full-sync-16gb-verify=fused", "TBps"),
              ("bench_ipc", "torch-reductions-sglang-path-16gb", "TBps"))),
    Headline("adapter sync, 1,440 tensors, 377 MB",
             (("bench_ipc", "ipc-adapter-sync-1440-tensors", "ms"),), "target ≤ 2 ms"),
    Headline("colocate offload of the LoRA actor (fp32 base 10.3 GiB): left on the GPU / "
             "offload / onload",
             (("bench_step", "qwen8l-lora-offload-train", "allocated_after_offload"),
              ("bench_step", "qwen8l-lora-offload-train", "offload_s"),
              ("bench_step", "qwen8l-lora-offload-train", "onload_s")),
             "bit-identical training with and without (tests/test_offload_gpu.py)"),
    Headline("PickScore-shaped reward, 256 x 384², bf16",
             (("bench_rewards", "pickscore-arch-bfloat16-256x384-32prompts", "images_per_s"),),
             "target ≥ 200 images/s"),
)


def fmt(text: str) -> str:
    """A figure to about three significant digits, without exponents."""
    value = float(text)
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _joined(values: list[str]) -> str:
    unique = list(dict.fromkeys(values))
    return " / ".join(unique)


def run_of(row: dict[str, str]) -> tuple[str, ...]:
    """What tells one bench run from another in the results file."""
    return tuple(row[k] for k in ("bench", "device", "commit", "date", "command"))


def latest_complete_run(rows: list[dict[str, str]], h: Headline) -> list[dict[str, str]] | None:
    """The figures of ``h`` from the latest run that measured every one of them."""
    by_run: dict[tuple[str, ...], dict[tuple[str, str, str], dict[str, str]]] = {}
    for row in rows:
        if row["device"] == h.device:
            by_run.setdefault(run_of(row), {})[(row["bench"], row["case"], row["metric"])] = row
    for figures in reversed(list(by_run.values())):  # dicts keep first-seen (file) order
        if all(key in figures for key in h.keys):
            return [figures[key] for key in h.keys]
    return None


def headline_figures(rows: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """Each headline's figures from the latest run that measured all of them: figures read
    side by side (peer / trainer, engine / diffusers, LoRA / full) only compare within a run."""
    found = [latest_complete_run(rows, h) for h in HEADLINES]
    missing = [f"{h.device}: {' + '.join('/'.join(k) for k in h.keys)}"
               for h, figures in zip(HEADLINES, found) if figures is None]
    if missing:
        raise KeyError("headline figures missing from bench/results.csv (from one run): "
                       + "; ".join(missing))
    return found


def headline_table(rows: list[dict[str, str]]) -> str:
    lines = ["| what | figure | note | measured |", "|---|---|---|---|"]
    for h, found in zip(HEADLINES, headline_figures(rows)):
        units = [r["unit"] for r in found]
        if len(set(units)) == 1:
            figure = " / ".join(fmt(r["value"]) for r in found) + f" {units[0]}"
        else:
            figure = " / ".join(f"{fmt(r['value'])} {r['unit']}" for r in found)
        when = _joined([r["date"] for r in found])
        lines.append(f"| {h.what} | {figure} | {h.note} | {h.device}, {when} |")
    return "\n".join(lines)


def full_table(rows: list[dict[str, str]]) -> str:
    by_bench: dict[str, list[dict[str, str]]] = {}
    for row in current(rows).values():
        by_bench.setdefault(row["bench"], []).append(row)
    parts = []
    for bench, group in by_bench.items():
        parts += [f"#### {bench}", "",
                  "| case | metric | value | min / median / max | device | torch | date | commit |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in group:
            spread = (" / ".join(fmt(r[k]) for k in ("min", "median", "max"))
                      if r["median"] else "")
            parts.append(f"| {r['case']} | {r['metric']} | {fmt(r['value'])} {r['unit']} | "
                         f"{spread} | {r['device']} | {r['torch']} | {r['date']} | "
                         f"{r['commit']} |")
        parts.append("")
    return "\n".join(parts).rstrip()


def replace_between_markers(text: str, table: str, where: Path,
                            begin: str = BEGIN, end: str = END) -> str:
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where}: needs exactly one {begin!r} followed by one {end!r}")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def rendered(results: Path = DEFAULT_PATH, bench_readme: Path = BENCH_README,
             main_readme: Path = MAIN_README) -> dict[Path, str]:
    """The two READMEs as they should read, from the results file."""
    rows = read_rows(results)
    main = replace_between_markers(main_readme.read_text(encoding="utf-8"), headline_table(rows),
                                   main_readme)
    main = replace_between_markers(main, time_to_reward_table(rows, fmt), main_readme,
                                   TTR_BEGIN, TTR_END)
    return {bench_readme: replace_between_markers(bench_readme.read_text(encoding="utf-8"),
                                                  full_table(rows), bench_readme),
            main_readme: main}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="report out-of-date tables instead of rewriting them")
    parser.add_argument("--results", type=Path, default=DEFAULT_PATH)
    args = parser.parse_args(argv)
    stale = []
    for path, text in rendered(args.results).items():
        if path.read_text(encoding="utf-8") != text:
            stale.append(path)
            if not args.check:
                path.write_text(text, encoding="utf-8")
    if args.check and stale:
        print("out of date with bench/results.csv (run python bench/make_table.py): "
              + ", ".join(str(p.relative_to(REPO)) for p in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
