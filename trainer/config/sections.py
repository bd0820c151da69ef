"""The run configuration's sections: one dataclass per TOML table, each field with its flag
and its docstring in ``metadata``, and the lookups over them (flags, types).

Loading, precedence and writing are ``trainer.config``; applying one value (coercion, nested
``--set``) is ``trainer.config.overrides``. This module imports no torch: preflight runs before
anything heavy loads.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from trainer.config.sampling import RELAX_SAMPLING, SamplingConfig


def _f(default: Any, flag: str, doc: str) -> Any:
    """A config field with its alias flag and docstring."""
    meta = {"flag": flag, "doc": doc}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: json.loads(json.dumps(d)), metadata=meta)
    return field(default=default, metadata=meta)


# The keys, their defaults and their rules live in trainer.config.sampling.SamplingConfig; the
# section's default is the project's Relax-style table (frozen, so one instance serves all).
DEFAULT_SAMPLING: SamplingConfig = SamplingConfig.from_dict(RELAX_SAMPLING)


@dataclass
class ModelConfig:
    task: str = _f("t2i", "--generation-task", "Generation task; only 't2i' exists.")
    adapter_path: str = _f("trainer.toy.adapter.ToyAdapter", "--model-adapter-path",
                           "Dotpath of the GenerativeModelAdapter class for the model family.")
    model_path: str = _f("toy", "--model-path",
                         "Diffusers-layout model directory; 'toy' means the shipped toy model.")
    revision: str | None = _f(None, "--model-revision",
                              "Optional revision; part of the base-model hash.")
    adapter_options: dict = _f({}, "--model-adapter-options",
                               "Extra keyword arguments for the adapter (JSON dict).")
    compile: str = _f("auto", "--compile",
                      "torch.compile of the transformer in the actor and the engine: 'blocks' "
                      "(each repeated block, before FSDP2 wraps it), 'none' (eager), or 'auto' "
                      "(blocks on CUDA, eager on the CPU, where compiling costs more than it "
                      "saves at toy sizes).")


@dataclass
class RolloutConfig:
    rollout_batch_size: int = _f(4, "--rollout-batch-size",
                                 "Prompts (groups) per rollout, over all ranks.")
    n_samples_per_prompt: int = _f(8, "--n-samples-per-prompt",
                                   "Candidates per prompt: the GRPO group size.")
    global_batch_size: int | None = _f(None, "--global-batch-size",
                                       "rollout_batch_size * n_samples_per_prompt; None derives it, a "
                                       "value is checked (re-derived when the command line "
                                       "changes a factor but not it).")
    sampling: SamplingConfig = _f(DEFAULT_SAMPLING, "--sampling-config",
                                  "Sampling geometry and SDE steps (a table / JSON dict of "
                                  "trainer.config.sampling.SamplingConfig's keys; a partial "
                                  "table sets its keys only), read by adapter, driver and "
                                  "replay.")
    generation_seed: int = _f(1234, "--generation-seed",
                              "Base seed of x_T and every step's noise (with the sample ids).")
    rollout_seed: int = _f(42, "--rollout-seed", "Seed of the prompt order.")
    engine: str = _f("embedded", "--rollout-engine",
                     "'embedded' (our engine process per GPU) or 'sglang' (a running server).")
    sglang_urls: list = _f([], "--sglang-urls", "One SGLang diffusion server URL per rank.")
    sglang_weight_sync: str = _f("tensor", "--sglang-weight-sync",
                                 "'tensor' (/update_weights_from_tensor) or 'disk' "
                                 "(/update_weights_from_disk from <run_dir>/sglang_weights).")
    sglang_extension: bool = _f(False, "--sglang-extension",
                                "The SGLang servers load trainer.engine.sglang.extension "
                                "(driver sigmas, x_T and step noise, dance; weight sync through "
                                "its receivers when it publishes them); off: stock SGLang.")
    sglang_concurrency: int = _f(8, "--sglang-concurrency",
                                 "SGLang rollout requests (one per candidate) in flight per rank.")
    engine_dtype: str = _f("bf16", "--rollout-dtype", "Engine weight dtype: bf16 or fp32.")
    num_gpus_per_engine: int = _f(1, "--rollout-num-gpus-per-engine",
                                  "GPUs per engine; the world size must be divisible by it.")
    wave_size: int | None = _f(None, "--rollout-wave-size",
                               "Groups per engine request; None sends a rank's groups at once.")
    artifact_root: str | None = _f(None, "--artifact-root",
                                   "Sidecars and PNGs; default <run_dir>/artifacts.")
    artifact_retention_rollouts: int = _f(2, "--artifact-retention-rollouts",
                                          "Rollouts of artifacts kept; <= 0 keeps all.")
    write_artifacts: bool = _f(True, "--write-artifacts", "Write sidecars/PNGs per rollout.")
    offload_rollout: bool = _f(False, "--offload-rollout",
                               "Release engine memory while the actor trains.")
    engine_timeout_floor_s: float = _f(120.0, "--engine-timeout-floor",
                                       "Least time any engine call may take before it counts "
                                       "as hung (seconds).")
    engine_timeout_per_sample_s: float = _f(30.0, "--engine-timeout-per-sample",
                                            "Added to the floor per requested image.")
    engine_max_restarts: int = _f(2, "--engine-max-restarts",
                                  "Engine restarts (+ weight re-sync) after a hang or death "
                                  "before the run stops; 0 stops at the first.")


@dataclass
class RewardConfig:
    runtime: str = _f("cpu", "--reward-runtime", "colocate | cpu | remote.")
    scorer_path: str | None = _f("trainer.toy.reward.ToyCompositionScorer", "--reward-scorer-path",
                                 "Dotpath of a RewardScorer.")
    model_path: str | None = _f(None, "--reward-model-path", "Local model dir of the scorer.")
    endpoint: str | None = _f(None, "--reward-endpoint", "HTTP endpoint for runtime=remote.")
    custom_reward_path: str | None = _f(None, "--custom-reward-path",
                                        "Dotpath module.fn of a custom reward function.")
    required_components: list = _f([], "--reward-required-components",
                                   "Components that must be present and finite (JSON list).")
    component_weights: dict = _f({}, "--reward-component-weights",
                                 "{component: weight} combining normalised components.")
    std_mode: str = _f("group", "--generative-advantage-std-mode",
                       "group | batch (one std over every rank's batch: Flow-GRPO's global_std) "
                       "| none.")
    adv_eps: float | None = _f(None, "--advantage-eps",
                               "Divisor std + eps; None: 1e-6 (Flow-GRPO reference: 1e-4).")
    adv_clip_max: float | None = _f(None, "--advantage-clip-max",
                                    "Clamp advantages to [-x, x]; None: no clamp (reference: 5).")
    zero_degenerate_groups: bool = _f(True, "--zero-degenerate-groups",
                                      "Zero groups with reward variance < 1e-6 (the reference "
                                      "does not: false).")
    timeout_s: float = _f(60.0, "--reward-timeout",
                          "Remote scorer deadline per request attempt (connect, send, whole "
                          "reply), in seconds.")
    custom_timeout_s: float = _f(600.0, "--custom-reward-timeout",
                                 "Deadline of each call into the custom reward function "
                                 "(and its factory), in seconds.")
    scorers: dict = _f({}, "--reward-scorers",
                       "Several weighted scorers: [reward.scorers.NAME] tables with weight, "
                       "model_path, required, path and the scorer's own options "
                       "(trainer/rewards/spec.py).")


@dataclass
class TrainConfig:
    num_rollouts: int = _f(10, "--num-rollout", "Rollout/train iterations to run.")
    num_updates_per_batch: int = _f(2, "--num-updates-per-batch",
                                    "Disjoint optimizer updates per rollout batch.")
    micro_batch_size: int | str = _f(
        "auto", "--micro-batch-size",
        "Samples per forward+backward; each forward carries all their trained steps as rows. "
        "'auto': the largest divisor of the update that fits the GPU memory free at train "
        "time (measured once by a one-sample probe); on the CPU the whole update.")
    micro_batch_memory_fraction: float = _f(
        0.9, "--micro-batch-memory-fraction",
        "auto micro-batch: the share of the free GPU memory its replay may use.")
    micro_batch_memory_gb: float | None = _f(
        None, "--micro-batch-memory-gb",
        "auto micro-batch: a fixed budget in GiB instead of the measured free memory.")
    eps_clip: float = _f(1e-4, "--eps-clip", "PPO clip range.")
    eps_clip_high: float | None = _f(None, "--eps-clip-high", "Optional asymmetric upper clip.")
    kl_coef: float = _f(0.0, "--kl-coef",
                        "KL to the frozen reference (LoRA only: adapter disabled). Our extension.")
    kl_form: str = _f("gaussian", "--kl-form",
                      "gaussian (closed-form KL of the two transitions) | reference (Flow-GRPO's "
                      "mean((mean - mean_ref)^2) / (2 std_dev_t^2): its beta is kl_coef).")
    drop_zero_advantage: bool = _f(False, "--drop-zero-advantage",
                                   "Average the update over the non-zero-advantage rows only "
                                   "(the Flow-GRPO reference filters zero rows out).")
    advantage_estimator: str = _f("grpo", "--advantage-estimator", "Only 'grpo'.")
    lr: float = _f(3e-4, "--lr", "Peak learning rate.")
    min_lr: float = _f(0.0, "--min-lr", "Floor of linear/cosine decay.")
    lr_warmup_iters: int = _f(0, "--lr-warmup-iters", "Warmup in optimizer steps.")
    lr_decay_iters: int | None = _f(None, "--lr-decay-iters", "Decay length in optimizer steps.")
    lr_scheduler: str = _f("constant", "--fsdp-lr-scheduler", "constant | linear | cosine.")
    weight_decay: float = _f(0.0, "--weight-decay", "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "--adam-beta1", "AdamW beta1.")
    adam_beta2: float = _f(0.999, "--adam-beta2", "AdamW beta2.")
    adam_eps: float = _f(1e-8, "--adam-eps", "AdamW eps.")
    adam_fused: bool | None = _f(None, "--adam-fused",
                                 "torch's fused AdamW (one kernel per step over all parameters) "
                                 "instead of its foreach one; same maths. None (default): fused "
                                 "when the parameters are on a GPU (faster, less peak memory), "
                                 "foreach on the CPU.")
    clip_grad: float = _f(1.0, "--clip-grad", "Grad-norm clip before each optimizer step.")
    skip_on_device: bool = _f(
        True, "--skip-on-device",
        "Skip an optimizer step whose gradient norm is not finite on the device (fused "
        "AdamW's found_inf, the learning rate read from a device table), so the host never "
        "waits for the norm and keeps queueing work ahead of the GPU. Applies with fused AdamW "
        "and no EMA; otherwise the host reads the norm before every step.")
    adam_on_local_shards: bool = _f(
        True, "--adam-on-local-shards",
        "Run AdamW's step on the FSDP2 parameters' local shards as plain tensors (the same "
        "elementwise arithmetic, equal bit for bit) instead of through DTensor's per-op "
        "dispatch, whose host time exceeds a LoRA step's GPU time. The optimizer's step "
        "hooks run as in optimizer.step(); a Partial placement falls back to it.")
    fold_clip: bool = _f(
        True, "--fold-clip",
        "With fused AdamW stepping the local shards, pass the grad-norm clip to the step as "
        "its grad_scale (the kernel divides each gradient as it reads it) instead of scaling "
        "the gradients in a pass of their own. Without clipping the step is the same bit for "
        "bit; with it, a gradient may differ in its last bit.")
    seed: int = _f(0, "--seed", "Seed of model init (LoRA) and everything not sampling.")
    max_rollouts_without_step: int = _f(10, "--max-rollouts-without-step",
                                        "Stop with an error after this many consecutive "
                                        "rollouts with no optimizer step; 0 never stops.")
    gc: str = _f("auto", "--train-gc",
                 "Python garbage collection: 'rollout' (automatic collection off; after the first "
                 "step the live heap is frozen and one full collection runs while the engine "
                 "generates each rollout, so none pauses the host inside the train stage), "
                 "'python' (Python's own schedule), 'auto' (rollout on CUDA, python on CPU).")
    anchor: str = _f("replay", "--train-anchor",
                     "pi_old source: 'replay' (actor's own no-grad replay before any optimizer "
                     "step: first ratio exactly 1) or 'engine' (the engine's recorded log-probs).")
    # ---- the algorithm (docs/algorithms.md: each formula, its source, every departure) ----
    algorithm: str = _f("flowgrpo", "--algorithm",
                        "flowgrpo (the sampling config's SDE steps, unchanged) | flowgrpo_fast "
                        "(shared ODE trunk, a branch window of SDE steps drawn per rollout, only "
                        "those trained) | mixgrpo (an SDE window sliding over the schedule as "
                        "training goes) | diffusionnft (ODE sampling, the NFT loss on the re-noised "
                        "final samples; embedded engine).")
    grpo_guard: bool = _f(False, "--grpo-guard",
                          "GRPO-Guard on the GRPO family: ratio re-centred by the mean shift and "
                          "scaled by the step's std, each step's term divided by |dt|.")
    fast_branch_range: list = _f([0, 5], "--fast-branch-range",
                                 "flowgrpo_fast: [lo, hi]; the branch window starts uniformly in "
                                 "lo..hi - size (the reference's sde_window_range).")
    fast_branch_steps: int = _f(2, "--fast-branch-steps",
                                "flowgrpo_fast: SDE (trained) steps from the branch on "
                                "(the reference's sde_window_size).")
    mix_window_size: int = _f(4, "--mix-window-size",
                              "mixgrpo: SDE (trained) steps in the window (MixGRPO group_size).")
    mix_shift_interval: int = _f(25, "--mix-shift-interval",
                                 "mixgrpo: rollouts before the window moves (iters_per_group).")
    mix_window_stride: int = _f(1, "--mix-window-stride",
                                "mixgrpo: steps the window moves each time (prog_overlap_step).")
    mix_flash_ratio: float | None = _f(None, "--mix-flash-ratio",
                                       "mixgrpo: MixGRPO-Flash; the steps after the window "
                                       "taken by DPM-Solver++(2M) on max(int(steps_after * "
                                       "ratio), 2) points (dpm_post_compress_ratio, 0.4 in "
                                       "the reference); unset: Euler on every step.")
    mix_roll_back: bool = _f(False, "--mix-roll-back",
                             "mixgrpo: restart the window at step 0 after the last start "
                             "(roll_back); else it stays at the last start.")
    nft_beta: float = _f(1.0, "--nft-beta",
                         "diffusionnft: mix of the current and old velocity in the implicit "
                         "policies (the reference's config.beta).")
    nft_adv_clip_max: float = _f(5.0, "--nft-adv-clip-max",
                                 "diffusionnft: advantage clip C; r = clip(A / C / 2 + 1/2, 0, 1).")
    nft_old_decay_delay: int = _f(0, "--nft-old-decay-delay",
                                  "diffusionnft: optimizer steps before the old policy lags "
                                  "(old <- d old + (1 - d) current, d = 0 before; decay_type 1: 0).")
    nft_old_decay_ramp: float = _f(0.001, "--nft-old-decay-ramp",
                                   "diffusionnft: d grows by this per optimizer step (decay_type 1).")
    nft_old_decay_cap: float = _f(0.5, "--nft-old-decay-cap",
                                  "diffusionnft: the largest d (decay_type 1: 0.5; 2: 0.999).")


@dataclass
class FSDPConfig:
    trainable_mode: str = _f("full", "--fsdp-trainable-mode", "full | lora (must match lora rank).")
    param_dtype: str = _f("bf16", "--fsdp-param-dtype", "Compute dtype of gathered params.")
    reduce_dtype: str = _f("fp32", "--fsdp-reduce-dtype", "Gradient reduce dtype.")
    master_dtype: str | None = _f(None, "--fsdp-master-dtype",
                                  "Storage dtype of trainable params; None keeps load dtype.")
    reshard_after_forward: bool | None = _f(
        None, "--fsdp-reshard-after-forward",
        "Free each block's gathered parameters after its forward and gather them again in "
        "backward (False trades memory for speed). None (default): False at world size 1, where "
        "the gathered copy is the only copy worth keeping and re-gathering is pure cost; True "
        "otherwise.")
    shard_frozen: bool | None = _f(
        None, "--fsdp-shard-frozen",
        "Shard the frozen parameters (a LoRA actor's base) with FSDP2. None (default): only at "
        "world size > 1. At world size 1 sharding saves no memory, and FSDP2 would copy the "
        "whole base into its gather buffer before forwards; unsharded, the base stays a plain "
        "tensor in the compute dtype and only the adapter goes through FSDP2.")
    block_units: bool | None = _f(
        None, "--fsdp-block-units",
        "One FSDP2 unit per transformer block (True) or one unit for the whole model (False). "
        "None (default): per block, except at world size 1 with the frozen parameters left "
        "unsharded (a LoRA actor): there the units hold only the adapter, nothing is "
        "overlapped, and each block's gather and gradient-reduce hooks cost host time that "
        "leaves the GPU idle.")
    accumulate_unsharded: bool | None = _f(
        None, "--fsdp-accumulate-unsharded",
        "Within one optimizer update, keep every unit's gathered parameters and accumulate its "
        "gradients unsharded in reduce_dtype across the micro-batches, reducing them once at the "
        "last one (FSDP2's set_requires_gradient_sync / set_reshard_after_backward): one gather "
        "and one gradient reduce per update instead of one per micro-batch, the same numbers. "
        "Costs every rank the whole model's gathered parameters and reduce_dtype gradients. "
        "None (default): on at world size 1, where a shard is the whole and that costs nothing "
        "more; off otherwise.")
    activation_checkpointing: bool = _f(False, "--fsdp-activation-checkpointing",
                                        "Recompute each transformer block in backward.")
    cpu_offload: bool = _f(False, "--fsdp-cpu-offload", "FSDP2 CPU param offload (not LoRA).")
    load_wave_size: int = _f(0, "--fsdp-load-wave-size", "Ranks loading at once; 0 = all.")
    offload_train: bool = _f(False, "--offload-train",
                             "Free actor params/grads and move AdamW state to host in rollout.")
    offload_policy: str = _f(
        "as_needed", "--offload-policy",
        "When offload_train / rollout.offload_rollout run: 'always' (every step), or "
        "'as_needed' (measured on the first step; skipped while the GPU holds actor and engine "
        "at their peaks with a 10% margin).")
    overlap_state_onload: bool = _f(
        True, "--overlap-state-onload",
        "When offload_train brings the actor back, copy the optimizer state on a side stream "
        "while the first update's forwards and backwards run (its first step waits for it); "
        "off: everything is copied back before training starts.")
    sequence_parallel: int = _f(
        1, "--fsdp-sequence-parallel",
        "Ranks that split one transformer forward's sequence between them (diffusers' context "
        "parallelism: Ulysses where it divides the transformer's attention heads, ring "
        "attention otherwise; FSDP2 then shards over data x sequence). Each rank rolls out its "
        "own groups; the ranks of a group then train on all their slices. 1 = off. Wan and "
        "Qwen-Image only; must divide the world size. See docs/fsdp2.md.")
    debug_fingerprint: bool = _f(False, "--fsdp-debug-fingerprint",
                                 "Log weight fingerprints around each optimizer step.")


@dataclass
class LoRAConfig:
    rank: int = _f(0, "--lora-rank", "LoRA rank; 0 = full training.")
    alpha: float = _f(0.0, "--lora-alpha", "LoRA alpha (not recoverable from weights).")
    dropout: float = _f(0.0, "--lora-dropout", "Must be 0 (replay must equal sampling).")
    adapter_mode: bool = _f(False, "--lora-adapter-mode",
                            "Sync adapter tensors only (base synced once) instead of merging.")
    target_modules: list | None = _f(None, "--lora-target-modules",
                                     "Override the adapter's default target modules.")
    engine_merge: bool = _f(True, "--lora-engine-merge",
                            "Adapter mode: the engine folds each synced adapter into its base "
                            "weights (keeping an exact copy of the targeted base weights), so a "
                            "LoRA rollout costs what a full-model rollout costs.")
    init_a: str = _f("kaiming", "--lora-init-a",
                     "LoRA A initialisation: 'kaiming' (peft's default) or 'gaussian' (peft's "
                     "init_lora_weights='gaussian', the Flow-GRPO reference); B is 0 in both.")
    init_path: str | None = _f(None, "--lora-init-path",
                               "Start from this LoRA (PEFT directory or diffusers "
                               "safetensors; trainer/lora_init.py) instead of zeros.")


@dataclass
class WeightSyncConfig:
    mode: str | None = _f(None, "--weight-sync-mode",
                          "Derived: full (full training), merge (LoRA), adapter (adapter mode).")
    wire_dtype: str = _f("bf16", "--weight-sync-wire-dtype", "On-the-wire dtype.")
    bucket_size_mb: int = _f(512, "--weight-sync-bucket-size-mb", "Bucket size.")
    backend: str = _f("auto", "--weight-sync-backend", "auto | cuda | shm.")
    timeout_s: float = _f(120.0, "--weight-sync-timeout", "Bound on every wait of a sync.")
    max_retries: int = _f(1, "--weight-sync-max-retries", "Retries of a failed sync.")
    verify_engine_checksum: bool = _f(True, "--weight-sync-verify-checksum",
                                      "Cross-check the engine's weights checksum after commit.")


@dataclass
class DataConfig:
    prompt_data: str = _f("toy:train", "--prompt-data",
                          "Training prompts: a JSONL, parquet or .txt file, a dataset folder "
                          "(train + test files), or toy:train (formats: end of --help).")
    eval_prompt_data: str | None = _f("toy:eval", "--eval-prompt-data",
                                      "Held-out prompts, in the same formats (a dataset "
                                      "folder's test file); None disables eval.")
    eval_interval: int = _f(5, "--eval-interval", "Eval every N rollouts (and at start/end).")
    n_samples_per_eval_prompt: int = _f(2, "--n-samples-per-eval-prompt", "Eval candidates.")
    eval_max_prompts: int | None = _f(None, "--eval-max-prompts", "Cap on eval prompts.")
    eval_sde_indices: list | None = _f(None, "--eval-sde-indices",
                                       "eval_mode sde: fixed SDE steps of the eval; None = the "
                                       "training sampling's deterministic steps.")
    eval_mode: str = _f("sde", "--eval-mode",
                        "sde (the training's stochastic steps at fixed indices) | ode "
                        "(deterministic, as the Flow-GRPO reference evaluates).")
    eval_num_inference_steps: int | None = _f(None, "--eval-num-inference-steps",
                                              "Steps of an eval rollout; None = the training's "
                                              "(reference: 40).")
    eval_guidance_scale: float | None = _f(None, "--eval-guidance-scale",
                                           "CFG scale of the eval; None = the training's.")
    eval_use_ema: bool = _f(True, "--eval-use-ema",
                            "Evaluate with the EMA weights when ema.enabled (the reference).")


@dataclass
class EMAConfig:
    enabled: bool = _f(False, "--ema", "EMA of the trainable parameters (trainer.ema).")
    decay: float = _f(0.9, "--ema-decay", "EMA decay (the reference's train_sd3.py: 0.9).")
    update_interval: int = _f(8, "--ema-update-interval",
                              "Optimizer steps between EMA updates (reference: 8).")
    per_micro_batch: bool = _f(False, "--ema-per-micro-batch",
                               "Step the EMA after every micro-batch's backward, counting "
                               "optimizer steps (the reference's train_sd3.py), instead of "
                               "after the optimizer step.")


@dataclass
class CheckpointConfig:
    save: str | None = _f(None, "--save", "Checkpoint root; default <run_dir>/checkpoints.")
    save_interval: int = _f(0, "--save-interval",
                            "Save every N rollouts and at the end; 0 = only at the end; "
                            "-1 = never.")
    load: str | None = _f(None, "--load", "Resume from this checkpoint root.")
    max_actor_ckpt_to_keep: int = _f(2, "--max-actor-ckpt-to-keep", "Rotation; <= 0 keeps all.")
    resume: bool = _f(False, "--resume",
                      "Continue the run in --run-dir from its newest verified checkpoint.")
    overwrite: bool = _f(False, "--overwrite",
                         "Start over in a --run-dir that holds a run: its metrics are cleared "
                         "and its checkpoints may be replaced.")
    base_hash: str = _f("sampled", "--base-hash",
                        "How a LoRA checkpoint identifies its base model: sampled (16 x 64 KiB "
                        "per weight file) | full (every byte, read at every save and resume).")


@dataclass
class LoggingConfig:
    run_dir: str = _f("runs/latest", "--run-dir", "Run directory (config, metrics, images).")
    tensorboard: bool = _f(True, "--tensorboard", "Write TensorBoard events.")
    wandb: bool = _f(False, "--use-wandb", "Also log to Weights & Biases.")
    wandb_project: str = _f("flowgrpo", "--wandb-project", "W&B project.")
    wandb_name: str | None = _f(None, "--wandb-name",
                                "W&B run name; default <run_dir name>-<family>-<mode>-<rewards>.")
    train_samples: int = _f(8, "--log-train-samples",
                            "Training samples (captioned grid) logged per logged step; 0: none.")
    log_interval: int = _f(1, "--log-interval", "Console/metrics line every N rollouts.")
    progress: bool = _f(True, "--progress", "tqdm bars on rollout, train and eval.")
    profile_steps: str | None = _f(None, "--profile-steps",
                                   "A:B wraps rollouts A..B-1 in cudaProfilerStart/Stop.")
    peak_tflops: float | None = _f(None, "--peak-tflops",
                                   "Peak dense bf16 TFLOP/s of one device for perf/mfu/*; None: "
                                   "from the device name (trainer.compute.mfu), no MFU if unknown.")


@dataclass
class LaunchConfig:
    device: str = _f("auto", "--device", "auto | cuda | cpu.")
    nproc: int | None = _f(None, "--nproc", "Ranks on this node; default: GPUs, or 1 on CPU.")
    nnodes: str = _f("1", "--nnodes", "torchrun --nnodes.")
    node_rank: int = _f(0, "--node-rank", "torchrun --node-rank.")
    rdzv_endpoint: str = _f("127.0.0.1:29511", "--rdzv-endpoint", "torchrun rendezvous.")
    colocate: bool = _f(True, "--colocate", "Actor and engine time-share each GPU (required).")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    data: DataConfig = field(default_factory=DataConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def to_dict(self, unset: Any = None) -> dict[str, Any]:
        """Plain JSON types, every section a dict (what config.json and config.toml hold).

        ``unset``: how an unset key of a typed table is written (TOML has no null; the table
        reads "none" as unset, so its TOML stays an inline table)."""
        out = dataclasses.asdict(self)
        out["rollout"]["sampling"] = {k: unset if v is None else v
                                      for k, v in self.rollout.sampling.to_dict().items()}
        return out

    @property
    def sync_mode(self) -> str:
        """The weight-sync payload, derived from the LoRA flags (derived, never set against them: docs/design.md#weight-sync)."""
        return lora_sync_mode(self.lora)


def lora_sync_mode(lora: LoRAConfig) -> str:
    """The weight-sync payload of a run with this ``[lora]`` section: full, adapter or merge."""
    if lora.rank <= 0:
        return "full"
    return "adapter" if lora.adapter_mode else "merge"


class ConfigError(ValueError):
    """A bad config: the message lists every problem at once."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))

@functools.lru_cache(maxsize=None)
def _sections() -> dict[str, type]:
    # Cached: get_type_hints re-evaluates every annotation string on each call.
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def cli_flag(section: str, name: str) -> str:
    """A key's own flag: the dotted key with hyphens, the section dropped when the key starts
    with it (``train.num_rollouts`` -> ``--train-num-rollouts``, ``rollout.rollout_batch_size``
    -> ``--rollout-batch-size``)."""
    key = name if name.startswith(section + "_") else f"{section}_{name}"
    return "--" + key.replace("_", "-")


def flag_table() -> dict[str, tuple[str, str]]:
    """Flag -> (section, field): each key's own flag and its short alias."""
    table = {}
    for sec, cls in _sections().items():
        for f in dataclasses.fields(cls):
            table[f.metadata["flag"]] = (sec, f.name)
            table[cli_flag(sec, f.name)] = (sec, f.name)
    return table


def _type_name(typ: Any) -> str:
    """'int', 'float | None', 'dict', 'SamplingConfig'... from a resolved annotation."""
    text = str(typ)
    text = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", text)
    return text.replace("typing.", "").replace("NoneType", "None")


def is_table(typ: Any) -> bool:
    """A key that takes a table: a dict, or a typed table (``merged``, ``to_dict``)."""
    return _type_name(typ).startswith("dict") or hasattr(typ, "merged")


def plain(value: Any) -> Any:
    """A typed table as its dict (JSON types); any other value as it is."""
    return value.to_dict() if hasattr(value, "merged") else value


def store(cfg: Any, section: str, key: str, value: Any, where: str, problems: list[str]) -> None:
    """Set one key; a typed table takes a (partial) table's keys over its own values."""
    current = getattr(getattr(cfg, section), key)
    if hasattr(current, "merged"):
        value, table_problems = current.merged(value)
        problems += [f"{where}: {p}" for p in table_problems]
    setattr(getattr(cfg, section), key, value)
