"""The training loop: rollout -> reward -> advantages -> replay/update -> weight sync -> eval.

One ``Trainer`` per rank (N ranks = N GPUs, or one CPU process). Rank j owns engine j on its
own device; each rank generates its own groups (rollout_batch_size / world of them), scores
them, and trains on them, so no trajectory crosses ranks and nothing round-trips through disk.
The only cross-rank traffic is FSDP's own collectives, a handful of scalar all-reduces
(batch-std advantages, the micro-batch-count check, metrics) and nothing else.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import ipc
from trainer.actor.model import (PendingOnload, build_actor, build_optimizer, lora_spec,
                                 offload_actor, onload_actor, shard_actor, strip_wrapper_names)
from trainer.actor.colocate import Footprint, OffloadPolicy, actor_footprint
from trainer.actor.sync import sync_payload
from trainer.actor.update import train_on
from trainer.algorithms import algorithm_noise_steps, training_sampling
from trainer.algorithms.nft_step import nft_train_on
from trainer.checkpoint import save_checkpoint
from trainer.checkpoint.trained import worth_saving
from trainer.config import Config, write_resolved
from trainer.ema import build_ema
from trainer.engine import launch_embedded_engine
from trainer.engine.recovery import call_with_recovery
from trainer.engine.sglang.sync import connect_sglang
from trainer.evaluation import eval_sampling, eval_weights
from trainer.utils.host_gc import HostGarbageCollection, resolve_gc_mode
from trainer.metrics import MetricsLogger, step_metrics
from trainer.compute.mfu import trainer_mfu
from trainer.models.compile import compile_events, compile_wanted
from trainer.profiling import ComputeMeter, ProfileWindow, StageTimer, add_times, nvtx_range
from trainer.progress import RunProgress
from trainer.prompts import PromptSampler, load_records
from trainer.rewards import build_reward_manager_from_config, compute_advantages
from trainer.rollout import RolloutDriver
from trainer.state import TrainerState
from trainer.toy import weights_dir
from trainer.utils.values import import_dotpath
from trainer.visuals import log_pictures, log_samples, pick_samples
from trainer.watchdog import check_progress

log = logging.getLogger("trainer")


def resolve_model_path(cfg: Config) -> str:
    if cfg.model.model_path == "toy":
        return str(weights_dir())
    return cfg.model.model_path


class Trainer(TrainerState):
    """One rank's run: actor, engine, rollout driver, rewards, the loop. Its counters and
    RNG are ``TrainerState`` (``state_dict`` / ``load_state_dict``, what checkpoints save)."""

    def __init__(self, cfg: Config, *, rank: int = 0, world: int = 1,
                 device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.distributed = dist.is_available() and dist.is_initialized()
        self.run_dir = Path(cfg.logging.run_dir)
        if rank == 0:
            write_resolved(cfg, self.run_dir)
        self.timer = StageTimer(sync=self.device.type == "cuda")
        self.meter = ComputeMeter()  # model compute inside the step (perf/compute/*)
        # named parts of what lies outside it (perf/outside/*): grad clip + optimizer steps
        self.outside = ComputeMeter()
        self.profile = ProfileWindow(cfg.logging.profile_steps)
        self.metrics = MetricsLogger(self.run_dir, enabled=rank == 0,
                                     tensorboard=cfg.logging.tensorboard,
                                     wandb=cfg.logging.wandb,
                                     wandb_project=cfg.logging.wandb_project,
                                     config=cfg.to_dict())
        self.model_path = resolve_model_path(cfg)
        self.adapter = import_dotpath(cfg.model.adapter_path)(self.model_path,
                                                              **cfg.model.adapter_options)
        self.model = self._load_in_waves()
        self.optimizer = build_optimizer(self.model, cfg)
        self.ema = build_ema(self.model, cfg)
        self.offloaded = None
        self.state_stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda"
                             and cfg.fsdp.overlap_state_onload else None)
        self.auto_micro_batch: int | None = None  # train.micro_batch_size=auto, once resolved
        self.recompile_streak = 0  # consecutive steps that compiled something
        self.colocate = OffloadPolicy(cfg.fsdp.offload_policy,
                                      offload_rollout=cfg.rollout.offload_rollout,
                                      offload_train=cfg.fsdp.offload_train, device=self.device)
        self.host_gc = HostGarbageCollection(resolve_gc_mode(cfg.train.gc, self.device))
        self._build_data()
        self._build_engine()
        self._build_reward()
        self.sync_weights(first=True)

    # ---- construction -----------------------------------------------------------------
    def _load_in_waves(self):
        """--fsdp-load-wave-size N: only N ranks materialise the base model at a time (a
        barrier between waves) to bound host memory and model-directory read contention."""
        wave = self.cfg.fsdp.load_wave_size
        if not self.distributed or wave <= 0 or wave >= self.world:
            return build_actor(self.adapter, self.cfg, self.device, self.distributed)
        model = None
        for start in range(0, self.world, wave):
            if start <= self.rank < start + wave:
                model = build_actor(self.adapter, self.cfg, self.device, self.distributed,
                                    shard=False)
            dist.barrier()
        return shard_actor(model, self.adapter, self.cfg)


    def _build_data(self) -> None:
        cfg = self.cfg
        self.sampler = PromptSampler(load_records(cfg.data.prompt_data, seed=cfg.train.seed),
                                     cfg.rollout.rollout_seed)
        self.eval_records = []
        if cfg.data.eval_prompt_data:
            recs = load_records(cfg.data.eval_prompt_data, seed=cfg.train.seed,
                                limit=cfg.data.eval_max_prompts)
            self.eval_records = recs[self.rank::self.world]
        if cfg.rollout.rollout_batch_size % self.world:
            raise ValueError(f"--rollout-batch-size {cfg.rollout.rollout_batch_size} is not "
                             f"divisible by the world size {self.world}")
        self.groups_per_rank = cfg.rollout.rollout_batch_size // self.world

    def _build_engine(self) -> None:
        cfg = self.cfg
        self.sender = None
        if self.device.type == "cpu":
            # NOTE: trainer and engine time-share the cores; with both processes spinning
            # OpenMP threads over all of them, a tiny forward ran many times slower (figures:
            # bench/reports/2026-12-04_cpu-h200_comment-figures.md).
            threads = max(1, (os.cpu_count() or 2) // (2 * self.world))
            torch.set_num_threads(threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the engine process
        if cfg.rollout.engine == "sglang":
            self.engine, self.sender = connect_sglang(cfg, self.rank, self.run_dir,
                                                      self.adapter)
        else:
            send_end, recv_end = ipc.channel_pair()
            self.engine = launch_embedded_engine(
                adapter_path=cfg.model.adapter_path, model_path=self.model_path,
                adapter_options=cfg.model.adapter_options, device=str(self.device),
                dtype=cfg.rollout.engine_dtype, lora=lora_spec(cfg, self.adapter)
                if cfg.sync_mode == "adapter" else None,
                weight_sync_conn=recv_end, compile=cfg.model.compile,
                warmup=self._engine_warmup(),
                call_timeout_floor_s=cfg.rollout.engine_timeout_floor_s,
                call_timeout_per_image_s=cfg.rollout.engine_timeout_per_sample_s,
                share_trunk=cfg.train.algorithm in ("flowgrpo_fast", "mixgrpo"),
                flash_ratio=cfg.train.mix_flash_ratio if cfg.train.algorithm == "mixgrpo" else None)
            self.sender = ipc.WeightSender(send_end, backend=cfg.weight_sync.backend,
                                           bucket_bytes=cfg.weight_sync.bucket_size_mb << 20,
                                           timeout_s=cfg.weight_sync.timeout_s)
        artifact_root = cfg.rollout.artifact_root or str(self.run_dir / "artifacts")
        self.driver = RolloutDriver(
            self.adapter, [self.engine], sampling=training_sampling(cfg),
            seed=cfg.rollout.generation_seed, task=cfg.model.task,
            artifact_root=artifact_root if cfg.rollout.write_artifacts and self.rank == 0
            else None, retention=cfg.rollout.artifact_retention_rollouts,
            wave_size=cfg.rollout.wave_size,
            sample_id_mode=cfg.rollout.sampling.sample_id_mode,
            noise_steps=algorithm_noise_steps(
                cfg.train, seed=cfg.rollout.generation_seed,
                num_inference_steps=cfg.rollout.sampling.num_inference_steps))
        self.eval_driver = RolloutDriver(
            self.adapter, [self.engine], sampling=eval_sampling(cfg),
            seed=cfg.rollout.generation_seed, task=cfg.model.task, wave_size=cfg.rollout.wave_size,
            sample_id_mode=cfg.rollout.sampling.sample_id_mode)

    def _engine_warmup(self) -> dict | None:
        """The geometry of a training request, compiled before the first rollout."""
        if not compile_wanted(self.cfg.model.compile, self.device):
            return None
        r = self.cfg.rollout
        return {"height": int(r.sampling.height),
                "width": int(r.sampling.width),
                # CFG runs the conditional and the empty-prompt halves as one forward
                "batch": (r.wave_size or 1) * r.n_samples_per_prompt
                * (2 if float(r.sampling.guidance_scale) != 1.0 else 1)}

    def _build_reward(self) -> None:
        r = self.cfg.reward
        device = self.device if r.runtime == "colocate" else torch.device("cpu")
        self.reward_device = device
        self.reward = build_reward_manager_from_config(r, device=device)

    # ---- one step ---------------------------------------------------------------------
    def rollout(self, rollout_id: int):
        records = self.sampler.groups_for_rollout(rollout_id, self.cfg.rollout.rollout_batch_size)
        mine = records[self.rank * self.groups_per_rank:(self.rank + 1) * self.groups_per_rank]
        def generate():  # self.engine / self.driver: new ones after an engine restart
            if self.cfg.rollout.offload_rollout:
                with self.timer.stage("engine_resume"):
                    self.engine.resume()
            with self.timer.stage("rollout"):
                return self.driver.generate(mine, self.cfg.rollout.n_samples_per_prompt,
                                            rollout_id=rollout_id,
                                            policy_version=self.policy_version,
                                            progress=self.cfg.logging.progress and self.rank == 0,
                                            while_waiting=self.host_gc.while_engine_works)
        batch = call_with_recovery(self, "rollout", generate)
        return batch

    def score(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        r = self.cfg.reward
        with self.timer.stage("reward"):
            with self.meter.region("reward_model", self.reward_device):
                components, metrics = self.reward.score(batch.images, batch.prompts,
                                                        batch.metadata)
            weights = self.reward.weights or {c: 1.0 for c in components}
            adv, adv_metrics, failed = compute_advantages(
                components, batch.group_index, weights=weights,
                required=list(self.reward.required), std_mode=r.std_mode, eps=r.adv_eps,
                clip_max=r.adv_clip_max, zero_degenerate_groups=r.zero_degenerate_groups)
        metrics.update(adv_metrics)
        total = sum(weights.get(c, 0.0) * v.float() for c, v in components.items())
        wsum = sum(weights.get(c, 0.0) for c in components) or 1.0
        metrics["reward/mean"] = float(total.mean()) / wsum  # weighted mean, same scale as eval
        k = self.cfg.logging.train_samples if self.rank == 0 else 0
        shown = pick_samples(batch.prompts, k)  # spread over the groups: several prompts
        self.last_samples = (batch.images[shown].cpu(), [batch.prompts[i] for i in shown],
                             (total[shown] / wsum).cpu()) if k > 0 else None
        metrics["reward/failed_groups"] = float(len(failed))
        return adv, metrics

    def train_on(self, batch, advantages: torch.Tensor, rollout_id: int) -> dict[str, float]:
        """Replay and update (trainer.actor.update): --num-updates-per-batch disjoint optimizer
        updates; pi_old frozen before the first optimizer step. DiffusionNFT has its own
        update (trainer.algorithms.nft_step)."""
        if self.cfg.train.algorithm == "diffusionnft":
            return nft_train_on(self, batch, advantages, rollout_id)
        return train_on(self, batch, advantages, rollout_id)

    def _coll_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _engine_names(self) -> dict[str, str]:
        """Trainer parameter name (wrappers stripped) -> the engine's name (adapter's map)."""
        if getattr(self, "_name_map", None) is None:
            names = [strip_wrapper_names(n) for n, _ in self.model.named_parameters()]
            self._name_map = self.adapter.weight_name_map(names)
        return self._name_map

    def sync_weights(self, first: bool = False) -> dict[str, float]:
        """Push the actor's weights into the engine; the version advances only on success."""
        if self.sender is None:
            return {}
        cfg = self.cfg
        mode = cfg.sync_mode
        scaling = (cfg.lora.alpha or cfg.lora.rank) / max(1, cfg.lora.rank)
        version = 0 if first else self.policy_version + 1
        attempts = cfg.weight_sync.max_retries + 1
        for attempt in range(attempts):
            try:
                with self.timer.stage("weight_sync"):
                    payload = sync_payload(self.model, mode if not first or mode != "adapter"
                                           else "full", scaling=scaling, first=first,
                                           name_map=self._engine_names())
                    stats = self.sender.sync(version, payload,
                                             mode="full" if first and mode == "adapter" else mode)
                # The engine's checksum covers all its weights: comparable when the sync did
                # (an adapter-mode step moves only LoRA tensors; ipc already compared both
                # sides' checksums of the bytes moved).
                if cfg.weight_sync.verify_engine_checksum and (mode != "adapter" or first) \
                        and not getattr(self.sender, "self_verifying", False):
                    with self.timer.stage("weight_sync/verify"):
                        got = self.engine.checksum()
                    if got != stats.checksum:
                        raise ipc.WeightSyncError(
                            "post-write", [f"engine checksum {got} != sent {stats.checksum} "
                                           "after commit"], version)
                self.policy_version = version
                seconds = float(getattr(stats, "seconds", 0.0))
                gb = float(getattr(stats, "bytes", 0)) / 1e9
                out = {"weight_sync/seconds": seconds, "train/weight_sync_gb": gb,
                       "weight_sync/gb_per_s": gb / seconds if seconds > 0 else 0.0,
                       "train/weight_sync_tensors": float(getattr(stats, "tensors", 0)),
                       "weight_sync/handle_opens": float(getattr(stats, "handle_opens", 0))}
                # where the sync's time goes: prepare (scan + manifest), begin (receiver's
                # accept), write (gathers + copy kernels + fence), commit (receiver's check)
                out.update({f"weight_sync/{k}_s": float(v)
                            for k, v in (getattr(stats, "timings", None) or {}).items()})
                return out
            except ipc.WeightSyncError as exc:
                self.sync_failures += 1
                log.error("weight sync of version %d failed (attempt %d/%d): %s",
                          version, attempt + 1, attempts, exc)
                if attempt + 1 == attempts:
                    raise
        return {}

    def _offload_after_train(self, actor_now: tuple[int, int] | None) -> None:
        """The actor's offload at the end of a step. On the first CUDA step (``actor_now``:
        the actor's resident and peak bytes) the as_needed policy decides first: where both
        sides fit, the actor stays on the GPU already now, so the second step pays no onload."""
        if actor_now is not None:
            engine = self.driver.last_engine_memory
            self.colocate.measure(Footprint(
                total=torch.cuda.mem_get_info(self.device)[1], actor_resident=actor_now[0],
                actor_peak=actor_now[1], engine_resident=engine.get("memory_allocated_bytes", 0),
                engine_peak=engine.get("memory_peak_bytes", 0)))
        if self.colocate.actor_offload:
            with self.timer.stage("offload"):
                self.offloaded = offload_actor(self.model, self.optimizer)

    def train_step(self, rollout_id: int) -> dict[str, float]:
        t0, compiles_before = time.perf_counter(), compile_events()
        self.profile.before(rollout_id)
        batch = self.rollout(rollout_id)
        advantages, metrics = self.score(batch)
        first_measure = not self.colocate.decided and self.device.type == "cuda"
        if self.colocate.engine_release:
            with self.timer.stage("engine_release"):
                self.engine.release()
        state_onload = PendingOnload()
        if self.offloaded is not None:
            with self.timer.stage("onload", current_stream_only=True):
                # the optimizer state lands on a side stream while the first update's forwards
                # and backwards run; its first step waits for it (PendingOnload)
                state_onload = onload_actor(self.model, self.optimizer, self.offloaded,
                                            state_stream=self.state_stream)
                self.offloaded = None
        if first_measure:
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.timer.stage("train"):
            metrics.update(self.train_on(batch, advantages, rollout_id))
            state_onload.wait()  # a stage without an optimizer step must not leave it pending
        metrics.update(call_with_recovery(self, "weight sync", self.sync_weights, collective=True))
        self._offload_after_train(actor_footprint(self.device) if first_measure else None)
        metrics.update(self.colocate.metrics(self.offloaded))
        self.profile.after(rollout_id)
        step_time = time.perf_counter() - t0
        times = self.timer.pop()
        recompiles = float(compile_events() - compiles_before + sum(self.driver.last_compiles))
        compute = add_times({f"engine_{k}": v for k, v in self.driver.last_compute_s.items()},
                            self.meter.pop())
        metrics.update(step_metrics(
            step_time=step_time, stage_times=times, recompiles=recompiles, compute=compute,
            outside=self.outside.pop(), samples=len(batch), sde_steps=len(batch.sde_indices),
            world=self.world, counters=self.counters(), device=self.device))
        metrics.update(trainer_mfu(self, batch, times, step_time))  # perf/mfu/*: compute.mfu
        self._watch_recompiles(rollout_id, recompiles)
        self.host_gc.step_done()
        return self._reduce_metrics(metrics)

    def _watch_recompiles(self, rollout_id: int, count: float) -> None:
        """A run that keeps compiling never reaches compiled speed: say so. The first steps
        compile each shape once (a probe, grad / no-grad, text lengths going dynamic)."""
        self.recompile_streak = self.recompile_streak + 1 if count else 0
        if rollout_id >= 3 and self.recompile_streak >= 3:
            log.warning("torch.compile recompiled in each of the last %d steps (%d this step): "
                        "shapes keep changing; see TORCH_LOGS=recompiles", self.recompile_streak,
                        int(count))

    _MAX_KEYS = ("train/ratio_max", "train/logp_parity", "perf/mem_allocated_gb",
                 "perf/mem_reserved_gb", "perf/mem_peak_gb")
    _MIN_KEYS = ("train/ratio_min",)

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Across ranks: ratio_max / memory by MAX, ratio_min by MIN, the rest by mean (three
        all-reduces of small vectors)."""
        if not self.distributed:
            return metrics
        out = {}
        groups = [(dist.ReduceOp.MAX, [k for k in metrics if k in self._MAX_KEYS])
                  , (dist.ReduceOp.MIN, [k for k in metrics if k in self._MIN_KEYS])
                  , (dist.ReduceOp.SUM, [k for k in metrics
                                         if k not in self._MAX_KEYS + self._MIN_KEYS])]
        for op, keys in groups:
            keys = sorted(keys)
            if not keys:
                continue
            vec = torch.tensor([metrics[k] for k in keys], dtype=torch.float64,
                               device=self._coll_device())
            dist.all_reduce(vec, op=op)
            if op == dist.ReduceOp.SUM:
                vec /= self.world
            out.update(zip(keys, vec.tolist()))
        return out

    # ---- eval -------------------------------------------------------------------------
    def evaluate(self, step: int, tag: str = "eval") -> dict[str, float]:
        if not self.eval_records:
            return {}
        cfg = self.cfg
        with self.timer.stage("eval"), torch.no_grad(), eval_weights(self):
            batch = call_with_recovery(self, "eval", lambda: self.eval_driver.generate(
                self.eval_records, cfg.data.n_samples_per_eval_prompt, rollout_id=None,
                policy_version=self.policy_version, write_artifacts=False,
                progress=cfg.logging.progress and self.rank == 0))
            components, _ = self.reward.score(batch.images, batch.prompts, batch.metadata)
        weights = self.reward.weights or {c: 1.0 for c in components}
        total = sum(weights.get(c, 0.0) * v.float() for c, v in components.items())
        wsum = sum(weights.get(c, 0.0) for c in components) or 1.0
        out = {"eval/reward_mean": float(total.mean()) / wsum}
        out.update({f"eval/{c}_mean": float(v.float().mean()) for c, v in components.items()})
        self.timer.pop()
        out = self._reduce_metrics(out)
        if self.rank == 0 and batch.images is not None:
            rewards = (total[:32] / wsum).tolist()
            log_samples(self.metrics, f"{tag}/samples", step, batch.images[:32],
                        batch.prompts[:32], rewards,
                        path=self.run_dir / "eval" / f"{tag}_step{step:05d}.png")
        return out

    def eval_over_seeds(self, seeds) -> list[float]:
        """The eval reward at the current weights under each generation seed: the spread is
        the eval's own noise (what a change of the policy must beat). Restores the seed."""
        return [m["eval/reward_mean"] for m in self.eval_metrics_over_seeds(seeds)]

    def eval_metrics_over_seeds(self, seeds) -> list[dict[str, float]]:
        """Every eval metric (reward and each component) under each generation seed."""
        base, out = self.eval_driver.seed, []
        try:
            for seed in seeds:
                self.eval_driver.seed = int(seed)
                out.append(self.evaluate(0, tag="noise"))
        finally:
            self.eval_driver.seed = base
        return out

    # ---- the run ----------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg = self.cfg
        history = {}
        progress = RunProgress(cfg.train.num_rollouts, self.next_rollout,
                               enabled=cfg.logging.progress and self.rank == 0)
        self.timer = progress.watch(self.timer, cfg.train.num_updates_per_batch)
        hook = self.optimizer.register_step_post_hook(progress.optimizer_stepped)
        if self.next_rollout == 0 and self.eval_records:
            history["eval_start"] = self.evaluate(0, "eval")
            self.metrics.log(0, history["eval_start"])
            log_pictures(self, 0, evaluated=True)
        last = {}
        for rollout_id in range(self.next_rollout, cfg.train.num_rollouts):
            metrics = self.train_step(rollout_id)
            check_progress(self, rollout_id, metrics)
            self.next_rollout = rollout_id + 1
            step = rollout_id + 1
            is_last = step == cfg.train.num_rollouts
            evaluated = bool(self.eval_records) and (
                is_last or step % max(1, cfg.data.eval_interval) == 0)
            if evaluated:
                metrics.update(self.evaluate(step))
            progress.step_done(metrics)
            if step % max(1, cfg.logging.log_interval) == 0 or is_last:
                self.metrics.log(step, metrics, console=not progress.enabled)
                progress.write(self.metrics.console_line(step, metrics))
                log_pictures(self, step, evaluated=evaluated)
            self.maybe_save(step, is_last)
            last = metrics
        progress.close()
        hook.remove()
        history["last"] = last
        if self.rank == 0:  # a full disk is logged and counted (trainer.metrics), not fatal
            self.metrics.write_text("summary.json", json.dumps(history, indent=2))
        return history

    def maybe_save(self, step: int, is_last: bool) -> None:
        """Every save_interval rollouts and at the end; save_interval -1 never saves. A failed
        final save raises (the run ends non-zero: its result is not on disk)."""
        ck = self.cfg.checkpoint
        if not worth_saving(self, step, is_last):  # untrained: skip, or raise at the end
            return
        if ck.save_interval < 0:
            return
        if is_last or (ck.save_interval and step % ck.save_interval == 0):
            with nvtx_range("checkpoint"):
                save_checkpoint(self, step, final=is_last)

    def close(self) -> None:
        host_gc = getattr(self, "host_gc", None)
        if host_gc is not None:
            host_gc.close()
        for obj in (getattr(self, "sender", None), getattr(self, "engine", None)):
            if obj is not None:
                try:
                    obj.close()
                except Exception as exc:  # closing must not mask the run's own error
                    log.warning("close failed: %s", exc)
        self.metrics.close()


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
