"""Floors measured in the same run as the step they judge (bench_step.py).

- ``train_floors``: the bare bf16 forward + backward of the same transformer (with its LoRA,
  or every weight trainable for full fine-tuning) on random inputs of the step's geometry and
  text length, each block compiled, no optimizer, no FSDP, no log-prob: what a replay
  micro-batch of ``rows`` transitions cannot go below; beside it the no-grad forward (what the
  pi_old anchor costs at best) and one clip + fused AdamW step over fp32 parameters of the
  trained shapes (``adam_step_ms``): together ``bench_step.py``'s work floor.
- ``pcie_gb_per_s``: pinned host <-> device copy rates, what the colocate offload of the
  actor's state (out after the update, back before the next) cannot beat.
- ``diffusers_images_per_s``: diffusers' own QwenImagePipeline, eager, on the same model
  directory and geometry (text encoding, denoising loop, VAE decode): what the engine's
  generate is judged against.
"""
from __future__ import annotations

import gc
import statistics

import torch
from diffusers import QwenImagePipeline
from peft import LoraConfig, get_peft_model

from trainer.actor.local_adam import scale_gradients, step_adam_on_local_shards
from trainer.actor.update import grad_norm_and_clip_coef
from trainer.models.geometry import Geometry
from trainer.models.compile import compile_blocks
from trainer.models.qwen_image import QwenImageAdapter

BENCH_PROMPT = "a photo of a red panda number 7 in a teacup"


def text_tokens(model_dir: str) -> int:
    """How many tokens the bench's prompt encodes to (the floor's text length)."""
    adapter = QwenImageAdapter(model_dir)
    frozen = adapter.load_frozen(device="cuda", dtype=torch.bfloat16)
    length = int(adapter.encode_prompts(frozen, [BENCH_PROMPT])["prompt_embeds"].shape[1])
    del frozen
    _release()
    return length


def _median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def lora_transformer(model_dir: str, rank: int, compiled: bool):
    """The bf16 transformer with a LoRA of ``rank`` (trainable), or fully trainable at 0."""
    adapter = QwenImageAdapter(model_dir)
    model = adapter.load_train_model(dtype=torch.bfloat16, device="cuda")
    if rank <= 0:
        if compiled:
            compile_blocks(adapter.transformer_blocks(model))
        return adapter, model.requires_grad_(True)
    model.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                             target_modules=adapter.lora_target_modules()))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    if compiled:
        compile_blocks(adapter.transformer_blocks(model))
    return adapter, model


def floor_step(adapter, model, rows: int, *, tokens: int = 32, height: int = 384,
               width: int = 384, forward_only: bool = False):
    """One floor iteration on random inputs of the step's geometry and text length: the
    forward + backward (gradients dropped after), or with ``forward_only`` the no-grad forward."""
    joint = adapter.transformer_config["joint_attention_dim"]
    x = torch.randn((rows, *adapter.latent_shape(Geometry(height, width))), device="cuda",
                    dtype=torch.bfloat16)
    sigma = torch.rand(rows, device="cuda")
    cond = {"prompt_embeds": torch.randn(rows, tokens, joint, device="cuda",
                                         dtype=torch.bfloat16),
            "prompt_embeds_mask": torch.ones(rows, tokens, dtype=torch.long, device="cuda")}

    def step():
        if forward_only:
            with torch.no_grad():
                adapter.velocity(model, x, sigma, cond, Geometry(height, width))
            return
        v = adapter.velocity(model, x, sigma, cond, Geometry(height, width))
        v.float().square().mean().backward()
        for p in model.parameters():
            p.grad = None

    return step


def _release() -> None:
    """Give a dropped model's device memory back before the next measurement."""
    gc.collect()
    torch.cuda.empty_cache()


def train_floors(model_dir: str, rows: int, *, rank: int = 64, tokens: int = 32,
                 height: int = 384, width: int = 384) -> dict[str, float]:
    """The floors of a train stage on micro-batches of ``rows`` rows, in ms, from one loaded,
    compiled model: ``fwd_bwd`` and ``fwd`` per micro-batch, ``adam`` per optimizer step."""
    adapter, model = lora_transformer(model_dir, rank, True)
    try:
        fwd_bwd, fwd = (_median_ms(floor_step(adapter, model, rows, tokens=tokens,
                                              height=height, width=width, forward_only=only),
                                   warmup=3, iters=10) for only in (False, True))
        shapes = [p.shape for p in model.parameters() if p.requires_grad]
    finally:
        del model
        _release()
    return {"fwd_bwd": fwd_bwd, "fwd": fwd, "adam": adam_step_ms(shapes)}


def optimizer_step(variant: str, params: list[torch.Tensor], max_norm: float = 1.0):
    """(optimizer, one clip + AdamW step as a callable) over ``params`` (with their grads):
    ``fused``: the actor's step (torch's fused AdamW on the local-shard path, the clip's
    coefficient applied inside its kernel); ``foreach``: torch's foreach AdamW, the gradients
    scaled first; ``compiled``: that foreach step and scaling under torch.compile (tensor lr
    and capturable step counters, so a moving lr does not recompile)."""
    if variant == "fused":
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True)

        def step():
            _, coef = grad_norm_and_clip_coef(params, max_norm)
            step_adam_on_local_shards(opt, coef)
        return opt, step
    if variant == "foreach":
        opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)

        def step():
            _, coef = grad_norm_and_clip_coef(params, max_norm)
            scale_gradients(params, coef)
            opt.step()
        return opt, step
    if variant != "compiled":
        raise ValueError(f"unknown optimizer variant {variant!r}")
    opt = torch.optim.AdamW(params, lr=torch.tensor(1e-5, device=params[0].device),
                            foreach=True, capturable=True)

    @torch.compile(fullgraph=False)
    def scaled_step(coef):
        torch._foreach_mul_([p.grad for p in params], coef)
        opt.step()

    def step():
        _, coef = grad_norm_and_clip_coef(params, max_norm)
        scaled_step(coef)
    return opt, step


def adam_step_ms(shapes: list[torch.Size]) -> float:
    """One optimizer step as the actor takes it (``optimizer_step("fused")``) on fp32 master
    parameters of ``shapes``."""
    params = [torch.zeros(s, device="cuda", dtype=torch.float32, requires_grad=True)
              for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt, step = optimizer_step("fused", params)
    try:
        return _median_ms(step, warmup=2, iters=5)
    finally:
        del params, opt, step
        _release()


def pcie_gb_per_s(gib: int = 2) -> dict[str, float]:
    """Copy rates between pinned host memory and the device, GB/s each way."""
    host = torch.empty(gib * 2 ** 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    try:
        rates = {}
        for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            ms = _median_ms(lambda: dst.copy_(src, non_blocking=True), warmup=2, iters=5)
            rates[name] = gib * 2 ** 30 / (ms / 1e3) / 1e9
        return rates
    finally:
        del host, dev
        _release()


def diffusers_images_per_s(model_dir: str, *, batch: int = 8, steps: int = 12,
                           height: int = 384, width: int = 384) -> float:
    pipe = QwenImagePipeline.from_pretrained(model_dir, torch_dtype=torch.bfloat16).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a photo of a red panda number 7 in a teacup"] * batch

    def generate():
        pipe(prompt=prompts, num_inference_steps=steps, height=height, width=width,
             output_type="pt")

    try:
        return batch / (_median_ms(generate, warmup=1, iters=3) / 1000.0)
    finally:
        del pipe
        _release()
