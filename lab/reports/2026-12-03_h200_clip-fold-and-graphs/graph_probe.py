"""Ad-hoc probe (not shipped): (1) the optimizer step over the full model's fp32 shapes with
the clip scaled first vs folded into fused AdamW (grad_scale), alternating, same process;
(2) the engine-like no-grad forward at B=8: synced per call, 12 back to back (the denoise
loop), its kernel sum, and the same forward replayed from a CUDA graph."""
import collections
import sys
from pathlib import Path

sys.path[:0] = ["bench", "."]
import torch
from bench_step import prepare_work
from floors import _median_ms, _release, adam_step_ms, lora_transformer, text_tokens

_, model_dir = prepare_work("x", 8, False, Path("/tmp/bench_qwen8"))
model_dir = str(model_dir)
T = text_tokens(model_dir)
print("text tokens", T, flush=True)

adapter, model = lora_transformer(model_dir, 0, False)
full_shapes = [p.shape for p in model.parameters()]
print("full params", sum(s.numel() for s in full_shapes) / 1e9, "B", flush=True)
del model
_release()
for fold in (False, True, False, True):
    print(f"adam full fold_clip={fold}: {adam_step_ms(full_shapes, fold_clip=fold):.2f} ms",
          flush=True)

adapter, model = lora_transformer(model_dir, 0, True)
model.requires_grad_(False)
B = 8
joint = adapter.transformer_config["joint_attention_dim"]
x = torch.randn((B, *adapter.latent_shape(384, 384)), device="cuda", dtype=torch.bfloat16)
sigma = torch.rand(B, device="cuda")
cond = {"prompt_embeds": torch.randn(B, T, joint, device="cuda", dtype=torch.bfloat16),
        "prompt_embeds_mask": torch.ones(B, T, dtype=torch.long, device="cuda")}


def fwd():
    with torch.no_grad():
        return adapter.velocity(model, x, sigma, cond, 384, 384)


def loop12():
    for _ in range(12):
        fwd()


fwd()
torch.cuda.synchronize()
synced = _median_ms(fwd, 3, 20)
b2b = _median_ms(loop12, 2, 7) / 12
print(f"fwd B=8 synced per call: {synced:.2f} ms; 12 back to back: {b2b:.2f} ms/forward",
      flush=True)

from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CUDA]) as prof:
    loop12()
    torch.cuda.synchronize()
cats = collections.Counter()
for e in prof.events():
    if e.device_type.name == "CUDA":
        cats["all"] += (e.device_time if hasattr(e, "device_time") else e.cuda_time) / 12
print(f"kernel sum per forward (12 back to back): {cats['all'] / 1000:.2f} ms", flush=True)

try:
    ref = fwd().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fwd()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fwd()
    graph.replay()
    torch.cuda.synchronize()
    print("graph output max abs diff vs eager:", float((out.float() - ref.float()).abs().max()),
          "bitwise equal:", torch.equal(out, ref), flush=True)
    g1 = _median_ms(graph.replay, 3, 20)
    g12 = _median_ms(lambda: [graph.replay() for _ in range(12)], 2, 7) / 12
    print(f"graph replay: synced {g1:.2f} ms; 12 back to back {g12:.2f} ms/forward", flush=True)
except Exception as exc:  # noqa: BLE001 - a probe: report and go on
    print("CUDA graph capture failed:", type(exc).__name__, str(exc)[:400], flush=True)
