"""The peer: one FlowGRPO step written the plain way, as the Flow-GRPO reference structures it.

In one process, eager torch, no engine, no IPC, no compile: the diffusers parts of the model
directory (text encoder, transformer, VAE) with a peft LoRA on the transformer; a sampling loop
that records each trained step's latents and the eager SDE log-prob (the torch reference
formulas); the VAE decode; the same JPEG reward on the CPU; group-normalised advantages; then,
for each optimizer update, each micro-batch and each trained step, one eager forward + backward
under bf16 autocast with the fp32 LoRA weights, and fused AdamW. pi_old is the sampler's
log-prob. Same model, sizes, LoRA and schedule as bench_step.py's trainer rows.

``--strong``: the same algorithm written the fast way a careful user would (issue 50 item 3):
every transformer block under torch.compile, the trained steps of a micro-batch batched into
one forward + backward (rows = samples x steps: the same loss, summed the same way), and the
best attention kernel diffusers offers here (``best_attention_backend``).

    python bench/peer_step.py --model-dir DIR [--micro-batch 4] [--updates 2] [--rollouts 3] [--strong]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from flowgrpo_kernels.sde_reference import sde_log_prob_ref, sde_step_ref  # noqa: E402
from record_rows import record_peer  # noqa: E402
from trainer.patches.diffusers_qwen_fast_paths import install_fast_paths  # noqa: E402
from trainer.models.qwen_image import QwenImageAdapter  # noqa: E402
from trainer.models.geometry import Geometry  # noqa: E402
from trainer.rewards.jpeg import jpeg_kilobytes  # noqa: E402

QWEN_LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                     "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]


def _sync() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


#: diffusers attention backends, fastest first where each exists (FlashAttention 3 on Hopper,
#: FlashAttention 2, cuDNN's fused attention through torch).
_ATTENTION_PREFERENCE = ("_flash_3", "flash", "_native_cudnn")


def best_attention_backend(device: str) -> str | None:
    """The first of ``_ATTENTION_PREFERENCE`` that diffusers can run here; None on the CPU or
    when none can (diffusers' default then)."""
    from trainer.models.diffusers_base import check_attention_backend

    if not str(device).startswith("cuda"):
        return None
    for name in _ATTENTION_PREFERENCE:
        try:
            check_attention_backend(name, "peer")
        except ValueError:
            continue
        return name
    return None


class PeerLoop:
    def __init__(self, model_dir: str, *, height: int = 384, width: int = 384, steps: int = 12,
                 sde_indices=(3, 4, 5), eta: float = 0.7, rank: int = 64, lr: float = 3e-4,
                 eps_clip: float = 1e-4, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 strong: bool = False, compile_backend: str = "inductor") -> None:
        self.device, self.dtype, self.strong = device, dtype, strong
        self.attention_backend = best_attention_backend(device) if strong else None
        self.adapter = QwenImageAdapter(model_dir, attention_backend=self.attention_backend)
        self.frozen = self.adapter.load_frozen(device=device, dtype=dtype)
        model = self.adapter.load_train_model(dtype=dtype, device=device)
        model.requires_grad_(False)
        self.model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                      target_modules=QWEN_LORA_TARGETS))
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            p.data = p.data.float()  # fp32 trainable weights, bf16 autocast compute
        self.optimizer = torch.optim.AdamW(params, lr=lr, fused=str(device).startswith("cuda"))
        if strong:
            for block in self.adapter.transformer_blocks(self.model):
                block.compile(backend=compile_backend)
        self.params = params
        self.geometry, self.steps = Geometry(height, width), steps
        self.sde, self.eta, self.eps = list(sde_indices), eta, eps_clip
        self.sigmas = self.adapter.scheduler_sigmas(steps, self.geometry).to(device)

    @torch.no_grad()
    def sample(self, prompts: list[str], seed: int):
        cond = self.adapter.encode_prompts(self.frozen, prompts)
        gen = torch.Generator(self.device).manual_seed(seed)
        shape = (len(prompts), *self.adapter.init_noise_shape(self.geometry))
        x = self.adapter.noise_to_latents(torch.randn(shape, generator=gen, device=self.device),
                                          self.geometry)
        xs, nexts, logps = [], [], []
        n = len(prompts)
        with self._autocast():
            for i in range(self.steps):
                s, s_next = self.sigmas[i].expand(n), self.sigmas[i + 1].expand(n)
                v = self.adapter.velocity(self.model, x, s, cond, self.geometry).float()
                if i in self.sde:
                    noise = torch.randn(x.shape, generator=gen, device=self.device)
                    x_next, logp, _, _ = sde_step_ref(x, v, s, s_next, eta=self.eta,
                                                      sde_type="sde", noise=noise)
                    xs.append(x)
                    nexts.append(x_next)
                    logps.append(logp)
                else:
                    x_next = x + v * (s_next - s).view(-1, *([1] * (x.dim() - 1)))
                x = x_next
        images = self.adapter.decode(self.frozen, x, self.geometry)
        return cond, torch.stack(xs, 1), torch.stack(nexts, 1), torch.stack(logps, 1), images

    def _autocast(self):
        return torch.autocast(torch.device(self.device).type, self.dtype,
                              enabled=self.dtype != torch.float32)

    def train(self, cond, xs, nexts, old, adv, micro_batch: int, updates: int) -> None:
        n = xs.shape[0]
        order = torch.randperm(n)
        per_update = n // updates
        for u in range(updates):
            self.accumulate(cond, xs, nexts, old, adv, order[u * per_update:(u + 1) * per_update],
                            micro_batch)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def accumulate(self, cond, xs, nexts, old, adv, rows_u, micro_batch: int) -> float:
        """Gradients of one update's rows into .grad; its loss (host float: one sync, at the end)."""
        total = torch.zeros((), device=self.device)
        scale = 1.0 / (len(rows_u) * len(self.sde))  # the mean over the update's transitions
        for rows in rows_u.split(micro_batch):
            c = {k: v[rows] for k, v in cond.items()}
            if self.strong:  # every trained step of the micro-batch as rows of one forward
                loss = self._loss(c, xs[rows], nexts[rows], old[rows], adv[rows], self.sde)
                (loss * scale).backward()
                total += loss.detach() * scale
                continue
            for j, i in enumerate(self.sde):  # one forward + backward per trained step
                loss = self._loss(c, xs[rows, j:j + 1], nexts[rows, j:j + 1], old[rows, j:j + 1],
                                  adv[rows], [i])
                (loss * scale).backward()
                total += loss.detach() * scale
        return float(total)

    def _loss(self, cond, xs, nexts, old, adv, steps: list[int]):
        """Sum of the clipped objective over rows x ``steps`` ([rows, len(steps), ...] inputs)."""
        m, k = xs.shape[:2]
        s = torch.stack([self.sigmas[i] for i in steps]).repeat(m)
        s_next = torch.stack([self.sigmas[i + 1] for i in steps]).repeat(m)
        c = {key: v.repeat_interleave(k, 0) for key, v in cond.items()}
        x, x_next = xs.reshape(m * k, *xs.shape[2:]), nexts.reshape(m * k, *xs.shape[2:])
        with self._autocast():
            v = self.adapter.velocity(self.model, x, s, c, self.geometry)
        logp = sde_log_prob_ref(x, v.float(), x_next, s, s_next, eta=self.eta, sde_type="sde")
        ratio = torch.exp(logp - old.reshape(-1))
        a = adv.repeat_interleave(k)
        return torch.maximum(-a * ratio, -a * ratio.clamp(1 - self.eps, 1 + self.eps)).sum()

    def step(self, prompts: list[str], seed: int, micro_batch: int, updates: int) -> dict:
        t0 = _sync()
        cond, xs, nexts, old, images = self.sample(prompts, seed)
        t1 = _sync()
        reward = jpeg_kilobytes(images).to(self.device)
        adv = (reward - reward.mean()) / (reward.std() + 1e-4)
        t2 = _sync()
        self.train(cond, xs, nexts, old, adv, micro_batch, updates)
        t3 = _sync()
        return {"step": t3 - t0, "rollout": t1 - t0, "reward": t2 - t1, "train": t3 - t2}


def run_peer(model_dir: str, *, micro_batch: int, updates: int, rollouts: int,
             samples: int = 8, strong: bool = False) -> dict:
    loop = PeerLoop(model_dir, strong=strong)
    # stock diffusers, as the reference runs it: the adapter that loaded the model installs
    # the trainer's faster paths (trainer/patches/diffusers_qwen_fast_paths.py), process-wide
    install_fast_paths(False)
    torch.cuda.reset_peak_memory_stats()
    times = [loop.step([f"a photo of a red panda number {r} in a teacup"] * samples, seed=r,
                       micro_batch=micro_batch, updates=updates) for r in range(rollouts)]
    keep = times[1:] or times
    out = {k: statistics.median(t[k] for t in keep) for k in keep[0]}
    out["train_ms_per_transition"] = 1000 * out["train"] / (samples * len(loop.sde))
    out["peak_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
    out.update(micro_batch=micro_batch, updates=updates, strong=strong,
               attention_backend=loop.attention_backend)
    del loop
    torch.cuda.empty_cache()
    install_fast_paths(True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--strong", action="store_true",
                   help="compiled blocks, batched trained steps, the best attention kernel")
    a = p.parse_args()
    peer = run_peer(a.model_dir, micro_batch=a.micro_batch, updates=a.updates,
                    rollouts=a.rollouts, strong=a.strong)
    print(peer)
    record_peer(peer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
