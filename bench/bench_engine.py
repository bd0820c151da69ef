"""Embedded-engine generate throughput on a Qwen-Image-shaped transformer vs diffusers' loop.

    python bench/bench_engine.py --out engine.md          # H200: ~1-2 minutes
    python bench/bench_engine.py --tiny --out tiny.md     # any machine: checks the script runs

Model: ``QwenImageTransformer2DModel`` with the real width (24 heads x 128, joint_attention_dim
3584, in_channels 64, out_channels 16, axes_dims_rope (16, 56, 56)) at reduced depth
(``--layers``, default 8), random weights, bf16. Batch 8 (one group), 384x384 (576 image
tokens), 12 steps, random prompt embeddings of 128 tokens (no text encoder), Qwen-Image's
shifted schedule. Trained SDE steps [3, 4, 5] (eta 0.7, "sde"), as the Qwen-Image recipes train.

Paths timed (median of ``--repeats`` after ``--warmup``; host clock around a device sync, so
Python and launch overheads count):
- forward only: the 12 transformer forwards back to back (the floor of any sampler);
- diffusers loop: the same forwards stepped by FlowMatchEulerDiscreteScheduler.step with bf16
  latents, as QwenImagePipeline does (no trajectory, no log-prob: the baseline);
- engine denoise: ``trainer.engine.embedded.sampler.denoise`` (kernels.sde_step at every step, SDE at
  the 3 indices, trajectory + log-prob recorded, fp32 state) with noise already on the device;
- engine generate: ``EngineCore.generate`` on a request built by the adapter: request checks,
  x_T and step noise by the driver's CPU recipe (per sample id), denoise, a stand-in decode
  (unpack + 3 latent channels to uint8: no VAE, it is not what this measures), response.
"overhead" is the share of a path's time outside the 12 forwards: (t - t_forward) / t.
It also checks on the device that the log-prob the engine recorded equals
``kernels.sde_log_prob`` replayed on the same batch (the ratio == 1 invariant).

Needs torch, triton (on CUDA) and diffusers (with its own dependencies); not transformers.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel  # noqa: E402
from torch import nn  # noqa: E402

import flowgrpo_kernels as kernels  # noqa: E402
from trainer.engine.embedded.core import EngineCore  # noqa: E402
from trainer.engine.embedded.sampler import denoise  # noqa: E402
from trainer.models.base import GenerativeModelAdapter  # noqa: E402
from trainer.models.geometry import Geometry  # noqa: E402
from bench.results import Recorder  # noqa: E402

FULL = dict(patch_size=2, in_channels=64, out_channels=16, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))
TINY = dict(patch_size=2, in_channels=16, out_channels=4, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
# Qwen-Image's scheduler config (model card): exponential shift on the packed sequence length.
QWEN_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                      base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                      max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
SDE_INDICES = [3, 4, 5]
ETA = 0.7


def pack(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


class BenchQwenAdapter(GenerativeModelAdapter):
    """Qwen-Image's geometry and transformer call around an in-memory random transformer."""

    family = "qwen_image_bench"
    condition_keys = ("prompt_embeds", "prompt_embeds_mask")

    def __init__(self, transformer: nn.Module, channels: int, vae_factor: int = 8) -> None:
        super().__init__("<in-memory>")
        self.transformer, self.channels, self.vae_factor = transformer, channels, vae_factor

    def load_train_model(self, *, dtype=torch.bfloat16, device="cpu") -> nn.Module:
        return self.transformer

    def transformer_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.transformer_blocks)

    def lora_target_modules(self) -> list[str]:
        return ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]

    def load_frozen(self, *, device, dtype) -> dict:
        raise NotImplementedError("the benchmark builds its frozen parts in memory")

    def encode_prompts(self, frozen: dict, prompts: list[str]) -> dict[str, torch.Tensor]:
        b = len(prompts)
        return {"prompt_embeds": frozen["embeds"].expand(b, -1, -1),
                "prompt_embeds_mask": frozen["mask"].expand(b, -1)}

    def init_noise_shape(self, geometry: Geometry) -> tuple[int, int, int]:
        step = self.vae_factor * 2
        return self.channels, 2 * (geometry.height // step), 2 * (geometry.width // step)

    def latent_shape(self, geometry: Geometry) -> tuple[int, int]:
        c, h, w = self.init_noise_shape(geometry)
        return (h // 2) * (w // 2), 4 * c

    def noise_to_latents(self, noise: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        return pack(noise)

    def scheduler_sigmas(self, num_inference_steps: int, geometry: Geometry) -> torch.Tensor:
        seq = self.latent_shape(geometry)[0]
        cfg = QWEN_SCHEDULER
        slope = (cfg["max_shift"] - cfg["base_shift"]) / (cfg["max_image_seq_len"] - cfg["base_image_seq_len"])
        mu = cfg["base_shift"] + slope * (seq - cfg["base_image_seq_len"])
        sched = FlowMatchEulerDiscreteScheduler(**cfg)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_inference_steps, num_inference_steps),
                            mu=mu, device="cpu")
        return sched.sigmas.to(torch.float32)

    def velocity(self, transformer, latents, sigma, conditions, geometry) -> torch.Tensor:
        dtype = conditions["prompt_embeds"].dtype
        batch = latents.shape[0]
        _, h, w = self.init_noise_shape(geometry)
        return transformer(hidden_states=latents.to(dtype), timestep=sigma.to(dtype),
                           encoder_hidden_states=conditions["prompt_embeds"],
                           encoder_hidden_states_mask=conditions["prompt_embeds_mask"],
                           img_shapes=[[(1, h // 2, w // 2)]] * batch, return_dict=False)[0]

    def decode(self, frozen: dict, latents: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        c, h, w = self.init_noise_shape(geometry)
        b = latents.shape[0]
        z = latents.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
        rgb = z[:, :3].tanh().add(1).mul(127.5).to(torch.uint8)
        f = geometry.height // h
        return rgb.repeat_interleave(f, 2).repeat_interleave(f, 3).permute(0, 2, 3, 1).contiguous()


def timed(fn, *, warmup: int, repeats: int, device: torch.device) -> tuple[list[float], object]:
    """Seconds of each of ``repeats`` calls after ``warmup`` calls, and the last call's output."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times, out


def replay_matches(adapter, transformer, response, request, device) -> tuple[bool, float]:
    """Whether the engine's recorded log-probs equal ``kernels.sde_log_prob`` replayed on the
    same batch, and the largest difference."""
    batch = adapter.pack_trajectory(response, request)
    exact, worst = True, 0.0
    with torch.no_grad():
        for k in range(len(SDE_INDICES)):
            v = adapter.replay_velocity(transformer, batch, k)
            lp = kernels.sde_log_prob(batch.latents[:, k].to(device), v,
                                      batch.next_latents[:, k].to(device),
                                      batch.sigmas[:, k].to(device), batch.sigmas_next[:, k].to(device),
                                      eta=ETA, sde_type="sde")
            recorded = batch.log_probs[:, k].to(device)
            exact &= bool(torch.equal(lp, recorded))
            worst = max(worst, float((lp - recorded).abs().max()))
    return exact, worst


# (case name in bench/results.csv, label in the markdown table)
PATHS = (("forward-only", "forward only (12 forwards)"),
         ("diffusers-loop", "diffusers FlowMatchEuler loop"),
         ("engine-denoise", "engine denoise (noise on device)"),
         ("engine-generate", "engine generate (full request)"))


def record(times: dict[str, list[float]], batch: int, device_label: str, setup: str) -> None:
    """Each path's ms per batch, images/s and share outside the forwards as rows of
    bench/results.csv (bench/results.py); the case names the model and geometry."""
    rec = Recorder("bench_engine", device=device_label)
    t_fwd = statistics.median(times["forward-only"])
    for name, samples in times.items():
        t = statistics.median(samples)
        case = f"{setup}/{name}"
        rec.add(case, "ms_per_batch", t * 1e3, "ms", samples=[x * 1e3 for x in samples])
        rec.add(case, "images_per_s", batch / t, "images/s", samples=[batch / x for x in samples])
        rec.add(case, "outside_forwards", 100 * (t - t_fwd) / t, "%")
    rec.write()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the markdown table here too")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=384)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--text-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="tiny widths (CPU check of the script)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.size, args.text_len = min(args.size, 64), min(args.text_len, 8)
    return args


def build_transformer(args, device, dtype) -> tuple[nn.Module, dict, float]:
    """The random-weight transformer, its config and the seconds it took to build."""
    cfg = dict(TINY if args.tiny else FULL, num_layers=args.layers)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):  # random init on the device (fp32, 11 GB at 8 layers), then bf16
        transformer = QwenImageTransformer2DModel(**cfg).to(dtype).eval().requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return transformer, cfg, time.perf_counter() - t0


def path_calls(transformer, cfg, args, device, dtype):
    """The adapter, the engine's request and the four timed paths (PATHS order)."""
    adapter = BenchQwenAdapter(transformer, channels=cfg["out_channels"])
    frozen = {"embeds": torch.randn(1, args.text_len, cfg["joint_attention_dim"], device=device, dtype=dtype),
              "mask": torch.ones(1, args.text_len, dtype=torch.long, device=device)}
    core = EngineCore(adapter, transformer, frozen, device=device)
    h = w = args.size
    b, steps = args.batch, args.steps
    sampling = {"height": h, "width": w, "num_inference_steps": steps, "guidance_scale": 1.0,
                "eta": ETA, "sde_type": "sde", "sde_indices": SDE_INDICES}
    ids = [f"prompt:bench:sample:{s}" for s in range(b)]
    request = adapter.build_rollout_request(["a bench prompt"] * b, ids, sampling, rollout_id=0, seed=42)
    sigmas = request["extra_sampling_params"]["sigmas"]
    cond = adapter.encode_prompts(frozen, ["p"] * b)
    geometry = Geometry(h, w)
    x_t = adapter.initial_latents(ids, geometry, seed=42, device=device)
    noise = {i: adapter.step_noise(ids, i, adapter.latent_shape(geometry), seed=42, device=device)
             for i in SDE_INDICES}
    sigma_vecs = [torch.full((b,), s, device=device) for s in sigmas]
    sched = FlowMatchEulerDiscreteScheduler(shift=1.0)

    def forward_only():
        x = x_t.to(dtype)
        with torch.no_grad():
            for i in range(steps):
                adapter.velocity(transformer, x, sigma_vecs[i], cond, geometry)

    def diffusers_loop():
        sched.set_timesteps(sigmas=sigmas[:-1], device=device)
        x = x_t.to(dtype)  # QwenImagePipeline keeps latents in the transformer dtype
        with torch.no_grad():
            for t in sched.timesteps:
                v = transformer(hidden_states=x, timestep=t.expand(b).to(dtype) / 1000,
                                encoder_hidden_states=cond["prompt_embeds"],
                                encoder_hidden_states_mask=cond["prompt_embeds_mask"],
                                img_shapes=[[(1, h // 16, w // 16)]] * b, return_dict=False)[0]
                x = sched.step(v, t, x, return_dict=False)[0]
        return x

    def engine_denoise():
        with torch.no_grad():
            return denoise(lambda x, s: adapter.velocity(transformer, x, s, cond, geometry), x_t, sigmas,
                           SDE_INDICES, eta=ETA, sde_type="sde", noise_fn=noise.__getitem__)

    def engine_generate():
        return core.generate(request)

    return adapter, request, (forward_only, diffusers_loop, engine_denoise, engine_generate)


def render(times, args, header: str, exact: bool, worst: float) -> str:
    medians = {key: statistics.median(samples) for key, samples in times.items()}
    t_fwd, t_diff = medians["forward-only"], medians["diffusers-loop"]
    lines = [header, "",
             "| path | ms / batch | images/s | outside the forwards | vs diffusers loop |",
             "|---|---|---|---|---|"]
    for key, label in PATHS:
        t = medians[key]
        lines.append(f"| {label} | {t * 1e3:.1f} | {args.batch / t:.1f} | "
                     f"{100 * (t - t_fwd) / t:.1f} % | {t_diff / t:.3f}x |")
    lines += ["", f"recorded log-prob == replayed kernels.sde_log_prob (same batch): "
                  f"{'exact' if exact else f'NOT exact, max |diff| {worst:.3g}'}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformer, cfg, build_s = build_transformer(args, device, dtype)
    adapter, request, calls = path_calls(transformer, cfg, args, device, dtype)
    times = {}
    for (name, _), fn in zip(PATHS, calls):
        times[name], response = timed(fn, warmup=args.warmup, repeats=args.repeats, device=device)
    exact, worst = replay_matches(adapter, transformer, response, request, device)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    params = sum(p.numel() for p in transformer.parameters())
    dname = str(dtype).replace("torch.", "")
    header = (f"Engine benchmark, {datetime.date.today()}, {name}, torch {torch.__version__}, "
              f"QwenImageTransformer2DModel {args.layers} layers ({params / 1e9:.2f} B params, "
              f"{'tiny widths' if args.tiny else 'real width'}), {dname}, batch {args.batch}, "
              f"{args.size}x{args.size}, {args.steps} steps, SDE steps {SDE_INDICES}, "
              f"model built in {build_s:.1f} s")
    text = render(times, args, header, exact, worst)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    setup = (f"qwen{args.layers}l{'-tiny' if args.tiny else ''}-{dname}-{args.batch}x{args.size}"
             f"-{args.steps}steps")
    record(times, args.batch, name, setup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
