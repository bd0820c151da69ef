"""Host and device time of one transformer block's gradient copy-in at one rank: torch._chunk_cat
(FSDP2's) against one torch._foreach_copy_ into slices of the buffer (trainer/patches/fsdp_grad_copy_in.py).
block_shapes.txt: the parameter shapes of one QwenImageTransformer2DModel block of bench_step.py's
model (340 M elements). Median of 10 after 3 warm-up calls."""
import ast, time, torch
from pathlib import Path
shapes = ast.literal_eval(Path(__file__).with_name("block_shapes.txt").read_text())
dev = "cuda"
def run(src_dtype):
    grads = [torch.randn(s, device=dev, dtype=src_dtype) for s in shapes]
    n = sum(g.numel() for g in grads)
    out1 = torch.empty(n, device=dev, dtype=torch.float32)
    out2 = torch.empty_like(out1)
    def chunk():
        torch._chunk_cat(grads, 0, 1, out=out1.view(1, -1))
    views, off = [], 0
    for g in grads:
        views.append(out2[off:off + g.numel()].view(g.shape)); off += g.numel()
    def foreach():
        torch._foreach_copy_(views, grads)
    for name, fn in (("chunk_cat", chunk), ("foreach_copy", foreach)):
        for _ in range(3): fn()
        torch.cuda.synchronize()
        host, dev_ms = [], []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter(); s.record(); fn(); e.record(); host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize(); dev_ms.append(s.elapsed_time(e))
        host.sort(); dev_ms.sort()
        print(f"{src_dtype} -> fp32 {name}: host {host[5]:.3f} ms, device {dev_ms[5]:.3f} ms "
              f"({n * (4 + grads[0].element_size()) / dev_ms[5] / 1e6:.0f} GB/s)")
    print("equal:", torch.equal(out1, out2))
run(torch.float32); run(torch.bfloat16)
