"""`python -m trainer launch`: preflight, then one rank per local GPU through torchrun's own
elastic launcher (torch.distributed.run); multi-node takes the same flags as torchrun
(--nnodes, --node-rank, --rdzv-endpoint). No home-made cluster manager.

    python -m trainer launch --config toy [--set section.key=value ...] [--rollout-batch-size 8]

A single CPU process (or --nproc 1 on one node) runs in this process without torchrun.

Every problem of the command line, the recipe and preflight's checks is reported in ONE
error (exit code 2). Rank 0 holds the run directory's lock for the run's life
(``trainer.rundir``); a run that stops for a known cause (run dir in use, a stalled run, an
engine that cannot be recovered, a checkpoint that cannot be trusted) prints one line naming
it and exits with code 1, without a traceback.

torch, the loop, the engine client and the checkpoint code are imported inside the functions
that need them: checking a command line and a config imports none of them (unless the device
or the GPU count has to be probed), so a bad command fails at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys

from trainer.compute.memory import print_memory_plan
from trainer.config import (Config, ConfigError, dump_toml, field_help, flag_table,
                            load_config)
from trainer.preflight import preflight
from trainer.preflight.imports import check_imports
from trainer.preflight.machine import device_problems
from trainer.rundir import RunDirError, RunDirLock, claim_run_dir
from trainer.watchdog import TrainingStalledError

_ARGV_ENV = "FLOWGRPO_LAUNCH_ARGV"


def parse_args(argv: list[str], problems_out: list[str] | None = None
               ) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(
        prog="python -m trainer launch",
        description="Launch FlowGRPO training. Short flags (e.g. --rollout-batch-size 8) "
                    "and --set section.key=value override the recipe.",
        epilog="Config fields and their flags:\n" + field_help(_recipe_named(argv)),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe TOML path or shipped name")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE")
    parser.add_argument("--dry-run", action="store_true",
                        help="resolve and preflight the config, print it, start nothing")
    args, rest = parser.parse_known_args(argv)
    flags, problems, table = {}, [], flag_table()
    i = 0
    while i < len(rest):
        tok = rest[i]
        key, eq, val = tok.partition("=")
        if key not in table:
            problems.append(f"unknown argument {tok!r}")
            i += 1
            continue
        if not eq:
            if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                val = rest[i + 1]
                i += 1
            else:
                val = "true"  # a bare boolean flag
        flags[key] = val
        i += 1
    if problems_out is not None:
        problems_out.extend(problems)
    elif problems:
        raise ConfigError(problems)
    return args, flags


def _recipe_named(argv: list[str]) -> str | None:
    """The --config of ``argv`` (for --help to show that recipe's values), if any."""
    for i, tok in enumerate(argv):
        if tok.startswith("--config="):
            return tok.split("=", 1)[1]
        if tok == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def resolve(argv: list[str], problems_out: list[str] | None = None
            ) -> tuple[Config, argparse.Namespace]:
    """The config of ``argv``; with ``problems_out``, problems are collected there (bad values
    left at their defaults) instead of raised."""
    args, flags = parse_args(argv, problems_out)
    return load_config(args.config, args.overrides, flags, problems_out=problems_out), args


def _device_kind(cfg: Config) -> str:
    if cfg.launch.device != "auto":
        return cfg.launch.device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        problems: list[str] = []
        cfg, args = resolve(argv, problems)  # a missing recipe still raises at once
        nproc = cfg.launch.nproc
        if nproc is None:
            import torch
            nproc = max(1, torch.cuda.device_count()) if _device_kind(cfg) == "cuda" else 1
        nnodes = int(str(cfg.launch.nnodes).split(":")[-1])
        if args.dry_run:  # from the config alone: printed even where the paths are placeholders
            print_memory_plan(cfg, world=nproc * nnodes)  # trainer.compute.memory
        try:  # preflight logs its own warnings
            preflight(cfg, world_size=nproc * nnodes, gpus_per_node=nproc,
                      device=_device_kind(cfg))
        except ConfigError as exc:
            problems += exc.problems
        problems += device_problems(device=_device_kind(cfg), nproc=nproc,
                                    nproc_given=cfg.launch.nproc is not None)
        if problems:
            raise ConfigError(problems)
        check_imports(cfg)  # second stage: every dotpath imported, every scorer option checked
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_toml(cfg))
        return 0
    if not (nproc == 1 and nnodes == 1) and cfg.launch.node_rank == 0:
        try:  # refuse before torchrun starts any rank; rank 0 takes the lock for real
            with RunDirLock(cfg.logging.run_dir):
                claim_run_dir(cfg, check_only=True)
        except RunDirError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if nproc == 1 and nnodes == 1:
        return rank_main(argv)
    from torch.distributed.run import get_args_parser, run
    # The ranks get our arguments through the environment: torchrun's own parser would
    # otherwise claim (or choke on prefixes of) flags such as --rdzv-endpoint or --nproc.
    os.environ[_ARGV_ENV] = json.dumps(argv)
    targs = get_args_parser().parse_args([
        f"--nproc-per-node={nproc}", f"--nnodes={cfg.launch.nnodes}",
        f"--node-rank={cfg.launch.node_rank}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={cfg.launch.rdzv_endpoint}", "--max-restarts=0",
        "-m", "trainer", "train"])
    run(targs)
    return 0


def free_port() -> int:
    """A TCP port free on this host now (rendezvous / MASTER_PORT on one machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(argv: list[str]) -> int:
    """One rank: init the process group (gloo on CPU, nccl on GPU), build and train."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not argv and _ARGV_ENV in os.environ:
        argv = json.loads(os.environ[_ARGV_ENV])
    cfg, _ = resolve([a for a in argv if a != "--dry-run"])
    import torch
    import torch.distributed as dist

    from trainer.loop import Trainer, seed_everything

    kind = _device_kind(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        # Always a process group, world 1 included: FSDP2 (and so mixed precision and the
        # fp32 master copies) applies the same way on one GPU as on eight.
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=rank,
                                world_size=world)
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    seed_everything(cfg.train.seed + rank)
    lock = trainer = None
    try:
        lock, cfg = _claim_on_rank0(cfg, rank)
        trainer = Trainer(cfg, rank=rank, world=world, device=device)
        if cfg.checkpoint.load:
            from trainer.checkpoint import load_checkpoint
            load_checkpoint(trainer, cfg.checkpoint.load)
        trainer.train()
        if dist.is_initialized() and world > 1:
            # every rank done with its collectives before any tears the group down (a rank
            # destroying gloo while its peer still talks can abort the peer at exit)
            dist.barrier()
    except _known_failures() as exc:
        print(f"error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        if lock is not None:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _claim_on_rank0(cfg: Config, rank: int):
    """Rank 0 locks the run dir and applies --resume/--overwrite; every rank gets its
    verdict (the lock, or None, and the resulting config)."""
    from trainer.utils.collectives import broadcast_from_rank0
    lock, ck, error = None, None, None
    if rank == 0:
        try:
            lock = RunDirLock(cfg.logging.run_dir).acquire()
            ck = claim_run_dir(cfg).checkpoint  # --load and, on --resume, --save may change
        except RunDirError as exc:
            error = str(exc)
            if lock is not None:
                lock.release()
                lock = None
    ck, error = broadcast_from_rank0((ck, error))
    if error is not None:
        raise RunDirError(error)
    return lock, dataclasses.replace(cfg, checkpoint=ck)


def _known_failures() -> tuple[type[BaseException], ...]:
    """Failures whose message says everything: reported in one line, exit code 1."""
    from trainer.checkpoint import CheckpointError, ContractMismatchError
    from trainer.engine.embedded.client import EngineError
    from trainer.rewards.base import RewardError
    return (RunDirError, CheckpointError, ContractMismatchError, EngineError,
            TrainingStalledError, RewardError)
