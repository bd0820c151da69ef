"""Preflight: reject a bad run configuration before anything heavy is imported.

``preflight(cfg)`` applies every static rule of a run configuration (docs/design.md collects
them: SDE steps, FSDP2 training, Flow-GRPO, rewards, weight sync, learning rate, LoRA). It
collects every violation and raises ONE ``ConfigError`` naming them all (each with its config
key and flag); warnings are logged on ``trainer.preflight`` and returned. The rules of the
data, reliability and logging sections are in ``trainer.preflight.data_rules``; the checker in
``trainer.preflight.checker``. Only the standard library and torch-free trainer modules
(config, sampling, tasks, values) are imported: no torch, numpy, diffusers or model code, so a
bad config fails in well under a second (tests/test_preflight.py runs it in a fresh interpreter and checks
``sys.modules``).

Features with no flag here, refused by name when a recipe sets them: fully_async / hybrid,
use_kl_loss, use_dynamic_batch_size / max_tokens_per_gpu, autoscaler_config, save_hf,
load_debug_rollout_data (errors); async_save, save_debug_train_data (warnings).

Design choices:

- ``train.kl_coef != 0`` is allowed with LoRA: the frozen reference is the same model with the
  adapter disabled, which costs no memory (our extension). Without LoRA there is no reference
  in memory, so it is rejected.
- ``weight_sync.wire_dtype = "fp32"`` is accepted on a CPU-only run (``device="cpu"``), or
  with an fp32 engine (``rollout.engine_dtype = "fp32"``, e.g. the toy model on a GPU): the
  wire carries the engine's own dtype, and an fp32 wire keeps the engine's weights bit-equal to
  the actor's fp32 weights. Anywhere else bf16.
- ``weight_sync.mode`` may be given explicitly as full, adapter or merge (our three sync
  payloads, ``Config.sync_mode``); any value contradicting the one derived from the LoRA flags
  is an error, never silently overridden.
- Sample arithmetic follows trainer/loop.py: each rank generates and trains on its own
  ``rollout_batch_size / world`` groups, so the per-rank slice is
  ``rollout_batch_size * n_samples_per_prompt / world`` (``local_sample_count``); under
  ``fsdp.sequence_parallel = S`` a rank trains on its sequence group's S slices
  (``train_sample_count``), which the update and micro-batch rules divide.
- ``rollout.engine = "sglang"`` needs exactly one URL per rank (rank j talks to server j).
- An engine's GPUs must be on one node (CUDA IPC is host-local), so ``gpus_per_node`` must
  be divisible by ``num_gpus_per_engine`` as well as the world size.
- A sampling config resolving to no SDE step at all is rejected here rather than when the
  first trajectory is packed; eval SDE indices are checked like the training ones.
- ``linear`` / ``cosine`` without ``lr_decay_iters`` is an error: the schedule would silently
  stay constant.
- fp16 is not an accepted dtype: the actor has no gradient scaler (``trainer.utils.values.RUN_DTYPES``).
- Dotpaths (adapter, scorer, custom reward) are only checked for their shape here: importing
  them would import torch. ``check_imports`` (the launcher's second stage) imports them and
  checks every reward scorer's options against its constructor
  (``trainer.preflight.imports``).
"""
from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Callable

from trainer.config import Config, ConfigError
from trainer.config.hub import download_hint
from trainer.config.sampling import KL_FORMS, SamplingConfig, fraction_window  # noqa: F401 (re-exported)
from trainer.parallel.rules import KEY, family_problems, ring_problems, uses_ring, world_problems
from trainer.preflight.algorithm_rules import check_algorithm, check_reference_options
from trainer.preflight.checker import Checker, check_finite_numbers, flagged
from trainer.preflight.data_rules import (EVAL_MODES, check_data, check_logging,  # noqa: F401 (re-export)
                                    check_reliability)
from trainer.rewards.spec import static_problems
from trainer.tasks import GENERATION_TASKS
from trainer.toy import weights_dir
from trainer.utils.values import RUN_DTYPES, is_int

log = logging.getLogger("trainer.preflight")

TRAINABLE_MODES: tuple[str, ...] = ("full", "lora")
SYNC_MODES: tuple[str, ...] = ("full", "adapter", "merge")
STD_MODES: tuple[str, ...] = ("group", "batch", "none")
REWARD_RUNTIMES: tuple[str, ...] = ("colocate", "cpu", "remote")
LR_SCHEDULERS: tuple[str, ...] = ("constant", "linear", "cosine")
ENGINES: tuple[str, ...] = ("embedded", "sglang")
SYNC_BACKENDS: tuple[str, ...] = ("auto", "cuda", "shm")
DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu")
_DOTPATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


# ---- SDE steps (trainer.config.sampling owns the rules; these names are kept for callers) -------
# Step resolution whatever the SDE type: its undefined points are judged by _check_sampling.
def static_sde_indices(sampling: "dict[str, Any] | SamplingConfig") -> list[int]:
    """The SDE steps resolved without a rollout id (evaluation, or resampling off)."""
    return SamplingConfig.from_dict(sampling, type_rules=False).static_indices()


def trainable_indices_upper_bound(sampling: "dict[str, Any] | SamplingConfig") -> list[int]:
    """Every step at which some rollout (any rollout id) or evaluation could inject SDE noise."""
    return SamplingConfig.from_dict(sampling, type_rules=False).reachable_noise_steps()


def local_sample_count(cfg: Config, world_size: int) -> int:
    """Candidates one rank generates and trains on per rollout (trainer/loop.py's split)."""
    r = cfg.rollout
    return (r.rollout_batch_size // world_size) * r.n_samples_per_prompt


def train_sample_count(cfg: Config, world_size: int) -> int:
    """Candidates one rank trains on per rollout: its own slice, or under sequence
    parallelism the slices of its sequence group (a degree the world does not divide is
    refused by its own rule and counts as 1 here)."""
    degree = cfg.fsdp.sequence_parallel
    joined = degree if not world_problems(degree, world_size) else 1
    return local_sample_count(cfg, world_size) * joined


def _check_model(c: Checker) -> None:
    m = c.cfg.model
    if m.task not in GENERATION_TASKS:
        c.error(f"{flagged('model.task')}={m.task!r} is not a generation task "
                f"(GENERATION_TASKS = {GENERATION_TASKS})")
    if not m.adapter_path:
        c.error(f"{flagged('model.adapter_path')} is required")
    elif not _DOTPATH.match(m.adapter_path):
        c.error(f"{flagged('model.adapter_path')}={m.adapter_path!r} is not a module.Class dotpath")
    if not m.model_path:
        c.error(f"{flagged('model.model_path')} is required")
    elif c.check_paths and m.model_path != "toy" and not Path(m.model_path).is_dir():
        c.error(f"{flagged('model.model_path')}={m.model_path!r} is not a directory"
                + download_hint(m.model_path))


def _check_trainable(c: Checker) -> None:
    f, lora, ws = c.cfg.fsdp, c.cfg.lora, c.cfg.weight_sync
    if c.one_of("fsdp.trainable_mode", f.trainable_mode, TRAINABLE_MODES):
        if f.trainable_mode == "lora" and lora.rank <= 0:
            c.error(f"{flagged('fsdp.trainable_mode')}='lora' needs {flagged('lora.rank')} > 0, "
                    f"got {lora.rank}")
        if f.trainable_mode == "full" and lora.rank > 0:
            c.error(f"{flagged('lora.rank')}={lora.rank} needs {flagged('fsdp.trainable_mode')}='lora' "
                    f"(got 'full'): the two must agree")
    if lora.rank < 0:
        c.error(f"{flagged('lora.rank')}={lora.rank} must be >= 0")
    if lora.rank > 0:
        if lora.dropout != 0:
            c.error(f"{flagged('lora.dropout')}={lora.dropout} must be 0: a stochastic forward "
                    f"breaks ratio == 1 on the first update")
        if f.cpu_offload:
            c.error(f"{flagged('fsdp.cpu_offload')} is not allowed with LoRA: gradient clipping "
                    f"of CPU-offloaded adapter DTensors has no communication backend")
        if lora.alpha < 0:
            c.error(f"{flagged('lora.alpha')}={lora.alpha} must be >= 0 (0 means alpha = rank)")
        if lora.target_modules is not None and (
                not lora.target_modules
                or not all(isinstance(t, str) and t for t in lora.target_modules)):
            c.error(f"{flagged('lora.target_modules')}={lora.target_modules!r} must be a "
                    f"non-empty list of module-name suffixes (or unset: the adapter's default)")
        # the LoRA tensors are kept in the master dtype, or without one in the param dtype
        if (f.master_dtype or f.param_dtype) != "fp32":
            c.warn(f"LoRA without {flagged('fsdp.master_dtype')}='fp32': a bf16 master copy rounds "
                   f"away ~1e-4 relative RL updates and the policy stops moving")
    elif lora.adapter_mode:
        c.error(f"{flagged('lora.adapter_mode')} needs LoRA ({flagged('lora.rank')} > 0)")
    if lora.init_path:
        if lora.rank <= 0:
            c.error(f"{flagged('lora.init_path')} needs LoRA ({flagged('lora.rank')} > 0)")
        if c.check_paths and not Path(lora.init_path).exists():
            c.error(f"{flagged('lora.init_path')}={lora.init_path!r} does not exist")
    if f.cpu_offload and lora.rank <= 0:
        c.warn(f"{flagged('fsdp.cpu_offload')}: FSDP collectives on CPU-offloaded DTensors "
               f"(clip_grad_norm_) fail with 'No backend type associated with device type "
               f"cpu'; prefer --offload-train")
    if ws.mode is not None and c.one_of("weight_sync.mode", ws.mode, SYNC_MODES):
        derived = c.cfg.sync_mode
        if ws.mode != derived:
            why = ("full training syncs the full transformer" if derived == "full" else
                   f"LoRA with lora.adapter_mode={lora.adapter_mode} syncs {derived!r}")
            c.error(f"{flagged('weight_sync.mode')}={ws.mode!r} contradicts the mode derived from "
                    f"the LoRA flags ({derived!r}: {why}); leave it unset")


def _transformer_config(c: Checker) -> dict | None:
    """The diffusers config of the transformer the run trains (under model.model_path, or the
    shipped toy's), where it can be read: the sequence split needs its class and heads. An
    unreadable one is left to the model rules and the loader, which name it."""
    m = c.cfg.model
    root = weights_dir() if m.model_path == "toy" else Path(m.model_path)
    config = root / "transformer" / "config.json"
    if not c.check_paths or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _check_sequence_parallel(c: Checker) -> None:
    """The sequence split's rules (trainer.parallel.rules): the degree divides the world, and,
    where the transformer's config can be read, its family is one whose split is tested and,
    where the degree does not divide its heads (ring attention), the launch device can run
    it. The loop gives a sequence group's ranks the same samples (trainer.parallel.group_batch);
    the split lengths of each forward are checked by the actor, since they depend on the
    batch."""
    degree = c.cfg.fsdp.sequence_parallel
    problems = world_problems(degree, c.world_size if c.world_size is not None else degree)
    config = _transformer_config(c) if not problems and degree > 1 else None
    if config is not None:
        problems += family_problems(degree, str(config.get("_class_name")))
        heads = config.get("num_attention_heads")
        if is_int(heads) and uses_ring(degree, heads) and c.device in ("cpu", "cuda"):
            problems += ring_problems(degree, model="the transformer at model.model_path",
                                      transformer_class=str(config.get("_class_name")),
                                      device_type=c.device,
                                      compute_dtype=c.cfg.fsdp.param_dtype)
    for problem in problems:
        c.error(problem.replace(KEY, flagged(KEY), 1))


def _check_sampling(c: Checker) -> None:
    """Every rule of trainer.config.sampling.SamplingConfig, on the config the loader merged
    (unknown keys were refused there, where they were set), the SDE type's from its table."""
    config, problems = SamplingConfig.check(c.cfg.rollout.sampling)
    for problem in problems:
        c.error(f"rollout.sampling.{problem} (--sampling-config)")
    if config is not None and c.cfg.rollout.engine == "sglang":
        # the wire carries these options in extra_sampling_params, which a stock SGLang
        # server ignores: it would sample another transition than the one replayed
        if config.sigma_one != "refuse" or config.log_prob_form != "gaussian":
            c.error(f"{flagged('sampling.sigma_one')} / cps_log_prob: sigma_one="
                    f"{config.sigma_one!r}, cps_log_prob={config.cps_log_prob!r} are applied by "
                    f"the embedded engine only; {flagged('rollout.engine')}='sglang' would sample "
                    f"with its own defaults")
        # CFG on SGLang is refused with the other stock-SGLang limits (sglang_config_problems)
    if config is not None and not problems and not config.reachable_trained_steps():
        c.error("rollout.sampling (--sampling-config): the sampling config resolves to no SDE "
                "step (set sde_indices, or num_sde_steps with sde_pool / sde_timestep_fraction, "
                "or sde_step_mode='every_step')")


def _check_geometry(c: Checker) -> None:
    r, t = c.cfg.rollout, c.cfg.train
    rbs_ok = c.at_least("rollout.rollout_batch_size", r.rollout_batch_size, 1)
    n_ok = c.at_least("rollout.n_samples_per_prompt", r.n_samples_per_prompt, 2,
                      " for grpo: a group of one has no reward variance, every advantage is 0")
    upd_ok = c.at_least("train.num_updates_per_batch", t.num_updates_per_batch, 1)
    auto_mb = t.micro_batch_size == "auto"
    if isinstance(t.micro_batch_size, str) and not auto_mb:
        c.error(f"{flagged('train.micro_batch_size')}={t.micro_batch_size!r} must be a positive "
                f"integer or 'auto'")
        mb_ok = False
    else:
        mb_ok = auto_mb or c.at_least("train.micro_batch_size", t.micro_batch_size, 1)
    if not 0.0 < t.micro_batch_memory_fraction <= 1.0:
        c.error(f"{flagged('train.micro_batch_memory_fraction')}={t.micro_batch_memory_fraction!r} "
                f"must be in (0, 1]")
    if t.micro_batch_memory_gb is not None and not t.micro_batch_memory_gb > 0:
        c.error(f"{flagged('train.micro_batch_memory_gb')}={t.micro_batch_memory_gb!r} must be > 0")
    c.one_of("model.compile", c.cfg.model.compile, ("auto", "blocks", "none"))
    c.one_of("fsdp.offload_policy", c.cfg.fsdp.offload_policy, ("always", "as_needed"))
    c.at_least("train.num_rollouts", t.num_rollouts, 1)
    c.one_of("train.advantage_estimator", t.advantage_estimator, ("grpo",))
    c.one_of("train.anchor", t.anchor, ("replay", "engine"))
    c.one_of("train.gc", t.gc, ("auto", "rollout", "python"))
    if t.num_updates_per_batch == 1:
        c.warn(f"{flagged('train.num_updates_per_batch')}=1: the ratio is 1 throughout, so with "
               f"group-centred advantages the clipped loss is 0 by construction; use >= 2")
    world = c.world_size
    if rbs_ok and world is not None and r.rollout_batch_size % world:
        c.error(f"{flagged('rollout.rollout_batch_size')}={r.rollout_batch_size} is not divisible "
                f"by the world size {world} (each rank generates its own groups)")
        return
    if not (rbs_ok and n_ok and upd_ok and mb_ok):
        return
    total = r.rollout_batch_size * r.n_samples_per_prompt
    if r.global_batch_size is not None and r.global_batch_size != total:
        c.error(f"{flagged('rollout.global_batch_size')}={r.global_batch_size} != rollout_batch_size "
                f"* n_samples_per_prompt = {r.rollout_batch_size} * {r.n_samples_per_prompt} "
                f"= {total}")
    # Without a world size, the global count is the necessary condition (it divides by world).
    local = train_sample_count(c.cfg, world) if world is not None else total
    where = f"the {local} samples per rank" if world is not None else f"the {total} samples"
    if world is not None and local != local_sample_count(c.cfg, world):
        where = f"the {local} samples each rank trains on (its sequence group's slices)"
    n_upd = t.num_updates_per_batch
    if local % n_upd:
        c.error(f"{flagged('train.num_updates_per_batch')}={n_upd} does not divide {where} "
                f"(updates must be disjoint and equal)")
    elif not auto_mb and (local // n_upd) % t.micro_batch_size:
        c.error(f"{flagged('train.micro_batch_size')}={t.micro_batch_size} does not divide the "
                f"{local // n_upd} samples of one update ({where} / {n_upd} updates)")


def _check_optim(c: Checker) -> None:
    t = c.cfg.train
    if not 0.0 < t.eps_clip < 1.0:
        c.error(f"{flagged('train.eps_clip')}={t.eps_clip!r} must be in (0, 1)")
    if t.eps_clip_high is not None and not t.eps_clip_high > 0:
        c.error(f"{flagged('train.eps_clip_high')}={t.eps_clip_high!r} must be > 0")
    if not t.adam_eps > 0:
        c.error(f"{flagged('train.adam_eps')}={t.adam_eps!r} must be > 0")
    for name in ("adam_beta1", "adam_beta2"):
        v = getattr(t, name)
        if not 0.0 <= v < 1.0:
            c.error(f"{flagged('train.' + name)}={v!r} must be in [0, 1)")
    if not t.lr > 0:
        c.error(f"{flagged('train.lr')}={t.lr!r} must be > 0")
    if not 0.0 <= t.min_lr <= max(t.lr, 0.0):
        c.error(f"{flagged('train.min_lr')}={t.min_lr!r} must be in [0, lr={t.lr}]")
    c.at_least("train.lr_warmup_iters", t.lr_warmup_iters, 0)
    c.at_least("train.weight_decay", t.weight_decay, 0.0)
    c.at_least("train.clip_grad", t.clip_grad, 0.0)
    if t.lr_decay_iters is not None:
        c.at_least("train.lr_decay_iters", t.lr_decay_iters, 1)
    if c.one_of("train.lr_scheduler", t.lr_scheduler, LR_SCHEDULERS):
        if t.lr_scheduler == "constant" and t.lr_decay_iters is not None:
            c.warn(f"{flagged('train.lr_decay_iters')}={t.lr_decay_iters} is ignored: "
                   f"{flagged('train.lr_scheduler')} is 'constant'")
        if t.lr_scheduler != "constant" and t.lr_decay_iters is None:
            c.error(f"{flagged('train.lr_scheduler')}={t.lr_scheduler!r} needs "
                    f"{flagged('train.lr_decay_iters')} (the decay length in optimizer steps)")
    c.one_of("train.kl_form", t.kl_form, KL_FORMS)
    if t.kl_coef < 0:
        c.error(f"{flagged('train.kl_coef')}={t.kl_coef} must be >= 0")
    elif t.kl_coef > 0 and c.cfg.lora.rank <= 0:
        c.error(f"{flagged('train.kl_coef')}={t.kl_coef} needs LoRA: the KL reference is the model "
                f"with its adapter disabled; full training keeps no reference model")


def _check_dtypes(c: Checker) -> None:
    f, ws = c.cfg.fsdp, c.cfg.weight_sync
    c.one_of("fsdp.param_dtype", f.param_dtype, RUN_DTYPES)
    c.one_of("fsdp.reduce_dtype", f.reduce_dtype, RUN_DTYPES)
    if f.master_dtype is not None:
        c.one_of("fsdp.master_dtype", f.master_dtype, RUN_DTYPES)
    c.one_of("rollout.engine_dtype", c.cfg.rollout.engine_dtype, RUN_DTYPES)
    if ws.wire_dtype != "bf16":
        if ws.wire_dtype == "fp32" and (c.device == "cpu"
                                        or c.cfg.rollout.engine_dtype == "fp32"):
            return  # our extension, see the module docstring
        c.error(f"{flagged('weight_sync.wire_dtype')}={ws.wire_dtype!r} must be 'bf16' "
                f"('fp32' is accepted only on a CPU-only run, launch.device='cpu', or with "
                f"an fp32 engine, rollout.engine_dtype='fp32')")


def _check_launch(c: Checker) -> None:
    r, la, ws = c.cfg.rollout, c.cfg.launch, c.cfg.weight_sync
    c.one_of("launch.device", la.device, DEVICES)
    if not la.colocate:
        c.error(f"{flagged('launch.colocate')} must be on: only synchronous colocate is supported")
    if la.nproc is not None:
        c.at_least("launch.nproc", la.nproc, 1)
    gpe = r.num_gpus_per_engine
    if c.at_least("rollout.num_gpus_per_engine", gpe, 1):
        if c.world_size is not None and c.world_size % gpe:
            c.error(f"world size {c.world_size} is not divisible by "
                    f"{flagged('rollout.num_gpus_per_engine')}={gpe}: each engine's GPUs must tile "
                    f"the FSDP ranks for CUDA-IPC weight sync")
        elif c.gpus_per_node is not None and c.gpus_per_node % gpe:
            c.error(f"{c.gpus_per_node} GPUs per node are not divisible by "
                    f"{flagged('rollout.num_gpus_per_engine')}={gpe}: an engine cannot span nodes "
                    f"(CUDA IPC is host-local)")
    if c.one_of("rollout.engine", r.engine, ENGINES):
        if r.engine == "sglang":
            urls = r.sglang_urls or []
            if c.world_size is not None and len(urls) != c.world_size:
                c.error(f"{flagged('rollout.sglang_urls')}: engine 'sglang' needs one URL per rank "
                        f"({c.world_size}), got {len(urls)}")
            elif not urls:
                c.error(f"{flagged('rollout.sglang_urls')}: engine 'sglang' needs one URL per rank")
            bad = [u for u in urls if not (isinstance(u, str) and u.startswith(("http://",
                                                                              "https://")))]
            if bad:
                c.error(f"{flagged('rollout.sglang_urls')}: not http(s) URLs: {bad}")
            # Local: trainer.engine imports torch, and preflight stays torch-free unless the
            # run talks to SGLang.
            from trainer.engine.sglang.sync import sglang_config_problems
            for problem in sglang_config_problems(c.cfg.model, c.cfg.rollout, c.cfg.lora):
                c.error(problem)
        elif r.sglang_urls:
            c.warn(f"{flagged('rollout.sglang_urls')} is ignored with rollout.engine='embedded'")
    if c.one_of("weight_sync.backend", ws.backend, SYNC_BACKENDS):
        if ws.backend == "cuda" and la.device == "cpu":
            c.error(f"{flagged('weight_sync.backend')}='cuda' cannot run with launch.device='cpu'")
    c.at_least("weight_sync.bucket_size_mb", ws.bucket_size_mb, 1)
    if not ws.timeout_s > 0:
        c.error(f"{flagged('weight_sync.timeout_s')}={ws.timeout_s} must be > 0")
    c.at_least("weight_sync.max_retries", ws.max_retries, 0)
    if r.wave_size is not None:
        c.at_least("rollout.wave_size", r.wave_size, 1)
    if r.write_artifacts and r.artifact_retention_rollouts <= 0:
        c.warn(f"{flagged('rollout.artifact_retention_rollouts')}={r.artifact_retention_rollouts} "
               f"keeps every rollout's sidecars and images: the volume grows without bound")


def _check_reward(c: Checker) -> None:
    rw = c.cfg.reward
    c.one_of("reward.std_mode", rw.std_mode, STD_MODES)
    for name in ("adv_eps", "adv_clip_max"):
        value = getattr(rw, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            c.error(f"{flagged('reward.' + name)}={value!r} must be > 0 (or unset)")
    if c.one_of("reward.runtime", rw.runtime, REWARD_RUNTIMES) and rw.runtime == "remote":
        if not rw.endpoint:
            c.error(f"{flagged('reward.endpoint')} is required with reward.runtime='remote'")
        elif not rw.endpoint.startswith(("http://", "https://")):
            c.error(f"{flagged('reward.endpoint')}={rw.endpoint!r} is not an http(s) URL")
    if not rw.scorer_path and not rw.custom_reward_path and rw.runtime != "remote" \
            and not rw.scorers:
        c.error(f"{flagged('reward.scorer_path')} is required unless "
                f"{flagged('reward.custom_reward_path')} is set or reward.runtime='remote'")
    for problem in static_problems(rw, check_paths=c.check_paths):
        c.error(problem)
    for name in ("scorer_path", "custom_reward_path"):
        v = getattr(rw, name)
        if v and not _DOTPATH.match(v):
            c.error(f"{flagged('reward.' + name)}={v!r} is not a dotpath")
    missing = [comp for comp in rw.required_components if comp not in rw.component_weights]
    if missing and not rw.scorers:  # with scorer tables, check_imports knows the weights
        c.error(f"{flagged('reward.required_components')} {missing} have no weight in "
                f"{flagged('reward.component_weights')}")
    bad = {k: v for k, v in rw.component_weights.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)}
    if bad:
        c.error(f"{flagged('reward.component_weights')} must be finite numbers, got {bad}")
    if not rw.timeout_s > 0:
        c.error(f"{flagged('reward.timeout_s')}={rw.timeout_s} must be > 0")
    if c.check_paths and rw.model_path and not Path(rw.model_path).exists():
        c.error(f"{flagged('reward.model_path')}={rw.model_path!r} does not exist")


RULES: tuple[Callable[[Checker], None], ...] = (
    _check_model, _check_trainable, _check_sequence_parallel, _check_sampling, _check_geometry,
    _check_optim, _check_dtypes, _check_launch, _check_reward, check_data, check_logging,
    check_reliability, check_algorithm, check_reference_options, check_finite_numbers)


def preflight(cfg: Config, *, world_size: int | None = None, gpus_per_node: int | None = None,
              device: str | None = None, check_paths: bool = True) -> list[str]:
    """Check ``cfg``; return the warnings (also logged), raise ONE ConfigError with every error.

    Args:
        world_size: total ranks. Default: ``launch.nproc * launch.nnodes`` when both are plain
            integers, else unknown, and the world-dependent rules check the global batch only.
        gpus_per_node: ranks per node. Default: ``launch.nproc``.
        device: the resolved device kind, ``"cpu"`` or ``"cuda"``. Default:
            ``launch.device`` (``"auto"`` is treated as not CPU-only).
        check_paths: check that model, data, reward-model and resume paths exist; shipped
            recipes carry placeholder paths, so their tests turn it off.
    """
    la = cfg.launch
    if world_size is None and la.nproc is not None and str(la.nnodes).strip().isdigit():
        world_size = la.nproc * int(la.nnodes)
    if gpus_per_node is None:
        gpus_per_node = la.nproc
    checker = Checker(cfg, world_size, gpus_per_node, device or la.device, check_paths)
    problems = []
    if world_size is not None and (not is_int(world_size) or world_size < 1):
        problems.append(f"world_size={world_size!r} must be a positive integer")
        checker.world_size = None
    for rule in RULES:
        rule(checker)
    for w in checker.warnings:
        log.warning("%s", w)
    if problems or checker.errors:
        raise ConfigError(problems + checker.errors)
    return checker.warnings
