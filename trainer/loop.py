"""The training loop: rollout -> reward -> advantages -> replay/update -> weight sync -> eval.

One ``Trainer`` per rank (N ranks = N GPUs, or one CPU process). Rank j owns engine j on its
own device; each rank generates its own groups (rollout_batch_size / world of them), scores
them, and trains on them, so no trajectory crosses ranks and nothing round-trips through disk.
The only cross-rank traffic is FSDP's own collectives, a handful of scalar all-reduces
(batch-std advantages, the micro-batch-count check, metrics) and nothing else.
"""
from __future__ import annotations

import importlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import kernels
from trainer.actor.model import (build_actor, build_optimizer, lora_spec, lr_at_step,
                                 offload_actor, onload_actor, shard_actor,
                                 strip_wrapper_names)
from trainer.actor.replay import plan_updates, replay_log_probs
from trainer.actor.sync import sync_payload
from trainer.config import Config, write_resolved
from trainer.metrics import MetricsLogger
from trainer.profiling import ComputeMeter, ProfileWindow, StageTimer, add_times, nvtx_range
from trainer.prompts import PromptSampler, load_records

log = logging.getLogger("trainer")


def import_dotpath(path: str):
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"{path!r} is not a dotpath module.attr")
    return getattr(importlib.import_module(module), attr)


def resolve_model_path(cfg: Config) -> str:
    if cfg.model.model_path == "toy":
        from trainer.toy import weights_dir
        return str(weights_dir())
    return cfg.model.model_path


class Trainer:
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
        self.policy_version = 0
        self.lr_steps = 0
        self.next_rollout = 0
        self.sync_failures = 0
        self.offloaded = None
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
        import ipc
        from trainer.engine import launch_embedded_engine
        from trainer.rollout import RolloutDriver

        cfg = self.cfg
        self.sender = None
        if self.device.type == "cpu":
            # NOTE: trainer and engine time-share the cores; measured on the 2-core box, a
            # tiny forward ran 40x slower with both processes spinning 2 OpenMP threads each.
            import os
            threads = max(1, (os.cpu_count() or 2) // (2 * self.world))
            torch.set_num_threads(threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the engine process
        if cfg.rollout.engine == "sglang":
            from trainer.engine.sglang_sync import connect_sglang
            self.engine, self.sender = connect_sglang(cfg, self.rank, self.run_dir,
                                                      self.adapter)
        else:
            send_end, recv_end = ipc.channel_pair()
            self.engine = launch_embedded_engine(
                adapter_path=cfg.model.adapter_path, model_path=self.model_path,
                adapter_options=cfg.model.adapter_options, device=str(self.device),
                dtype=cfg.rollout.engine_dtype, lora=lora_spec(cfg, self.adapter)
                if cfg.sync_mode == "adapter" else None,
                weight_sync_conn=recv_end)
            self.sender = ipc.WeightSender(send_end, backend=cfg.weight_sync.backend,
                                           bucket_bytes=cfg.weight_sync.bucket_size_mb << 20,
                                           timeout_s=cfg.weight_sync.timeout_s)
        artifact_root = cfg.rollout.artifact_root or str(self.run_dir / "artifacts")
        self.driver = RolloutDriver(
            self.adapter, [self.engine], sampling=cfg.rollout.sampling,
            seed=cfg.rollout.generation_seed, task=cfg.model.task,
            artifact_root=artifact_root if cfg.rollout.write_artifacts and self.rank == 0
            else None, retention=cfg.rollout.artifact_retention_rollouts,
            wave_size=cfg.rollout.wave_size,
            sample_id_mode=cfg.rollout.sampling.get("sample_id_mode", "metadata"))

    def _build_reward(self) -> None:
        from trainer.rewards import build_reward_manager
        r = self.cfg.reward
        device = self.device if r.runtime == "colocate" else torch.device("cpu")
        self.reward_device = device
        self.reward = build_reward_manager(
            scorer_path=r.scorer_path, model_path=r.model_path, runtime=r.runtime,
            endpoint=r.endpoint, device=device, custom_reward_path=r.custom_reward_path,
            timeout_s=r.timeout_s)

    # ---- one step ---------------------------------------------------------------------
    def rollout(self, rollout_id: int):
        records = self.sampler.groups_for_rollout(rollout_id, self.cfg.rollout.rollout_batch_size)
        mine = records[self.rank * self.groups_per_rank:(self.rank + 1) * self.groups_per_rank]
        with self.timer.stage("rollout"):
            if self.cfg.rollout.offload_rollout:
                self.engine.resume()
            batch = self.driver.generate(mine, self.cfg.rollout.n_samples_per_prompt,
                                         rollout_id=rollout_id,
                                         policy_version=self.policy_version,
                                         progress=self.cfg.logging.progress and self.rank == 0)
        return batch

    def score(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        from trainer.rewards import compute_advantages
        r = self.cfg.reward
        with self.timer.stage("reward"):
            with self.meter.region("reward_model", self.reward_device):
                components, metrics = self.reward.score(batch.images, batch.prompts,
                                                        batch.metadata)
            weights = r.component_weights or {c: 1.0 for c in components}
            adv, adv_metrics, failed = compute_advantages(
                components, batch.group_index, weights=weights,
                required=list(r.required_components), std_mode=r.std_mode)
        metrics.update(adv_metrics)
        total = sum(weights.get(c, 0.0) * v.float() for c, v in components.items())
        wsum = sum(weights.get(c, 0.0) for c in components) or 1.0
        metrics["reward/mean"] = float(total.mean()) / wsum  # weighted mean, same scale as eval
        metrics["reward/failed_groups"] = float(len(failed))
        return adv, metrics

    def forward_backward_step(self, mb, adv: torch.Tensor, scale: float,
                              anchor: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One micro-batch. ``anchor`` is pi_old for these rows; None means "this forward is
        itself the anchor" (an update-0 micro-batch: no optimizer step has happened yet)."""
        t = self.cfg.train
        with nvtx_range("train/replay"):
            logp = replay_log_probs(self.adapter, self.model, mb, meter=self.meter)
        engine_logp = mb.log_probs.to(logp.device)
        old = logp.detach() if anchor is None else anchor.to(logp.device)
        adv = adv.to(logp.device)
        loss, stats = kernels.grpo_clip_loss(logp, old, adv, eps=t.eps_clip,
                                             eps_high=t.eps_clip_high)
        if t.kl_coef > 0:
            kl = self._kl_to_reference(mb)
            loss = loss + t.kl_coef * kl.mean()
            stats["kl"] = kl.mean().detach()
        with nvtx_range("train/backward"), self.meter.region("transformer_backward", self.device):
            (loss * scale).backward()
        stats["loss"] = loss.detach()
        if anchor is None:  # replay vs the engine's own sampling log-prob, same weights
            stats["logp_parity"] = (logp.detach() - engine_logp).abs().max()
        return stats

    def _kl_to_reference(self, mb) -> torch.Tensor:
        """KL(pi_theta || pi_ref) per (sample, step), pi_ref = the model with LoRA disabled."""
        device = next(self.model.parameters()).device
        cond = {k: v.to(device) for k, v in mb.conditions.items()}
        cols = []
        for s in range(len(mb.sde_indices)):
            x = mb.latents[:, s].to(device)
            sig, sig_n = mb.sigmas[:, s].to(device), mb.sigmas_next[:, s].to(device)
            with self.meter.region("transformer", device):
                v = self.adapter.velocity(self.model, x, sig, cond, mb.height, mb.width)
                with torch.no_grad(), self.model.disable_adapter():
                    v_ref = self.adapter.velocity(self.model, x, sig, cond, mb.height, mb.width)
            cols.append(kernels.sde_kl(v, v_ref, sig, sig_n, eta=mb.eta, sde_type=mb.sde_type))
        return torch.stack(cols, 1)

    def train_on(self, batch, advantages: torch.Tensor, rollout_id: int) -> dict[str, float]:
        """Replay and update: the local slice split into --num-updates-per-batch disjoint
        optimizer updates; pi_old is the engine's recorded log-prob, frozen before the first
        optimizer step, so the first update's ratio is exactly 1."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + rollout_id)
        plan = plan_updates(len(batch), cfg.train.num_updates_per_batch,
                            cfg.train.micro_batch_size, generator=gen)
        self._assert_microbatch_count_aligned(plan.num_micro_batches)
        if self._all_ranks_degenerate(advantages):
            # No rank has any advantage signal: every update would be a zero-gradient step.
            return {"train/optimizer_steps": 0.0, "train/optimizer_skips": float(len(plan.updates)),
                    "train/num_microbatches": float(plan.num_micro_batches)}
        self.model.train()
        anchors = self._anchors(batch, plan)
        sums: dict[str, list[torch.Tensor]] = {}
        grad_norms, skips, first_ratio, lr = [], 0, None, lr_at_step(self.lr_steps, cfg)
        params = [p for p in self.model.parameters() if p.requires_grad]
        for u, micro_batches in enumerate(plan.updates):
            update_size = sum(len(m) for m in micro_batches)
            for rows in micro_batches:
                stats = self.forward_backward_step(batch.select(rows), advantages[rows],
                                                   len(rows) / update_size,
                                                   None if u == 0 and self.cfg.train.anchor
                                                   == "replay" else anchors[rows])
                if u == 0 and first_ratio is None:
                    first_ratio = stats["ratio_mean"]
                for k, v in stats.items():
                    sums.setdefault(k, []).append(v.detach().float())
            with nvtx_range("train/optimizer"), self.outside.region("optimizer", self.device):
                gn = torch.nn.utils.clip_grad_norm_(params, cfg.train.clip_grad)
                gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
                grad_norms.append(gn)
                # NOTE: host sync per update: a non-finite norm must skip the step on all
                # ranks alike (the norm is already all-reduced by FSDP, so they agree).
                if not torch.isfinite(gn):
                    skips += 1
                else:
                    lr = lr_at_step(self.lr_steps, cfg)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    self.optimizer.step()
                    self.lr_steps += 1
                self.optimizer.zero_grad(set_to_none=True)
        out = {f"train/{k}": torch.stack(v).mean() for k, v in sums.items()}
        out["train/ratio_max"] = torch.stack(sums["ratio_max"]).max()
        out["train/ratio_min"] = torch.stack(sums["ratio_min"]).min()
        if "logp_parity" in sums:
            out["train/logp_parity"] = torch.stack(sums["logp_parity"]).max()
        out["train/first_update_ratio_mean"] = first_ratio
        out["train/grad_norm"] = torch.stack(grad_norms).mean()
        out = {k: float(v) for k, v in out.items()}  # NOTE: one host sync for all of them
        out.update({"train/lr": lr, "train/optimizer_steps": float(len(plan.updates) - skips),
                    "train/optimizer_skips": float(skips),
                    "train/num_microbatches": float(plan.num_micro_batches)})
        return out

    def _anchors(self, batch, plan) -> torch.Tensor | None:
        """pi_old for every row, frozen before the first optimizer step (spec).

        --train-anchor replay (default): the actor's own no-grad replay of updates 1.. (update
        0's grad forward doubles as its anchor), so the first update's ratio is exactly 1
        whatever the numerics of the engine's batch shapes; costs one no-grad forward for
        (U-1)/U of the samples. --train-anchor engine: the engine's recorded log-probs (no extra
        forward; the ratio then starts within train/logp_parity of 1).
        """
        if self.cfg.train.anchor == "engine":
            return batch.log_probs
        anchors = torch.zeros_like(batch.log_probs)
        with torch.no_grad(), nvtx_range("train/anchor"):
            for micro_batches in plan.updates[1:]:
                for rows in micro_batches:
                    lp = replay_log_probs(self.adapter, self.model, batch.select(rows),
                                          meter=self.meter)
                    anchors[rows.to(anchors.device)] = lp.float().to(anchors.device)
        return anchors

    def _all_ranks_degenerate(self, advantages: torch.Tensor) -> bool:
        flag = torch.tensor([float(advantages.abs().max() > 0)], dtype=torch.float64,
                            device=self._coll_device() if self.distributed else "cpu")
        if self.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() == 0)

    def _assert_microbatch_count_aligned(self, count: int) -> None:
        """Every rank must run the same number of FSDP collectives: MAX all-reduce, then
        error instead of deadlock (spec: _assert_microbatch_count_aligned)."""
        if not self.distributed:
            return
        t = torch.tensor([count, -count], dtype=torch.int64, device=self._coll_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != count or -int(t[1]) != count:
            raise RuntimeError(f"rank {self.rank} has {count} micro-batches but ranks range "
                               f"{-int(t[1])}..{int(t[0])}: refusing to deadlock")

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
        import ipc
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

    def train_step(self, rollout_id: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.profile.before(rollout_id)
        batch = self.rollout(rollout_id)
        advantages, metrics = self.score(batch)
        if self.cfg.rollout.offload_rollout:
            self.engine.release()
        if self.offloaded is not None:
            with self.timer.stage("onload"):
                onload_actor(self.model, self.optimizer, self.offloaded)
                self.offloaded = None
        with self.timer.stage("train"):
            metrics.update(self.train_on(batch, advantages, rollout_id))
        metrics.update(self.sync_weights())
        if self.cfg.fsdp.offload_train and self.device.type == "cuda":
            with self.timer.stage("offload"):
                self.offloaded = offload_actor(self.model, self.optimizer)
        self.profile.after(rollout_id)
        step_time = time.perf_counter() - t0
        n = len(batch)  # this rank's samples; rates are summed over ranks below
        times = self.timer.pop()
        metrics.update({f"perf/{k}_time": v for k, v in times.items()})
        metrics["perf/step_time"] = step_time
        compute = add_times({f"engine_{k}": v for k, v in self.driver.last_compute_s.items()},
                            self.meter.pop())
        metrics.update({f"perf/compute/{k}": v for k, v in compute.items()})
        metrics["perf/model_compute_time"] = sum(compute.values())
        metrics.update({f"perf/outside/{k}": v for k, v in self.outside.pop().items()})
        # Share of the step outside transformer / VAE / text-encoder / reward-model compute
        # (ComputeMeter's definition): the framework's own overhead, target <= 5 % on a GPU.
        metrics["perf/outside_compute_share"] = 1.0 - sum(compute.values()) / step_time
        metrics["perf/samples_per_s"] = n / step_time * self.world
        metrics["perf/train_samples_per_s"] = n / times["train"] * self.world
        metrics["perf/train_transitions_per_s"] = (n * len(batch.sde_indices) / times["train"]
                                                   * self.world)
        metrics["train/policy_version"] = float(self.policy_version)
        metrics["train/weight_sync_failures"] = float(self.sync_failures)
        metrics["train/checkpoint_failures"] = float(getattr(self, "checkpoint_failures", 0))
        if self.device.type == "cuda":
            gb = 2.0 ** 30
            metrics["perf/mem_allocated_gb"] = torch.cuda.memory_allocated(self.device) / gb
            metrics["perf/mem_reserved_gb"] = torch.cuda.memory_reserved(self.device) / gb
            metrics["perf/mem_peak_gb"] = torch.cuda.max_memory_allocated(self.device) / gb
        return self._reduce_metrics(metrics)

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
        with self.timer.stage("eval"), torch.no_grad():
            batch = self.driver.generate(self.eval_records, cfg.data.n_samples_per_eval_prompt,
                                         rollout_id=None, policy_version=self.policy_version,
                                         write_artifacts=False)
            components, _ = self.reward.score(batch.images, batch.prompts, batch.metadata)
        weights = cfg.reward.component_weights or {c: 1.0 for c in components}
        total = sum(weights.get(c, 0.0) * v.float() for c, v in components.items())
        wsum = sum(weights.get(c, 0.0) for c in components) or 1.0
        out = {"eval/reward_mean": float(total.mean()) / wsum}
        out.update({f"eval/{c}_mean": float(v.float().mean()) for c, v in components.items()})
        self.timer.pop()
        out = self._reduce_metrics(out)
        if self.rank == 0 and batch.images is not None:
            imgs = batch.images[:32].cpu().numpy()
            self.metrics.image_grid(f"{tag}/samples", step, imgs,
                                    path=self.run_dir / "eval" / f"{tag}_step{step:05d}.png")
        return out

    def eval_over_seeds(self, seeds) -> list[float]:
        """The eval reward at the current weights under each generation seed: the spread is
        the eval's own noise (what a change of the policy must beat). Restores the seed."""
        base, out = self.driver.seed, []
        try:
            for seed in seeds:
                self.driver.seed = int(seed)
                out.append(self.evaluate(0, tag="noise")["eval/reward_mean"])
        finally:
            self.driver.seed = base
        return out

    # ---- the run ----------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg = self.cfg
        history = {}
        if self.next_rollout == 0 and self.eval_records:
            history["eval_start"] = self.evaluate(0, "eval")
            self.metrics.log(0, history["eval_start"])
        last = {}
        for rollout_id in range(self.next_rollout, cfg.train.num_rollouts):
            metrics = self.train_step(rollout_id)
            self.next_rollout = rollout_id + 1
            step = rollout_id + 1
            is_last = step == cfg.train.num_rollouts
            if self.eval_records and (is_last or step % max(1, cfg.data.eval_interval) == 0):
                metrics.update(self.evaluate(step))
            if step % max(1, cfg.logging.log_interval) == 0 or is_last:
                self.metrics.log(step, metrics)
            self.maybe_save(step, is_last)
            last = metrics
        history["last"] = last
        if self.rank == 0:
            (self.run_dir / "summary.json").write_text(json.dumps(history, indent=2))
        return history

    def maybe_save(self, step: int, is_last: bool) -> None:
        ck = self.cfg.checkpoint
        if not (ck.save or ck.save_interval):
            return
        if is_last or (ck.save_interval and step % ck.save_interval == 0):
            from trainer.checkpoint import save_checkpoint
            with nvtx_range("checkpoint"):
                save_checkpoint(self, step)

    def close(self) -> None:
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
