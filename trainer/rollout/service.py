"""``RolloutService``: one rank's rollout side as one handle: its engine, the weight sender into
it, the rollout drivers it serves, the policy version the engine holds, and the restart
budget. It starts its engine, and restarts it (``restart``: the old engine and sender ended,
new ones started, every attached driver re-pointed), so recovery
(``trainer.engine.recovery``) needs nothing but this handle and a way to re-send the weights.

``embedded_starter`` builds the start function of our embedded engine from its config
sections; an SGLang server is "started" by connecting to it (the loop hands
``trainer.engine.sglang.sync.connect_sglang`` in), and is not restarted (``restartable``).

Design choices:

* The drivers are kept across a restart (their seeds, which an eval over several seeds sets,
  and the last rollout's statistics, whose keys every rank must have alike for the metrics'
  all-reduce); only the engine they talk to changes.
* On the CPU the trainer and the engine time-share the cores: every start (a restart too)
  gives each process its share of OpenMP threads before the engine process is spawned, which
  inherits ``OMP_NUM_THREADS``.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

import torch

import ipc
from trainer.config import ModelConfig, RolloutConfig, WeightSyncConfig
from trainer.engine import launch_embedded_engine
from trainer.models.compile import compile_wanted

log = logging.getLogger("trainer")

#: Starts an engine: returns (engine client, weight sender or None).
EngineStarter = Callable[[], "tuple[Any, Any]"]


@functools.cache
def cpu_thread_budget() -> int:
    """The threads this process may use: an ``OMP_NUM_THREADS`` set before the run (a sweep
    running runs side by side gives each one thread), else the cores it may run on. Read once,
    because ``share_cpu_cores`` rewrites that variable and an engine restart calls it again."""
    preset = os.environ.get("OMP_NUM_THREADS", "")
    if preset.isdigit() and int(preset) > 0:
        return int(preset)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2


def share_cpu_cores(world: int) -> None:
    """Give the trainer and its engine process their half of this rank's thread budget."""
    threads = max(1, cpu_thread_budget() // (2 * world))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the engine process


def engine_warmup(rollout: RolloutConfig, compile: str, device: torch.device) -> dict | None:
    """The geometry of a training request, compiled before the first rollout (None: the
    engine does not compile, ``model.compile``)."""
    if not compile_wanted(compile, device):
        return None
    sampling = rollout.sampling
    warmup = {"height": int(sampling.height), "width": int(sampling.width),
              # CFG runs the conditional and the empty-prompt halves as one forward
              "batch": (rollout.wave_size or 1) * rollout.n_samples_per_prompt
              * (2 if float(sampling.guidance_scale) != 1.0 else 1)}
    if sampling.num_frames != 1:  # a video family compiles at its frame count, not at one frame
        warmup["frames"] = int(sampling.num_frames)
    return warmup


def embedded_starter(model: ModelConfig, rollout: RolloutConfig, weight_sync: WeightSyncConfig,
                     *, model_path: str, device: torch.device, lora: dict | None,
                     warmup: dict | None, share_trunk: bool = False,
                     flash_ratio: float | None = None) -> EngineStarter:
    """The start function of one embedded engine process and its weight sender.
    ``lora``: the engine's LoRA layers (adapter-mode sync), else None; ``warmup``: the
    geometry compiled before the first rollout, or None; ``share_trunk`` / ``flash_ratio``:
    the shared ODE trunk (Flow-GRPO-Fast, MixGRPO) and MixGRPO-Flash's tail
    (``trainer.engine.embedded.trunk``)."""
    def start() -> tuple[Any, Any]:
        send_end, recv_end = ipc.channel_pair()
        engine = launch_embedded_engine(
            adapter_path=model.adapter_path, model_path=model_path,
            adapter_options=model.adapter_options, device=str(device),
            dtype=rollout.engine_dtype, lora=lora, weight_sync_conn=recv_end,
            compile=model.compile, warmup=warmup,
            call_timeout_floor_s=rollout.engine_timeout_floor_s,
            call_timeout_per_image_s=rollout.engine_timeout_per_sample_s,
            share_trunk=share_trunk, flash_ratio=flash_ratio)
        sender = ipc.WeightSender(send_end, backend=weight_sync.backend,
                                  bucket_bytes=weight_sync.bucket_size_mb << 20,
                                  timeout_s=weight_sync.timeout_s)
        return engine, sender
    return start


def sync_metrics(stats: Any) -> dict[str, float]:
    """A weight sync's metrics from the sender's stats."""
    seconds = float(getattr(stats, "seconds", 0.0))
    gb = float(getattr(stats, "bytes", 0)) / 1e9
    out = {"weight_sync/seconds": seconds, "train/weight_sync_gb": gb,
           "weight_sync/gb_per_s": gb / seconds if seconds > 0 else 0.0,
           "train/weight_sync_tensors": float(getattr(stats, "tensors", 0)),
           "weight_sync/handle_opens": float(getattr(stats, "handle_opens", 0))}
    # where the sync's time goes: prepare (scan + manifest), begin (receiver's accept),
    # write (gathers + copy kernels + fence), commit (receiver's check)
    out.update({f"weight_sync/{k}_s": float(v)
                for k, v in (getattr(stats, "timings", None) or {}).items()})
    return out


class RolloutService:
    """One rank's engine, weight sender, drivers, policy version and restart budget."""

    def __init__(self, start: EngineStarter, *, rank: int, world: int, device: torch.device,
                 restartable: bool, max_restarts: int) -> None:
        self._start = start
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.restartable = restartable  # False: an SGLang server (not ours to restart)
        self.max_restarts = int(max_restarts)  # rollout.engine_max_restarts, all ranks
        self.restarts = 0        # engines restarted in this run, all ranks counted
        self.policy_version = 0  # the weights version the engine holds
        self.sync_failures = 0   # weight syncs that failed (the engine kept the old version)
        self.drivers: list[Any] = []
        self.engine, self.sender = None, None
        self._start_engine()

    def _start_engine(self) -> None:
        if self.device.type == "cpu":
            share_cpu_cores(self.world)
        self.engine, self.sender = self._start()

    def attach(self, driver: Any) -> Any:
        """Serve ``driver`` from this service's engine, now and after every restart."""
        driver.engines = [self.engine]
        self.drivers.append(driver)
        return driver

    def restart(self) -> None:
        """End this rank's engine and weight sender, start new ones (no re-sync here: the
        caller re-sends the weights), and point every attached driver at the new engine."""
        for part, end in ((self.engine, "kill"), (self.sender, "close")):
            if part is None:
                continue
            try:
                getattr(part, end)()
            except Exception as exc:  # the old engine is being replaced whatever state it is in
                log.warning("ending the failed engine's %s: %s", type(part).__name__, exc)
        self._start_engine()
        for driver in self.drivers:
            driver.engines = [self.engine]

    def push(self, version: int, payload: Callable[[], Any], *, mode: str, attempts: int,
             timer: Any, verify: bool) -> dict[str, float]:
        """Send ``payload()`` (the actor's weights) to the engine as policy ``version``, up to
        ``attempts`` times; the version advances only on success. ``verify``: compare the
        engine's own checksum of all its weights with the sent one afterwards (skipped where
        the sender verifies itself). Returns the sync's metrics ({} without a sender)."""
        if self.sender is None:
            return {}
        for attempt in range(attempts):
            try:
                with timer.stage("weight_sync"):
                    stats = self.sender.sync(version, payload(), mode=mode)
                if verify and not getattr(self.sender, "self_verifying", False):
                    with timer.stage("weight_sync/verify"):
                        got = self.engine.checksum()
                    if got != stats.checksum:
                        raise ipc.WeightSyncError(
                            "post-write", [f"engine checksum {got} != sent {stats.checksum} "
                                           "after commit"], version)
                self.policy_version = version
                return sync_metrics(stats)
            except ipc.WeightSyncError as exc:
                self.sync_failures += 1
                log.error("weight sync of version %d failed (attempt %d/%d): %s",
                          version, attempt + 1, attempts, exc)
                if attempt + 1 == attempts:
                    raise
        return {}

    def close(self) -> None:
        for part in (self.sender, self.engine):
            if part is not None:
                try:
                    part.close()
                except Exception as exc:  # closing must not mask the run's own error
                    log.warning("close failed: %s", exc)
