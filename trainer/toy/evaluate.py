"""Sample the toy model and score it: the numbers in trainer/toy/README.md come from here.

    python -m trainer.toy.evaluate [--model DIR] [--n 256] [--steps 10] [--eta 0.0]
                                   [--split eval] [--seed 0] [--device cpu] [--grid out.png]

Sampling is the plain Euler loop over ``adapter.scheduler_sigmas`` (ODE, what
FlowMatchEulerDiscreteScheduler.step does), or with ``--eta > 0`` the Flow-GRPO SDE through
``kernels.sde_step`` (the math lives only in flowgrpo_kernels/; at sigma = 1, where the SDE's std is
singular, it takes the Euler step itself). Step noise is the adapter's ``step_noise``, so a
sample is a pure function of (weights, prompt, seed, sample id).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Sequence

import numpy as np
import torch

from trainer.toy import world
from trainer.toy.adapter import ToyAdapter
from trainer.models.geometry import Geometry
from trainer.toy.reward import ToyCompositionScorer


@torch.no_grad()
def sample_images(adapter: ToyAdapter, transformer: torch.nn.Module, frozen: dict[str, Any],
                  prompts: Sequence[str], sample_ids: Sequence[str], *, num_steps: int,
                  seed: int, eta: float = 0.0, height: int | None = None,
                  width: int | None = None, batch_size: int = 64,
                  init_ids: Sequence[str] | None = None,
                  sde_steps: int | Sequence[int] | None = None,
                  sigma_one: str | None = None) -> torch.Tensor:
    """uint8 [B, H, W, 3] images; each row a pure function of (weights, prompt, seed, id).

    ``init_ids``: the ids whose initial noise each row starts from (default ``sample_ids``;
    a group sharing one starts from one x_T). With ``eta > 0``: the SDE at the first
    ``sde_steps`` steps (default all), Euler after them, or at the listed steps only;
    ``sigma_one`` goes to ``kernels.sde_step`` when given (e.g. ``"clamp_to_next"``, as the toy
    recipe samples)."""
    height = height or adapter.resolution
    width = width or adapter.resolution
    geometry = Geometry(height, width)
    sde_step = None
    if eta > 0:
        from flowgrpo_kernels import sde_step  # ImportError here says kernels/ lacks it
    device = next(transformer.parameters()).device
    dtype = next(transformer.parameters()).dtype
    sigmas = adapter.scheduler_sigmas(num_steps, geometry).tolist()
    init_ids = list(sample_ids if init_ids is None else init_ids)
    sde_steps = num_steps if sde_steps is None else sde_steps
    noisy = set(range(sde_steps)) if isinstance(sde_steps, int) else set(sde_steps)
    options = {} if sigma_one is None else {"sigma_one": sigma_one}
    out = []
    for lo in range(0, len(prompts), batch_size):
        ps, ids = list(prompts[lo:lo + batch_size]), list(sample_ids[lo:lo + batch_size])
        cond = adapter.encode_prompts(frozen, ps)
        x = adapter.initial_latents(init_ids[lo:lo + batch_size], geometry, seed=seed,
                                    dtype=dtype, device=device)
        for i, (s, s_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
            sig = torch.full((len(ps),), s, device=device)
            v = adapter.velocity(transformer, x, sig, cond, geometry)
            if sde_step is None or i not in noisy:
                x = x + v * (s_next - s)
            else:
                noise = adapter.step_noise(ids, i, x.shape[1:], seed=seed, device=device)
                x = sde_step(x, v, s, s_next, eta=eta, sde_type="sde", noise=noise,
                             **options).prev_sample
        out.append(adapter.decode(frozen, x, geometry).cpu())
    return torch.cat(out)


def evaluate(adapter: ToyAdapter, *, n: int = 256, num_steps: int = 10, eta: float = 0.0,
             split: str = "eval", seed: int = 0, device: str = "cpu",
             records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Mean reward per component (and their mean) of ``n`` samples on ``split`` prompts."""
    records = records or world.make_prompt_records(n, seed=seed, split=split)
    transformer = adapter.load_train_model(device=device).eval()
    frozen = adapter.load_frozen(device=device, dtype=torch.float32)
    start = time.perf_counter()
    images = sample_images(adapter, transformer, frozen, [r["prompt"] for r in records],
                           [r["metadata"]["sample_id"] for r in records],
                           num_steps=num_steps, seed=seed, eta=eta)
    wall = time.perf_counter() - start
    scores = ToyCompositionScorer().score(images, [r["prompt"] for r in records],
                                          [r["metadata"] for r in records])
    means = {k: round(float(v.mean()), 4) for k, v in scores.items()}
    means["mean"] = round(float(np.mean(list(means.values()))), 4)
    return {"reward": means, "n": len(records), "num_steps": num_steps, "eta": eta,
            "split": split, "seed": seed, "sample_seconds": round(wall, 2), "images": images,
            "records": records}


def image_grid(images: torch.Tensor, cols: int = 8, scale: int = 4) -> np.ndarray:
    """uint8 [N, H, W, 3] -> one uint8 grid image (1 px gaps), nearest-upscaled by ``scale``."""
    n, h, w, _ = images.shape
    rows = -(-n // cols)
    grid = np.full((rows * (h + 1) + 1, cols * (w + 1) + 1, 3), 64, dtype=np.uint8)
    for i, img in enumerate(images.numpy()):
        r, c = divmod(i, cols)
        grid[1 + r * (h + 1):1 + r * (h + 1) + h, 1 + c * (w + 1):1 + c * (w + 1) + w] = img
    return grid.repeat(scale, 0).repeat(scale, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.toy.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: shipped weights)")
    p.add_argument("--n", type=int, default=256, help="number of prompts/samples")
    p.add_argument("--steps", type=int, default=10, help="sampling steps")
    p.add_argument("--eta", type=float, default=0.0, help="SDE noise level (0 = ODE)")
    p.add_argument("--split", default="eval", choices=world.SPLITS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--grid", default=None, help="write the first 64 samples as a PNG grid")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = evaluate(ToyAdapter(args.model), n=args.n, num_steps=args.steps, eta=args.eta,
                      split=args.split, seed=args.seed, device=args.device)
    if args.grid:
        from PIL import Image
        Image.fromarray(image_grid(result["images"][:64])).save(args.grid)
    print(json.dumps({k: v for k, v in result.items() if k not in ("images", "records")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
