"""Pretrain the toy model: transformer + text encoder jointly, rectified flow on rendered pairs.

    python -m trainer.toy.pretrain --out DIR --seed S --minutes M [--steps N] [--threads T]

Objective (SD3's): x0 = rendered image in [-1, 1], noise ~ N(0, I), sigma ~ logit-normal(0, 1),
x = (1 - sigma) x0 + sigma noise, loss = mse(v(x, sigma, prompt), noise - x0). Prompts come
from the *train* split only, so the eval split measures generalisation to unseen prompts.
Each step draws fresh (prompt, placement) pairs: there is no fixed dataset to overfit.

Determinism: everything random comes from ``--seed`` (torch.manual_seed for init and noise,
a numpy Generator for prompts and rendering), and the schedule is a fixed ``--steps``. With
the same seed, torch build, CPU and ``--threads``, the weights come out bit-identical; other
thread counts reorder float reductions and give slightly different weights. ``--minutes`` is
a wall-clock cap: if it stops training before ``--steps``, the result depends on machine speed,
and toy_config.json records ``"stopped_early": true`` with the steps reached.

What is saved is an exponential moving average of the weights (``--ema``), the usual choice
for diffusion models: the raw weights of a short, high-learning-rate run sample worse.

On a GPU (``--device cuda``) rendering a batch in the training process would take many times
as long as a model step (figures: bench/reports/2026-12-04_cpu-h200_comment-figures.md):
``--render-workers N`` renders each batch in N processes. The main process still draws every
prompt, caption corruption and a per-image render seed from the one numpy stream, so the
batches are the same for any N >= 1 (but not the same as N = 0's, which renders from that
stream itself: the shipped weights were made so). Noise and sigma come from a CPU torch
generator on every device.
"""
from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from trainer.toy import modeling, world


SIGMA_SAMPLING = ("logit_normal", "uniform")
# a batch of a few hundred small images renders in well under a second; a worker that takes
# this long is stuck, and the run stops with an error instead of waiting
RENDER_TIMEOUT_S = 300.0


def _pair(rng: np.random.Generator, specs: list[dict[str, Any]],
          singles: list[dict[str, Any]], caption_noise: float,
          noisy_facts: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """One training pair drawn from ``rng``: the caption, and the spec its image is drawn from."""
    pool = singles if rng.random() < world.SINGLE_FRACTION else specs
    spec = pool[int(rng.integers(len(pool)))]
    prompt = world.spec_to_prompt(spec)
    if caption_noise > 0:  # the image departs from its caption (world.corrupt_spec)
        spec = world.corrupt_spec(spec, caption_noise, rng, noisy_facts)
    return prompt, spec


def _batch(rng: np.random.Generator, specs: list[dict[str, Any]], singles: list[dict[str, Any]],
           batch: int, size: int, caption_noise: float = 0.0,
           noisy_facts: tuple[str, ...] = world.CAPTION_FACTS) -> tuple[list[str], torch.Tensor]:
    prompts, images = [], np.empty((batch, size, size, 3), dtype=np.uint8)
    for i in range(batch):
        prompt, spec = _pair(rng, specs, singles, caption_noise, noisy_facts)
        prompts.append(prompt)
        images[i] = world.render(spec, size, rng)
    return prompts, _to_x0(images)


def _to_x0(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def _render_seeded(jobs: list[tuple[dict[str, Any], int, int]]) -> np.ndarray:
    """Images for (spec, size, seed) jobs, each from its own seed (so any split gives the same)."""
    return np.stack([world.render(spec, size, np.random.default_rng(seed))
                     for spec, size, seed in jobs])


def _batch_jobs(rng: np.random.Generator, specs: list[dict[str, Any]],
                singles: list[dict[str, Any]], batch: int, size: int, caption_noise: float,
                noisy_facts: tuple[str, ...]) -> tuple[list[str], list[tuple]]:
    """One batch's prompts and render jobs (spec, size, seed), all drawn from ``rng``."""
    prompts, jobs = [], []
    for _ in range(batch):
        prompt, spec = _pair(rng, specs, singles, caption_noise, noisy_facts)
        prompts.append(prompt)
        jobs.append((spec, size, int(rng.integers(2 ** 63))))
    return prompts, jobs


def training_batches(seed: int, batch: int, size: int, *, caption_noise: float = 0.0,
                     noisy_facts: tuple[str, ...] = world.CAPTION_FACTS,
                     render_workers: int = 0, prefetch: int = 4):
    """Endless (prompts, x0 on the CPU) batches of the train split; see the module docstring
    for what ``render_workers`` changes. Close the generator to stop the worker processes."""
    singles, pairs = world.split_specs("train")
    rng = np.random.default_rng(seed)
    if render_workers == 0:
        while True:
            yield _batch(rng, pairs, singles, batch, size, caption_noise, noisy_facts)
    # spawn: the parent may hold a CUDA context, which a forked child must not inherit.
    # concurrent.futures rather than multiprocessing.Pool: a worker that dies breaks the pool
    # (BrokenProcessPool) where a Pool waits for its lost task forever, and closing does not go
    # through Pool.terminate(), which can block on the task queue's lock an idle worker holds.
    workers = ProcessPoolExecutor(render_workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        pending: deque = deque()
        chunk = -(-batch // render_workers)
        while True:
            while len(pending) < prefetch:
                prompts, jobs = _batch_jobs(rng, pairs, singles, batch, size, caption_noise,
                                            noisy_facts)
                pending.append((prompts, [workers.submit(_render_seeded, jobs[i:i + chunk])
                                          for i in range(0, batch, chunk)]))
            prompts, parts = pending.popleft()
            yield prompts, _to_x0(np.concatenate([_rendered(part) for part in parts]))
    finally:
        workers.shutdown(wait=True, cancel_futures=True)


def _rendered(part) -> np.ndarray:
    try:
        return part.result(timeout=RENDER_TIMEOUT_S)
    except TimeoutError:
        raise RuntimeError(f"a render worker returned no images within {RENDER_TIMEOUT_S:.0f} s "
                           "(stuck); stopping instead of waiting") from None


def option_problems(*, sigma_sampling: str = "logit_normal", caption_noise: float = 0.0,
                    init: str | Path | None = None, pos_embed_scale: float = 1.0,
                    transformer_config: dict[str, Any] | None = None,
                    text_encoder_config: dict[str, Any] | None = None,
                    named: Callable[[str], str] = str) -> list[str]:
    """Every bad pretraining option (empty: none), each called ``named(parameter)`` (the CLI
    names its flags). Options that shape a fresh model are refused with ``init`` (they would
    be ignored, or, for the position table, applied a second time)."""
    problems = []
    if sigma_sampling not in SIGMA_SAMPLING:
        problems.append(f"{named('sigma_sampling')} must be one of {SIGMA_SAMPLING}, "
                        f"got {sigma_sampling!r}")
    if not 0.0 <= caption_noise < 1.0:
        problems.append(f"{named('caption_noise')}={caption_noise} must be in [0, 1)")
    if init is not None:
        fresh_only = (("transformer_config", transformer_config),
                      ("text_encoder_config", text_encoder_config),
                      ("pos_embed_scale", pos_embed_scale != 1.0))
        problems += [f"{named(name)} shapes a fresh model and cannot be combined with "
                     f"{named('init')}={str(init)!r}" for name, given in fresh_only if given]
    return problems


def _starting_model(seed: int, *, init: str | Path | None, resolution: int,
                    pos_embed_scale: float, transformer_config: dict[str, Any] | None,
                    text_encoder_config: dict[str, Any] | None):
    """(transformer, text_encoder, tokenizer) to train: a seeded fresh model, or ``init``'s."""
    if init is not None:
        return modeling.load_parts(init)
    transformer, text_encoder, tokenizer = modeling.build_untrained(
        seed, transformer=dict(transformer_config or {}, sample_size=resolution),
        text_encoder=text_encoder_config)
    if pos_embed_scale != 1.0:
        # The fixed sin-cos position table is a persistent buffer: scaled here, it ships with
        # the weights. A larger table lets position outweigh content at high noise, where the
        # layout is decided (the 1.0 model is nearly translation-equivariant at sigma 0.9).
        with torch.no_grad():
            transformer.pos_embed.pos_embed.mul_(pos_embed_scale)
    return transformer, text_encoder, tokenizer


def warmup_cosine(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine down to 10 % at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def flow_matching_loss(transformer, text_encoder, tokenizer, prompts: list[str],
                       x0: torch.Tensor, gen: torch.Generator, sigma_sampling: str
                       ) -> torch.Tensor:
    """One batch's rectified-flow loss: the velocity at x_sigma = (1 - sigma) x0 + sigma noise
    against noise - x0 (SD3's convention; the noise, then sigma, drawn from ``gen``)."""
    device = x0.device
    ids = tokenizer(prompts, padding="max_length", max_length=modeling.MAX_PROMPT_TOKENS,
                    return_tensors="pt").input_ids.to(device)
    noise = torch.randn(x0.shape, generator=gen).to(device)
    if sigma_sampling == "uniform":  # as much weight on high noise (layout) as on detail
        sigma = torch.rand(x0.shape[0], generator=gen)
    else:
        sigma = torch.sigmoid(torch.randn(x0.shape[0], generator=gen))
    sigma = sigma.to(device)
    s = sigma.view(-1, 1, 1, 1)
    text = text_encoder(input_ids=ids)
    v = transformer(hidden_states=(1 - s) * x0 + s * noise,
                    encoder_hidden_states=text.last_hidden_state,
                    pooled_projections=text.pooler_output, timestep=sigma * 1000,
                    return_dict=False)[0]
    return torch.nn.functional.mse_loss(v, noise - x0)


@torch.no_grad()
def _ema_update(ema_modules: torch.nn.Module, modules: torch.nn.Module, decay: float) -> None:
    for p_ema, p in zip(ema_modules.parameters(), modules.parameters()):
        p_ema.lerp_(p, 1 - decay)


def pretrain(out: str | Path, *, seed: int = 0, steps: int = 1500, minutes: float = 20.0,
             batch: int = 32, lr: float = 1e-3, warmup: int = 200, ema: float = 0.999,
             resolution: int = 32, threads: int | None = None, log_every: int = 100,
             snapshot_every: int = 0, sigma_sampling: str = "logit_normal",
             pos_embed_scale: float = 1.0, caption_noise: float = 0.0,
             noisy_facts: tuple[str, ...] = world.CAPTION_FACTS,
             init: str | Path | None = None,
             transformer_config: dict[str, Any] | None = None,
             text_encoder_config: dict[str, Any] | None = None,
             device: str = "cpu", render_workers: int = 0) -> dict[str, Any]:
    """Train and write the model directory to ``out``; returns the run's info dict.

    ``snapshot_every`` > 0 also writes the EMA model every that many steps to
    ``out/snapshots/step-N`` (how the shipped step count was chosen: see README.md).
    ``caption_noise``: the share of each caption fact (count, colour, relation) the rendered
    image gets wrong (``world.corrupt_spec``). ``init``: a toy model directory to continue
    from instead of a random init (its architecture is kept). ``device``: where the model
    trains; ``render_workers``: processes that render the batches (module docstring).
    """
    if threads:
        torch.set_num_threads(threads)
    problems = option_problems(sigma_sampling=sigma_sampling, caption_noise=caption_noise,
                               init=init, pos_embed_scale=pos_embed_scale,
                               transformer_config=transformer_config,
                               text_encoder_config=text_encoder_config)
    if problems:
        raise ValueError("pretrain: " + "; ".join(problems))
    transformer, text_encoder, tokenizer = _starting_model(
        seed, init=init, resolution=resolution, pos_embed_scale=pos_embed_scale,
        transformer_config=transformer_config, text_encoder_config=text_encoder_config)
    modules = torch.nn.ModuleDict({"transformer": transformer, "text_encoder": text_encoder})
    modules.to(device)
    ema_modules = copy.deepcopy(modules).requires_grad_(False)
    opt = torch.optim.AdamW(modules.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    def lr_at(step: int) -> float:
        return warmup_cosine(step, lr, warmup, steps)

    batches = training_batches(seed, batch, resolution, caption_noise=caption_noise,
                               noisy_facts=noisy_facts, render_workers=render_workers)
    gen = torch.Generator().manual_seed(seed)
    start, step, recent = time.perf_counter(), 0, []

    def info(wall: float) -> dict[str, Any]:
        return {"seed": seed, "steps": step, "planned_steps": steps, "batch": batch, "lr": lr,
                "ema": ema, "threads": torch.get_num_threads(), "wall_seconds": round(wall, 1),
                "stopped_early": step < steps, "torch": torch.__version__,
                "sigma_sampling": sigma_sampling, "pos_embed_scale": pos_embed_scale,
                "caption_noise": caption_noise, "noisy_facts": list(noisy_facts),
                "init": None if init is None else str(init), "device": str(device),
                "render_workers": render_workers}

    def save(to: Path, wall: float) -> None:
        parts = ema_modules if str(device) == "cpu" else copy.deepcopy(ema_modules).cpu()
        modeling.save_model_dir(to, transformer=parts["transformer"],
                                text_encoder=parts["text_encoder"], tokenizer=tokenizer,
                                resolution=resolution, info=info(wall))

    try:
        while step < steps and time.perf_counter() - start < minutes * 60:
            prompts, x0 = next(batches)
            loss = flow_matching_loss(transformer, text_encoder, tokenizer, prompts,
                                      x0.to(device), gen, sigma_sampling)
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(modules.parameters(), 1.0)
            opt.step()
            # the average's decay warms up over the first steps
            _ema_update(ema_modules, modules, min(ema, (1 + step) / (10 + step)))
            recent.append(loss.detach())
            step += 1
            if step % log_every == 0 or step == steps:
                print(f"step {step}/{steps} loss {torch.stack(recent).mean().item():.4f} "
                      f"lr {lr_at(step - 1):.2e} {time.perf_counter() - start:.0f}s", flush=True)
                recent = []
            if snapshot_every and step % snapshot_every == 0 and step < steps:
                save(Path(out) / "snapshots" / f"step-{step}", time.perf_counter() - start)
    finally:
        batches.close()
    final = info(time.perf_counter() - start)
    save(Path(out), time.perf_counter() - start)
    return final


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.toy.pretrain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock cap")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (the schedule)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: the shipped run; also the fastest per CPU-second)")
    p.add_argument("--ema", type=float, default=0.999,
                   help="EMA decay of the saved weights (0: save the raw weights)")
    p.add_argument("--sigma-sampling", default="logit_normal", choices=SIGMA_SAMPLING,
                   help="training noise levels: SD3's logit-normal(0, 1) or uniform in [0, 1]")
    p.add_argument("--pos-embed-scale", type=float, default=1.0,
                   help="multiply the transformer's fixed position table (shipped with it)")
    p.add_argument("--caption-noise", type=float, default=0.0,
                   help="share of each caption fact (count, colour, relation) the image gets "
                        "wrong (world.corrupt_spec)")
    p.add_argument("--noisy-facts", nargs="+", default=list(world.CAPTION_FACTS),
                   choices=world.CAPTION_FACTS, help="which caption facts --caption-noise touches")
    p.add_argument("--init", default=None,
                   help="continue from this toy model directory instead of a random init")
    p.add_argument("--warmup", type=int, default=200, help="linear warm-up steps of the lr")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="also write the EMA model every N steps under OUT/snapshots/")
    p.add_argument("--device", default="cpu", help="where the model trains (cpu, cuda, ...)")
    p.add_argument("--render-workers", type=int, default=0,
                   help="processes that render the training images (0: in this process, as "
                        "the shipped weights were made; a GPU run needs several)")
    args = p.parse_args(argv)
    problems = [f"--{k}={getattr(args, k)} must be > 0" for k in ("minutes", "steps", "batch", "lr")
                if getattr(args, k) <= 0]
    if args.render_workers < 0:
        problems.append(f"--render-workers={args.render_workers} must be >= 0")
    problems += option_problems(sigma_sampling=args.sigma_sampling,
                                caption_noise=args.caption_noise, init=args.init,
                                pos_embed_scale=args.pos_embed_scale,
                                named=lambda name: "--" + name.replace("_", "-"))
    if problems:
        p.error("; ".join(problems))
    info = pretrain(args.out, seed=args.seed, steps=args.steps, minutes=args.minutes,
                    batch=args.batch, lr=args.lr, threads=args.threads, ema=args.ema,
                    snapshot_every=args.snapshot_every, sigma_sampling=args.sigma_sampling,
                    pos_embed_scale=args.pos_embed_scale, caption_noise=args.caption_noise,
                    noisy_facts=tuple(args.noisy_facts), init=args.init, warmup=args.warmup,
                    device=args.device, render_workers=args.render_workers)
    print(info)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
