"""Shared pieces of the checkpoint tests (no tests of its own), and the torchrun worker of
the 2-rank resume test (``python -m torch.distributed.run ... tests/test_checkpoint_harness.py``).

The model is a tiny transformer-shaped ``nn.Module`` saved to disk (config.json +
weights) and loaded through an adapter, then wrapped exactly as the trainer does it
(``trainer.actor.model.build_actor``: peft LoRA, fully_shard per block then the root). The
"trainer" is the set of attributes the checkpoint code reads from ``trainer.loop.Trainer``,
without engines or rewards.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trainer.state import TrainerState  # noqa: E402


class TinyBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.to_q, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(torch.tanh(self.to_q(x)) * self.to_v(x))


class TinyNet(nn.Module):
    """Blocks of attention-named linears, so LoRA targets look like a real transformer's."""

    def __init__(self, dim: int = 16, num_blocks: int = 2):
        super().__init__()
        self.config = {"dim": dim, "num_blocks": num_blocks}
        self.blocks = nn.ModuleList(TinyBlock(dim) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def save_tinynet(root: Path, dim: int = 16, num_blocks: int = 2, seed: int = 0) -> Path:
    """A diffusers-layout directory (``transformer/``) holding a TinyNet (torch.save, so the
    GPU self-check needs nothing beyond torch)."""
    torch.manual_seed(seed)
    net = TinyNet(dim, num_blocks)
    tdir = Path(root) / "transformer"
    tdir.mkdir(parents=True, exist_ok=True)
    (tdir / "config.json").write_text(json.dumps(net.config))
    torch.save(net.state_dict(), tdir / "model.pt")
    return Path(root)


class TinyNetAdapter:
    """The adapter methods the actor builder calls (load, blocks, LoRA targets, and the blocks'
    dynamic inputs, which compiled blocks ask for on CUDA)."""

    def __init__(self, model_path: str | Path, **options):
        self.model_path = str(model_path)

    def load_train_model(self, *, dtype=torch.float32, device="cpu") -> nn.Module:
        tdir = Path(self.model_path) / "transformer"
        net = TinyNet(**json.loads((tdir / "config.json").read_text()))
        net.load_state_dict(torch.load(tdir / "model.pt", weights_only=True))
        return net.to(dtype=dtype, device=device)

    def transformer_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def lora_target_modules(self) -> list[str]:
        return ["to_q", "to_v"]

    def block_dynamic_dims(self, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
        return []  # fixed shapes: every input of a block keeps its size between calls


class DiffusersDirAdapter(TinyNetAdapter):
    """The same for a diffusers transformer saved under ``<model_path>/transformer``."""

    def load_train_model(self, *, dtype=torch.float32, device="cpu") -> nn.Module:
        import diffusers
        tdir = Path(self.model_path) / "transformer"
        cls = getattr(diffusers, json.loads((tdir / "config.json").read_text())["_class_name"])
        return cls.from_pretrained(str(tdir), torch_dtype=dtype).to(device)

    def transformer_blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.transformer_blocks)

    def lora_target_modules(self) -> list[str]:
        return ["to_q", "to_k", "to_v", "to_out.0"]


class FakeTrainer(TrainerState):
    """What ``trainer.loop.Trainer`` hands its checkpointer: a real ``Actor`` and the real
    ``TrainerState`` (counters and RNG), under the loop's own ``build_checkpointer``."""

    def __init__(self, cfg, adapter, model_path: str, *, rank: int = 0, world: int = 1,
                 device: str = "cpu"):
        from trainer.actor.actor import Actor
        from trainer.actor.model import build_actor, build_optimizer
        import torch.distributed as dist
        self.cfg, self.adapter, self.model_path = cfg, adapter, str(model_path)
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        model = build_actor(adapter, cfg.train, cfg.fsdp, cfg.lora, self.device,
                            distributed=dist.is_available() and dist.is_initialized(),
                            compile=cfg.model.compile)
        self.actor = Actor(adapter, model, build_optimizer(model, cfg.train), train=cfg.train,
                           fsdp=cfg.fsdp, device=self.device, trainable_only=cfg.lora.rank > 0)
        self.model, self.optimizer = model, self.actor.optimizer
        self.metrics = None

    @property
    def checkpointer(self):
        """Built on each use, so a test's later ``metrics`` stand-in is the one it logs to."""
        from trainer.loop import build_checkpointer
        return build_checkpointer(self.cfg, actor=self.actor, state=self, adapter=self.adapter,
                                  model_path=self.model_path, rank=self.rank, world=self.world,
                                  metrics=self.metrics)


def tiny_config(save_root: Path, model_path: Path, *, lora: bool, extra: list[str] = ()):
    from trainer.config import load_config
    sets = [f"checkpoint.save={save_root}", f"model.model_path={model_path}",
            f"logging.run_dir={Path(save_root) / 'run'}", "train.lr=0.05",
            "train.lr_warmup_iters=10", "train.weight_decay=0.01", "fsdp.param_dtype=fp32",
            "checkpoint.max_actor_ckpt_to_keep=2"]
    if lora:
        sets += ["lora.rank=4", "lora.alpha=8", "fsdp.trainable_mode=lora"]
    return load_config(None, sets + list(extra))


def make_trainer(model_path: Path, save_root: Path, *, lora: bool, rank: int = 0,
                 world: int = 1, extra: list[str] = (), adapter_cls=TinyNetAdapter,
                 device: str = "cpu") -> FakeTrainer:
    cfg = tiny_config(save_root, model_path, lora=lora, extra=extra)
    return FakeTrainer(cfg, adapter_cls(str(model_path)), str(model_path), rank=rank,
                       world=world, device=device)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def train_step(trainer: FakeTrainer) -> dict:
    """One optimizer step on RNG-driven data (torch CPU, the device's torch RNG, numpy and
    Python's random all feed it)."""
    from trainer.actor.model import inner_model, lr_at_step
    dim = inner_model(trainer.model).config["dim"]
    x = torch.randn(4, dim).to(trainer.device) + torch.randn(4, dim, device=trainer.device)
    scale = float(np.random.uniform(0.5, 1.5))
    shift = random.random()
    loss = (trainer.model(x) * scale - shift).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in trainer.model.parameters() if p.requires_grad],
                                   trainer.cfg.train.clip_grad)
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr_at_step(trainer.lr_steps, trainer.cfg.train)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.lr_steps += 1
    trainer.policy_version += 1
    trainer.next_rollout += 1
    return {"loss": loss.detach(), "sample": x, "scale": scale, "shift": shift}


def trainable_weights(trainer: FakeTrainer) -> dict[str, torch.Tensor]:
    """Full (gathered) copies of every trainable tensor; a collective under FSDP2."""
    out = {}
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            t = p.detach()
            out[n] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


# ---- crash test child --------------------------------------------------------------------
def expected_weight(n: int, index: int, shape: torch.Size) -> torch.Tensor:
    return torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) * 1e-3 \
        + n + 100 * index


def crash_child(model_path: str, save_root: str, log_path: str) -> None:
    """Save iterations n, n+1, ... forever (weights a function of n) until SIGKILLed;
    resumes first from the newest committed checkpoint, as a restarted run would."""
    torch.set_num_threads(1)
    from trainer.checkpoint import latest_committed, load_checkpoint, save_checkpoint
    trainer = make_trainer(Path(model_path), Path(save_root), lora=False)
    if latest_committed(save_root) is not None:
        load_checkpoint(trainer.checkpointer, save_root)
    n = trainer.next_rollout
    with open(log_path, "a", buffering=1) as log:
        log.write(f"start {n}\n")
        while True:
            n += 1
            with torch.no_grad():
                for i, p in enumerate(trainer.model.parameters()):
                    p.copy_(expected_weight(n, i, p.shape))
            trainer.next_rollout = trainer.policy_version = trainer.lr_steps = n
            if save_checkpoint(trainer.checkpointer, n) is None:
                raise RuntimeError(f"save {n} failed")
            log.write(f"saved {n}\n")


# ---- torchrun worker of the 2-rank resume test -------------------------------------------
RESUME_STEPS = 3  # steps before the save; the compared step is RESUME_STEPS + 1
MODES = {"full": (False, []), "lora": (True, ["fsdp.activation_checkpointing=true",
                                              "fsdp.param_dtype=bf16"])}


def available_modes() -> list[str]:
    """LoRA needs peft (absent on the bare GPU machine: only the full mode runs there)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return ["full"]
    return list(MODES)


def _failure_injection(trainer: FakeTrainer, step: int) -> dict:
    """A write failing on rank 1 only, then a rotation failing on rank 0 only."""
    import trainer.checkpoint.layout as layout_mod
    import trainer.checkpoint.save as save_mod
    from trainer.checkpoint import CheckpointError, save_checkpoint
    out = {}
    real_write_rng, real_remove = save_mod.write_rng, layout_mod.remove_tree
    if trainer.rank == 1:
        def failing_write_rng(*a, **k):
            raise OSError("injected: disk full")
        save_mod.write_rng = failing_write_rng
    try:
        out["failed_save_returned"] = str(save_checkpoint(trainer.checkpointer, step))
        out["failures_after_write_error"] = trainer.checkpoint_failures
    finally:
        save_mod.write_rng = real_write_rng
    from trainer.checkpoint.save import checkpoint_root
    cfg = trainer.cfg
    task_dir = checkpoint_root(cfg.checkpoint.save, cfg.logging.run_dir) / cfg.model.task
    if trainer.rank == 0:  # rank 0 removed the partial save before returning
        out["partial_dir_left"] = (task_dir / layout_mod.iter_name(step)).exists()
        (task_dir / layout_mod.iter_name(step)).mkdir()  # a crash leftover to rotate away
        def failing_remove(path):
            raise PermissionError(f"injected: cannot remove {path}")
        layout_mod.remove_tree = failing_remove
    try:
        save_checkpoint(trainer.checkpointer, step + 1)
        out["rotation_error"] = None
    except CheckpointError as exc:
        out["rotation_error"] = str(exc)
    finally:
        layout_mod.remove_tree = real_remove
    return out


def worker_main(argv: list[str]) -> int:
    """torchrun entry: ``reference|resume OUT MODEL [cpu|cuda]``."""
    import torch.distributed as dist
    from trainer.actor.model import offload_actor, onload_actor
    from trainer.checkpoint import load_checkpoint, save_checkpoint
    phase, out_dir, model_path = argv[0], Path(argv[1]), Path(argv[2])
    device = argv[3] if len(argv) > 3 else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for mode in available_modes():
        lora, extra = MODES[mode]
        root = out_dir / f"ckpt_{mode}"
        t0 = time.perf_counter()
        trainer = make_trainer(model_path, root, lora=lora, rank=rank, world=world, extra=extra,
                               device=device)
        seed_all((100 if phase == "reference" else 9000) + rank)
        if phase == "reference":
            for _ in range(RESUME_STEPS):
                train_step(trainer)
            actor = trainer.actor
            if trainer.device.type == "cuda":  # as the loop leaves it with --offload-train
                actor.offloaded = offload_actor(actor.model, actor.optimizer)
            with actor.onloaded():  # as the loop saves
                saved = save_checkpoint(trainer.checkpointer, RESUME_STEPS)
            assert saved is not None, "reference save failed"
            if actor.offloaded is not None:
                onload_actor(actor.model, actor.optimizer, actor.offloaded)
                actor.offloaded = None
        else:
            load_checkpoint(trainer.checkpointer, root)
        state = {"policy_version": trainer.policy_version, "lr_steps": trainer.lr_steps,
                 "next_rollout": trainer.next_rollout}
        record = train_step(trainer)
        record.update(state, weights=trainable_weights(trainer))
        record = {k: v.cpu() if torch.is_tensor(v) else v for k, v in record.items()}
        record["weights"] = {k: v.cpu() for k, v in record["weights"].items()}
        torch.save(record, out_dir / f"{phase}_{mode}_rank{rank}.pt")
        if phase == "reference" and mode == "full" and world == 2:
            report.update(_failure_injection(trainer, RESUME_STEPS + 2))
        report[f"{mode}_seconds"] = time.perf_counter() - t0
    (out_dir / f"{phase}_report_rank{rank}.json").write_text(json.dumps(report))
    # both ranks leave the group together: a rank that tears down while its peer is still in
    # a collective can abort ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_phases(out_dir: Path, model_dir: Path, *, nproc: int = 2, device: str = "cpu",
               timeout: float = 420) -> None:
    """Both phases, each a fresh ``torch.distributed.run`` of this file."""
    import subprocess
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), str(repo / "tests")]),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for phase in ("reference", "resume"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(nproc), str(Path(__file__).resolve()), phase, str(out_dir), str(model_dir),
               device]
        proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{phase} phase failed:\n{(proc.stdout + proc.stderr)[-6000:]}")


def compare_runs(out_dir: Path, nproc: int = 2) -> list[str]:
    """Every difference between the uninterrupted and the resumed step K+1 (empty: none)."""
    problems = []
    modes = sorted({p.name.split("_")[1] for p in out_dir.glob("resume_*_rank0.pt")})
    if not modes:
        return ["no resumed run found"]
    for mode in modes:
        for rank in range(nproc):
            ref = torch.load(out_dir / f"reference_{mode}_rank{rank}.pt", weights_only=False)
            got = torch.load(out_dir / f"resume_{mode}_rank{rank}.pt", weights_only=False)
            where = f"{mode} rank {rank}"
            counters = (got["next_rollout"], got["policy_version"], got["lr_steps"])
            if counters != (RESUME_STEPS,) * 3:
                problems.append(f"{where}: restored counters {counters}")
            for key in ("loss", "sample"):
                if not torch.equal(ref[key], got[key]):
                    problems.append(f"{where}: {key} differs")
            if (ref["scale"], ref["shift"]) != (got["scale"], got["shift"]):
                problems.append(f"{where}: numpy/python RNG draws differ")
            if ref["weights"].keys() != got["weights"].keys():
                problems.append(f"{where}: trainable tensors differ")
            problems += [f"{where}: weight {k} differs" for k in ref["weights"]
                         if k in got["weights"] and not torch.equal(ref["weights"][k],
                                                                     got["weights"][k])]
        if nproc > 1:
            r0 = torch.load(out_dir / f"resume_{mode}_rank0.pt", weights_only=False)
            r1 = torch.load(out_dir / f"resume_{mode}_rank1.pt", weights_only=False)
            if torch.equal(r0["sample"], r1["sample"]):
                problems.append(f"{mode}: ranks drew identical samples (per-rank RNG lost)")
    return problems


def self_check(device: str, nproc: int) -> int:
    """``python tests/test_checkpoint_harness.py selfcheck cuda 2``: the resume check on GPUs
    (nccl, CUDA RNG, offloaded actor) without pytest."""
    import tempfile
    out = Path(tempfile.mkdtemp(prefix="ckpt_selfcheck_"))
    model_dir = save_tinynet(out / "model")
    t0 = time.perf_counter()
    run_phases(out, model_dir, nproc=nproc, device=device)
    problems = compare_runs(out, nproc)
    modes = sorted({p.name.split("_")[1] for p in out.glob("resume_*_rank0.pt")})
    print(f"checkpoint resume self-check on {nproc} x {device} (torch {torch.__version__}), "
          f"modes {modes}: {'OK, bit-exact' if not problems else 'FAILED'} "
          f"in {time.perf_counter() - t0:.1f}s")
    for p in problems:
        print("  -", p)
    return 1 if problems else 0


if __name__ == "__main__":
    if sys.argv[1] == "selfcheck":
        sys.exit(self_check(sys.argv[2], int(sys.argv[3])))
    code = worker_main(sys.argv[1:])
    if code == 0:
        # Everything is written and the group destroyed: leave without the interpreter's
        # teardown, where a gloo thread still joinable at exit can make the C++ runtime abort
        # ("terminate called without an active exception", SIGABRT) under a loaded CPU after
        # the phase succeeded (tests/test_sync_gather.py leaves the same way).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)
