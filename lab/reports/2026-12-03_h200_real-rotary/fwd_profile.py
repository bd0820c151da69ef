"""Where the compiled B=8 forward's time goes; what a mask-free attention or another compile
mode would give. Ad-hoc experiment (not shipped)."""
import sys, time, statistics, collections
from pathlib import Path
sys.path.insert(0, "bench")
import torch
from bench_step import prepare_work
from floors import lora_transformer, text_tokens, _median_ms, _release

mode = sys.argv[1] if len(sys.argv) > 1 else "default"
_, model_dir = prepare_work("x", 8, False, Path("/tmp/bench_qwen8"))
T = text_tokens(str(model_dir))
print("text tokens", T, flush=True)
import torch._inductor.config as icfg
if mode == "autotune":
    icfg.max_autotune_gemm = True
if mode == "coord":
    icfg.coordinate_descent_tuning = True
adapter, model = lora_transformer(str(model_dir), 64, True)
if mode == "stock":
    from trainer.patches.diffusers_qwen_fast_paths import install_fast_paths
    install_fast_paths(False)
from floors import floor_step
fb = floor_step(adapter, model, 12, tokens=T)
print(f"[{mode}] LoRA fwd+bwd B=12: {_median_ms(fb, 3, 10):.2f} ms", flush=True)
B = 8
joint = adapter.transformer_config["joint_attention_dim"]
x = torch.randn((B, *adapter.latent_shape(384, 384)), device="cuda", dtype=torch.bfloat16)
sigma = torch.rand(B, device="cuda")
emb = torch.randn(B, T, joint, device="cuda", dtype=torch.bfloat16)
mask = torch.ones(B, T, dtype=torch.long, device="cuda")


def fwd(m):
    def f():
        with torch.no_grad():
            adapter.velocity(model, x, sigma, {"prompt_embeds": emb, "prompt_embeds_mask": m},
                             384, 384)
    return f

t0 = time.time()
fwd(mask)()
torch.cuda.synchronize()
print("first call s", round(time.time() - t0, 1), flush=True)
ms = _median_ms(fwd(mask), 3, 20)
print(f"[{mode}] fwd B=8 with mask: {ms:.2f} ms", flush=True)

# FLOPs per forward (matmuls only): per token per block 2 * (8*d*d + 2*2*d*4d)/2 streams
cfg = adapter.transformer_config
d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
L = cfg["num_layers"]
tok_img = x.shape[1]
per_tok = 2 * (4 * d * d + 2 * d * 4 * d)
flops = L * B * (tok_img + T) * per_tok + L * 4 * B * (tok_img + T) ** 2 * d
print(f"tokens img {tok_img} txt {T} d {d} L {L}: {flops/1e12:.2f} TFLOP -> {flops/ms/1e9:.0f} TFLOP/s",
      flush=True)

if mode in ("default", "stock"):
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fwd(mask)()
        torch.cuda.synchronize()
    cats = collections.Counter()
    names = collections.Counter()
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        n = e.name
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        low = n.lower()
        if any(k in low for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")):
            c = "gemm"
        elif any(k in low for k in ("fmha", "flash", "attention", "attn", "cudnn")):
            c = "attention"
        elif low.startswith("triton"):
            c = "triton"
        else:
            c = "other"
        cats[c] += us / 5
        names[n[:90]] += us / 5
    tot = sum(cats.values())
    print("per forward us:", {k: round(v) for k, v in cats.items()}, "total", round(tot))
    for n, v in names.most_common(18):
        print(f"{v:9.0f} us  {n}")
    # no mask: what the attention costs when SDPA may choose flash
    print(f"fwd B=8 no mask: {_median_ms(fwd(None), 3, 20):.2f} ms", flush=True)
