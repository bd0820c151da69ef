"""The training loop: rollout -> reward -> advantages -> replay/update -> weight sync -> eval.

One ``Trainer`` per rank (N ranks = N GPUs, or one CPU process). Rank j owns engine j on its
own device; each rank generates its own groups (rollout_batch_size / world of them), scores
them, and trains on them, so no trajectory crosses ranks and nothing round-trips through disk.
The only cross-rank traffic is FSDP's own collectives, a handful of scalar all-reduces
(batch-std advantages, the micro-batch-count check, metrics) and nothing else; except under
sequence parallelism (``fsdp.sequence_parallel = S``), where the S ranks of a sequence group
join their scored slices before the update and each trains on all S of them
(``trainer.parallel.group_batch`` says why it gathers rather than rolls out alike).
"""
from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trainer.actor.actor import Actor
from trainer.actor.model import (PendingOnload, build_actor, build_optimizer, lora_spec,
                                 offload_actor, onload_actor, shard_actor, strip_wrapper_names)
from trainer.actor.colocate import Footprint, OffloadPolicy, actor_footprint
from trainer.actor.sync import sync_payload
from trainer.checkpoint import Checkpointer, save_checkpoint
from trainer.checkpoint.contract import (adapter_contract, sampling_fingerprint,
                                         weight_sync_manifest)
from trainer.checkpoint.layout import ADAPTER_CONTRACT, WEIGHT_SYNC_MANIFEST
from trainer.checkpoint.save import checkpoint_root
from trainer.algorithms import algorithm_noise_steps, training_sampling
from trainer.actor.update import train_on
from trainer.models.lora import lora_scaling
from trainer.algorithms.nft_step import OldPolicyPart, nft_train_on
from trainer.checkpoint.trained import worth_saving
from trainer.config import Config, write_resolved
from trainer.ema import build_ema
from trainer.engine.recovery import call_with_recovery
from trainer.engine.sglang.sync import connect_sglang
from trainer.evaluation import eval_sampling, eval_weights
from trainer.utils.host_gc import HostGarbageCollection, resolve_gc_mode
from trainer.metrics import MetricsLogger, step_metrics
from trainer.compute.mfu import step_mfu
from trainer.models.compile import compile_events
from trainer.parallel.group_batch import gather_sequence_group
from trainer.parallel.sequence import ParallelMesh, build_mesh
from trainer.profiling import ProfileWindow, StageTimer, add_times, nvtx_range
from trainer.progress import RunProgress
from trainer.prompts import PromptSampler, load_records
from trainer.rewards import build_reward_manager_from_config, compute_advantages
from trainer.rollout import RolloutDriver
from trainer.rollout.service import RolloutService, embedded_starter, engine_warmup
from trainer.state import TrainerState
from trainer.toy import weights_dir
from trainer.utils.values import import_dotpath
from trainer.visuals import log_pictures, log_samples, pick_samples
from trainer.watchdog import ProgressWatch

log = logging.getLogger("trainer")


def resolve_model_path(cfg: Config) -> str:
    if cfg.model.model_path == "toy":
        return str(weights_dir())
    return cfg.model.model_path


def _delegated(component: str, name: str) -> property:
    """A counter of ``TrainerState`` read and set on the component that keeps it."""
    return property(lambda self: getattr(getattr(self, component), name),
                    lambda self, value: setattr(getattr(self, component), name, value))


def build_checkpointer(cfg: Config, *, actor: Actor, state, adapter, model_path: str,
                       driver=None, rank: int = 0, world: int = 1,
                       metrics=None) -> Checkpointer:
    """The run's checkpointer: the actor's shards and the EMA as DCP parts, ``state`` (the
    run's counters and RNG, a ``TrainerState``) in ``trainer_state.json``, the weight-sync
    manifest and the adapter contract beside them."""
    ck = cfg.checkpoint
    fingerprint = sampling_fingerprint(driver, cfg.rollout.sampling)

    def contract() -> dict:
        return adapter_contract(cfg.model, cfg.lora, cfg.sync_mode, adapter, model_path,
                                base_hash=ck.base_hash)

    def record() -> dict:
        return {"task": cfg.model.task, "adapter": cfg.model.adapter_path,
                "model_path": str(model_path),
                "trainable_mode": "lora" if cfg.lora.rank > 0 else "full",
                "weight_sync_mode": cfg.sync_mode, "sampling": cfg.rollout.sampling.to_dict(),
                "sampling_fingerprint": fingerprint,
                "generation_seed": cfg.rollout.generation_seed,
                "torch_version": torch.__version__, "time": time.time()}

    def sidecars() -> dict[str, tuple[dict, int | None]]:
        manifest = weight_sync_manifest(actor.model, cfg.sync_mode, cfg.rollout.engine_dtype,
                                        adapter)
        return {WEIGHT_SYNC_MANIFEST: (manifest, None), ADAPTER_CONTRACT: (contract(), 2)}
    parts = {"fsdp": actor} if actor.ema is None else {"fsdp": actor, "ema": actor.ema}
    if cfg.train.algorithm == "diffusionnft":  # its old policy resumes as it was saved
        parts["nft_old"] = OldPolicyPart(actor)
    return Checkpointer(root=checkpoint_root(ck.save, cfg.logging.run_dir),
                        task=cfg.model.task, parts=parts, state=state, record=record,
                        sidecars=sidecars, on_failure=state.record_checkpoint_failure,
                        rank=rank, world=world, keep=ck.max_actor_ckpt_to_keep,
                        overwrite=bool(ck.overwrite), metrics=metrics,
                        contract=contract, fingerprint=fingerprint)


class Trainer(TrainerState):
    """One rank's run: the actor, the rollout service (engine, sender, drivers), rewards, the
    checkpointer, the loop. Its counters and RNG are ``TrainerState`` (``state_dict`` /
    ``load_state_dict``, one of the checkpointer's parts); each counter lives with the
    component that moves it (the actor: the LR step; the rollout service: the policy version,
    failed syncs, engine restarts; the checkpointer's failure count here)."""

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
        self.profile = ProfileWindow(cfg.logging.profile_steps)
        self.metrics = MetricsLogger(self.run_dir, enabled=rank == 0,
                                     tensorboard=cfg.logging.tensorboard,
                                     wandb=cfg.logging.wandb,
                                     wandb_project=cfg.logging.wandb_project,
                                     config=cfg.to_dict())
        self.model_path = resolve_model_path(cfg)
        self.adapter = import_dotpath(cfg.model.adapter_path)(self.model_path,
                                                              **cfg.model.adapter_options)
        self.parallel = self._build_parallel()
        self.actor = self._build_actor()
        self.state_stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda"
                             and cfg.fsdp.overlap_state_onload else None)
        self.recompile_streak = 0  # consecutive steps that compiled something
        self.colocate = OffloadPolicy(cfg.fsdp.offload_policy,
                                      offload_rollout=cfg.rollout.offload_rollout,
                                      offload_train=cfg.fsdp.offload_train, device=self.device)
        self.host_gc = HostGarbageCollection(resolve_gc_mode(cfg.train.gc, self.device))
        self.watch = ProgressWatch(cfg.train.max_rollouts_without_step)
        self._build_data()
        self._build_rollouts()
        self._build_reward()
        self.checkpointer = self._build_checkpointer()
        self.sync_weights(first=True)

    # ---- the counters (TrainerState's), where the components moving them keep them ----
    policy_version = _delegated("rollouts", "policy_version")
    sync_failures = _delegated("rollouts", "sync_failures")
    engine_restarts = _delegated("rollouts", "restarts")
    lr_steps = _delegated("actor", "lr_steps")
    # read-only views for callers that inspect a run (tests, bench)
    model = property(lambda self: self.actor.model)
    engine = property(lambda self: self.rollouts.engine)
    sender = property(lambda self: self.rollouts.sender)

    # ---- construction -----------------------------------------------------------------
    def _build_parallel(self) -> ParallelMesh | None:
        """The data x sequence mesh under ``fsdp.sequence_parallel > 1`` (None: off), built
        once: the actor shards over it and the loop joins each sequence group's batch on it."""
        degree = self.cfg.fsdp.sequence_parallel
        return build_mesh(degree, self.device.type) if degree > 1 else None

    def _build_actor(self) -> Actor:
        cfg = self.cfg
        model = self._load_in_waves()
        return Actor(self.adapter, model, build_optimizer(model, cfg.train), train=cfg.train,
                     fsdp=cfg.fsdp, device=self.device, ema=build_ema(model, cfg.ema),
                     trainable_only=cfg.lora.rank > 0)

    def _load_in_waves(self):
        """--fsdp-load-wave-size N: only N ranks materialise the base model at a time (a
        barrier between waves) to bound host memory and model-directory read contention."""
        cfg = self.cfg
        wave = cfg.fsdp.load_wave_size
        build = functools.partial(build_actor, self.adapter, cfg.train, cfg.fsdp, cfg.lora,
                                  self.device, self.distributed, compile=cfg.model.compile,
                                  mesh=self.parallel)
        if not self.distributed or wave <= 0 or wave >= self.world:
            return build()
        model = None
        for start in range(0, self.world, wave):
            if start <= self.rank < start + wave:
                model = build(shard=False)
            dist.barrier()
        return shard_actor(model, self.adapter, cfg.fsdp, cfg.lora, self.parallel)

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

    def _build_rollouts(self) -> None:
        """The rollout service (engine + weight sender) and its two drivers."""
        cfg, r = self.cfg, self.cfg.rollout
        if r.engine == "sglang":
            start = functools.partial(connect_sglang, cfg.model, r, cfg.lora, cfg.weight_sync,
                                      self.rank, self.run_dir, self.adapter)
        else:
            start = embedded_starter(
                cfg.model, r, cfg.weight_sync, model_path=self.model_path, device=self.device,
                lora=lora_spec(cfg.lora, self.adapter) if cfg.sync_mode == "adapter" else None,
                warmup=engine_warmup(r, cfg.model.compile, self.device),
                share_trunk=cfg.train.algorithm in ("flowgrpo_fast", "mixgrpo"),
                flash_ratio=cfg.train.mix_flash_ratio if cfg.train.algorithm == "mixgrpo"
                else None)
        self.rollouts = RolloutService(start, rank=self.rank, world=self.world,
                                       device=self.device, restartable=r.engine == "embedded",
                                       max_restarts=r.engine_max_restarts)
        artifact_root = r.artifact_root or str(self.run_dir / "artifacts")
        id_mode = r.sampling.sample_id_mode
        self.driver = self.rollouts.attach(RolloutDriver(
            self.adapter, [self.rollouts.engine],
            sampling=training_sampling(cfg.train.algorithm, cfg.data, r.sampling),
            seed=r.generation_seed, task=cfg.model.task,
            artifact_root=artifact_root if r.write_artifacts and self.rank == 0
            else None, retention=r.artifact_retention_rollouts,
            wave_size=r.wave_size, sample_id_mode=id_mode,
            noise_steps=algorithm_noise_steps(cfg.train, seed=r.generation_seed,
                                              num_inference_steps=r.sampling.num_inference_steps)))
        self.eval_driver = self.rollouts.attach(RolloutDriver(
            self.adapter, [self.rollouts.engine],
            sampling=eval_sampling(cfg.data, r.sampling), seed=r.generation_seed,
            task=cfg.model.task, wave_size=r.wave_size, sample_id_mode=id_mode))

    def _build_checkpointer(self) -> Checkpointer:
        return build_checkpointer(self.cfg, actor=self.actor, state=self, adapter=self.adapter,
                                  model_path=self.model_path, driver=self.driver,
                                  rank=self.rank, world=self.world, metrics=self.metrics)

    def _build_reward(self) -> None:
        r = self.cfg.reward
        device = self.device if r.runtime == "colocate" else torch.device("cpu")
        self.reward_device = device
        self.reward = build_reward_manager_from_config(r, device=device)

    # ---- one step ---------------------------------------------------------------------
    def rollout(self, rollout_id: int):
        records = self.sampler.groups_for_rollout(rollout_id, self.cfg.rollout.rollout_batch_size)
        mine = records[self.rank * self.groups_per_rank:(self.rank + 1) * self.groups_per_rank]
        def generate():  # the service's engine: a new one after an engine restart
            if self.cfg.rollout.offload_rollout:
                with self.timer.stage("engine_resume"):
                    self.rollouts.engine.resume()
            with self.timer.stage("rollout"):
                return self.driver.generate(mine, self.cfg.rollout.n_samples_per_prompt,
                                            rollout_id=rollout_id,
                                            policy_version=self.policy_version,
                                            progress=self.cfg.logging.progress and self.rank == 0,
                                            while_waiting=self.host_gc.while_engine_works)
        return self._recovered("rollout", generate)

    def _recovered(self, stage: str, call, collective: bool = False):
        """``call()``, restarting and re-syncing a failed engine (trainer.engine.recovery)."""
        return call_with_recovery(self.rollouts, stage, call, resync=self.resync_engine,
                                  collective=collective)

    def score(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        r = self.cfg.reward
        with self.timer.stage("reward"):
            with self.actor.meter.region("reward_model", self.reward_device):
                components, metrics = self.reward.score(batch.images, batch.prompts,
                                                        batch.metadata, sources=batch.sources)
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
        self.last_samples = None
        if k > 0:  # editing: the shown samples' sources as a fourth item (trainer.visuals)
            self.last_samples = (batch.images[shown].cpu(), [batch.prompts[i] for i in shown],
                                 (total[shown] / wsum).cpu())
            if batch.sources is not None:
                self.last_samples += ([batch.sources[i] for i in shown],)
        metrics["reward/failed_groups"] = float(len(failed))
        return adv, metrics

    def train_batch(self, batch, advantages: torch.Tensor):
        """(batch, advantages) this rank trains on: its own slice, or under sequence
        parallelism every slice of its sequence group, joined alike on each of its ranks.
        Rollout, rewards, metrics and sample counts stay with the rank's own slice."""
        if self.parallel is None:
            return batch, advantages
        with self.timer.stage("sequence_gather"):
            return gather_sequence_group(batch, advantages, self.parallel.sequence_group(),
                                         self.actor.coll_device())

    def _engine_names(self) -> dict[str, str]:
        """Trainer parameter name (wrappers stripped) -> the engine's name (adapter's map)."""
        if getattr(self, "_name_map", None) is None:
            names = [strip_wrapper_names(n) for n, _ in self.actor.model.named_parameters()]
            self._name_map = self.adapter.weight_name_map(names)
        return self._name_map

    def sync_weights(self, first: bool = False) -> dict[str, float]:
        """Push the actor's weights into the engine (the rollout service's ``push``: the
        version advances only on success). The first sync is full, whatever the mode."""
        cfg = self.cfg
        mode = cfg.sync_mode if not first or cfg.sync_mode != "adapter" else "full"
        scaling = lora_scaling(cfg.lora.rank, cfg.lora.alpha)
        return self.rollouts.push(
            0 if first else self.policy_version + 1,
            lambda: sync_payload(self.actor.model, mode, scaling=scaling, first=first,
                                 name_map=self._engine_names()),
            mode=mode, attempts=cfg.weight_sync.max_retries + 1, timer=self.timer,
            # the engine's checksum covers all its weights: comparable when the sync did (an
            # adapter-mode step moves only LoRA tensors; ipc compared the bytes moved)
            verify=cfg.weight_sync.verify_engine_checksum and mode != "adapter")

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
                self.actor.offloaded = offload_actor(self.actor.model, self.actor.optimizer)

    def train_step(self, rollout_id: int) -> dict[str, float]:
        t0, compiles_before = time.perf_counter(), compile_events()
        self.profile.before(rollout_id)
        batch = self.rollout(rollout_id)
        advantages, metrics = self.score(batch)
        trained, trained_advantages = self.train_batch(batch, advantages)
        first_measure = not self.colocate.decided and self.device.type == "cuda"
        if self.colocate.engine_release:
            with self.timer.stage("engine_release"):
                self.rollouts.engine.release()
        state_onload = PendingOnload()
        actor = self.actor
        if actor.offloaded is not None:
            with self.timer.stage("onload", current_stream_only=True):
                # the optimizer state lands on a side stream while the first update's forwards
                # and backwards run; its first step waits for it (PendingOnload)
                state_onload = onload_actor(actor.model, actor.optimizer, actor.offloaded,
                                            state_stream=self.state_stream)
                actor.offloaded = None
        if first_measure:
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.timer.stage("train"):
            if self.cfg.train.algorithm == "diffusionnft":  # its own update (algorithms.nft_step)
                metrics.update(nft_train_on(actor, trained, trained_advantages, rollout_id,
                                            self.cfg.rollout.sampling.timestep_fraction))
            else:
                metrics.update(train_on(actor, trained, trained_advantages, rollout_id))
            state_onload.wait()  # a stage without an optimizer step must not leave it pending
        metrics.update(self._recovered("weight sync", self.sync_weights, collective=True))
        self._offload_after_train(actor_footprint(self.device) if first_measure else None)
        metrics.update(self.colocate.metrics(actor.offloaded))
        self.profile.after(rollout_id)
        step_time = time.perf_counter() - t0
        times = self.timer.pop()
        recompiles = float(compile_events() - compiles_before + sum(self.driver.last_compiles))
        compute = add_times({f"engine_{k}": v for k, v in self.driver.last_compute_s.items()},
                            actor.meter.pop())
        # this rank's own slice, also under sequence parallelism: its group's ranks trained
        # the same samples, each on 1/S of the tokens, so the slice is its share of the work
        metrics.update(step_metrics(
            step_time=step_time, stage_times=times, recompiles=recompiles, compute=compute,
            outside=actor.outside.pop(), samples=len(batch), sde_steps=len(batch.sde_indices),
            world=self.world, counters=self.counters(), device=self.device))
        metrics.update(step_mfu(self.adapter, self.device, self.cfg.rollout.sampling,  # perf/mfu/*
                                self.cfg.train, self.cfg.logging.peak_tflops, batch, times,
                                step_time))
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
                               device=self.actor.coll_device())
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
        with self.timer.stage("eval"), torch.no_grad(), \
                eval_weights(self.actor.ema, cfg.data.eval_use_ema, self.sync_weights):
            batch = self._recovered("eval", lambda: self.eval_driver.generate(
                self.eval_records, cfg.data.n_samples_per_eval_prompt, rollout_id=None,
                policy_version=self.policy_version, write_artifacts=False,
                progress=cfg.logging.progress and self.rank == 0))
            components, _ = self.reward.score(batch.images, batch.prompts, batch.metadata,
                                              sources=batch.sources)
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
                        path=self.run_dir / "eval" / f"{tag}_step{step:05d}.png",
                        sources=None if batch.sources is None else batch.sources[:32])
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
        hook = self.actor.optimizer.register_step_post_hook(progress.optimizer_stepped)
        if self.next_rollout == 0 and self.eval_records:
            history["eval_start"] = self.evaluate(0, "eval")
            self.metrics.log(0, history["eval_start"])
            log_pictures(self.metrics, self.run_dir, 0, None, evaluated=True)
        last = {}
        for rollout_id in range(self.next_rollout, cfg.train.num_rollouts):
            metrics = self.train_step(rollout_id)
            self.watch.check(rollout_id, metrics)
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
                log_pictures(self.metrics, self.run_dir, step, self.last_samples,
                             evaluated=evaluated)
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
        # untrained: skip, or raise at the end
        if not worth_saving(self.actor.lr_steps, self.watch.streak, ck.save_interval, step,
                            is_last):
            return
        if ck.save_interval < 0:
            return
        if is_last or (ck.save_interval and step % ck.save_interval == 0):
            with nvtx_range("checkpoint"), self.actor.onloaded():
                save_checkpoint(self.checkpointer, step, final=is_last)
                getattr(self.sender, "request_full", lambda: None)()  # SGLang: verify whole

    def close(self) -> None:
        host_gc = getattr(self, "host_gc", None)
        if host_gc is not None:
            host_gc.close()
        rollouts = getattr(self, "rollouts", None)
        if rollouts is not None:
            rollouts.close()
        self.metrics.close()


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
