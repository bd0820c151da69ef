"""Preflight: one test per rule (each violation named), all violations in one error, warnings
returned and logged, shipped recipes pass, and preflight imports no torch."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import ConfigError, RECIPES_DIR, load_config
from trainer.config.sampling import fraction_window
from trainer.preflight import (local_sample_count, preflight, static_sde_indices,
                               trainable_indices_upper_bound)

REPO = Path(__file__).resolve().parents[1]


def tiny(*overrides: str):
    """The tiny recipe (valid at 1 or 2 ranks) with --set overrides."""
    return load_config("tiny", list(overrides))


def sampling(**keys) -> str:
    return "rollout.sampling=" + json.dumps(keys)


def problems_of(cfg, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        preflight(cfg, **kw)
    return info.value.problems


def test_tiny_recipe_is_the_valid_baseline():
    for world in (1, 2):
        assert preflight(tiny(), world_size=world) == []
    assert preflight(tiny()) == []  # world unknown (launch.nproc unset): global checks only


# (id, --set overrides, preflight kwargs, substrings that ONE problem must all contain)
ERROR_RULES = [
    ("task", ["model.task=t2a"], {}, ["model.task (--generation-task)", "GENERATION_TASKS"]),
    ("adapter_path_missing", ["model.adapter_path="], {},
     ["model.adapter_path (--model-adapter-path)", "required"]),
    ("adapter_path_not_dotpath", ["model.adapter_path=ToyAdapter"], {},
     ["model.adapter_path", "dotpath"]),
    ("model_path_missing", ["model.model_path="], {},
     ["model.model_path (--model-path)", "required"]),
    ("model_path_not_found", ["model.model_path=/nonexistent/qwen"], {},
     ["model.model_path", "/nonexistent/qwen", "not a directory"]),
    ("trainable_mode_unknown", ["fsdp.trainable_mode=partial"], {},
     ["fsdp.trainable_mode (--fsdp-trainable-mode)", "'partial'", "full, lora"]),
    ("lora_mode_without_rank", ["fsdp.trainable_mode=lora"], {},
     ["fsdp.trainable_mode", "'lora' needs lora.rank (--lora-rank) > 0"]),
    ("rank_without_lora_mode", ["lora.rank=8"], {}, ["lora.rank (--lora-rank)=8", "must agree"]),
    ("lora_dropout", ["fsdp.trainable_mode=lora", "lora.rank=8", "lora.dropout=0.05"], {},
     ["lora.dropout (--lora-dropout)=0.05", "must be 0"]),
    ("lora_cpu_offload", ["fsdp.trainable_mode=lora", "lora.rank=8", "fsdp.cpu_offload=true"], {},
     ["fsdp.cpu_offload (--fsdp-cpu-offload)", "not allowed with LoRA"]),
    ("full_needs_full_sync", ["weight_sync.mode=merge"], {},
     ["weight_sync.mode (--weight-sync-mode)='merge'", "contradicts", "'full'"]),
    ("merge_lora_vs_explicit_adapter",
     ["fsdp.trainable_mode=lora", "lora.rank=8", "weight_sync.mode=adapter"], {},
     ["weight_sync.mode", "'adapter' contradicts", "'merge'"]),
    ("adapter_mode_vs_explicit_merge",
     ["fsdp.trainable_mode=lora", "lora.rank=8", "lora.adapter_mode=true",
      "weight_sync.mode=merge"], {}, ["weight_sync.mode", "'merge' contradicts", "'adapter'"]),
    ("sync_mode_unknown", ["weight_sync.mode=delta"], {},
     ["weight_sync.mode", "'delta'", "not one of"]),
    ("adapter_mode_without_lora", ["lora.adapter_mode=true"], {},
     ["lora.adapter_mode (--lora-adapter-mode)", "needs LoRA"]),
    ("step0_explicit", [sampling(sde_indices=[0, 2])], {}, ["step 0", "sde_indices contains 0"]),
    ("step0_pool", [sampling(sde_pool=[0, 1, 2])], {}, ["step 0", "sde_pool contains 0"]),
    ("step0_fraction_window",  # the stride example of docs/design.md: [0.0, 0.5] over 12 steps -> [0, 2, 4]
     [sampling(num_inference_steps=12, sde_indices=None, sde_resample_per_rollout=False,
               num_sde_steps=3, sde_timestep_fraction=[0.0, 0.5])], {},
     ["step 0", "resolves to [0, 2, 4]"]),
    ("step0_window_as_pool", [sampling(sde_pool=None)], {}, ["step 0", "resampling pool"]),
    ("no_sde_step", [sampling(sde_indices=None, sde_resample_per_rollout=False, num_sde_steps=0)],
     {}, ["rollout.sampling", "no SDE step"]),
    ("sde_index_out_of_range", [sampling(sde_indices=[3, 8, 9])], {},
     ["rollout.sampling.sde_indices", "[8, 9] outside", "0..7"]),
    ("sde_indices_type", [sampling(sde_indices="3,4")], {}, ["sde_indices", "list of integers"]),
    ("init_same_noise_type", [sampling(init_same_noise="yes")], {},
     ["init_same_noise", "must be true or false"]),
    ("init_same_noise_without_driver_xt", [sampling(init_same_noise=True, driver_xt=False)], {},
     ["init_same_noise", "needs driver_xt"]),
    ("resample_without_steps", [sampling(num_sde_steps=0)], {},
     ["sde_resample_per_rollout", "num_sde_steps is 0"]),
    ("resample_more_than_pool", [sampling(num_sde_steps=4, sde_pool=[1, 2, 3])], {},
     ["num_sde_steps", "exceeds the 3 distinct steps"]),
    ("fraction_bad", [sampling(sde_timestep_fraction=[0.6, 0.2])], {},
     ["sde_timestep_fraction", "0 <= lo < hi <= 1"]),
    ("wire_dtype_fp32_off_cpu", ["launch.device=auto", "rollout.engine_dtype=bf16"], {},
     ["weight_sync.wire_dtype (--weight-sync-wire-dtype)='fp32'", "must be 'bf16'"]),
    ("wire_dtype_fp16", ["weight_sync.wire_dtype=fp16"], {}, ["weight_sync.wire_dtype", "'fp16'"]),
    ("colocate_off", ["launch.colocate=false"], {}, ["launch.colocate (--colocate)", "colocate"]),
    ("kl_without_lora", ["train.kl_coef=0.01"], {},
     ["train.kl_coef (--kl-coef)=0.01", "needs LoRA"]),
    ("kl_negative", ["train.kl_coef=-1"], {}, ["train.kl_coef", ">= 0"]),
    ("world_vs_gpus_per_engine", ["rollout.num_gpus_per_engine=4"], {"world_size": 2},
     ["world size 2", "rollout.num_gpus_per_engine (--rollout-num-gpus-per-engine)=4"]),
    ("engine_spans_nodes", ["rollout.num_gpus_per_engine=2"], {"world_size": 2, "gpus_per_node": 1},
     ["1 GPUs per node", "cannot span nodes"]),
    ("required_component_without_weight", ['reward.component_weights={"color": 1.0}'], {},
     ["reward.required_components (--reward-required-components)", "['count', 'position']",
      "no weight"]),
    ("weight_not_finite", ['reward.component_weights={"color": 1, "count": 1, "position": "x"}'],
     {}, ["reward.component_weights", "finite numbers"]),
    ("guidance_scale", [sampling(guidance_scale=0.5)], {},
     ["rollout.sampling.guidance_scale", ">= 1.0", "got 0.5", "(--sampling-config)"]),
    ("lora_init_without_lora", ["lora.init_path=/tmp"], {},
     ["lora.init_path (--lora-init-path)", "needs LoRA"]),
    ("lora_init_missing", ["fsdp.trainable_mode=lora", "lora.rank=4",
                           "lora.init_path=/nonexistent/lora"], {},
     ["lora.init_path", "does not exist"]),
    ("kl_form_unknown", ["train.kl_form=k3"], {}, ["train.kl_form (--kl-form)", "'k3'"]),
    ("adv_clip_not_positive", ["reward.adv_clip_max=0"], {},
     ["reward.adv_clip_max (--advantage-clip-max)", "> 0"]),
    ("adv_eps_not_positive", ["reward.adv_eps=-1"], {}, ["reward.adv_eps", "> 0"]),
    ("eval_mode_unknown", ["data.eval_mode=sample"], {}, ["data.eval_mode (--eval-mode)", "'sample'"]),
    ("eval_ode_guidance", ["data.eval_mode=ode", "data.eval_guidance_scale=0.5"], {},
     ["eval sampling", "guidance_scale must be a number >= 1.0"]),
    ("ema_decay", ["ema.enabled=true", "ema.decay=1.0"], {}, ["ema.decay (--ema-decay)", "[0, 1)"]),
    ("ema_interval", ["ema.enabled=true", "ema.update_interval=0"], {},
     ["ema.update_interval (--ema-update-interval)", ">= 1"]),
    ("sglang_clamp_to_next", ["rollout.engine=sglang", 'rollout.sglang_urls=["http://a:1"]',
                              sampling(sigma_one="clamp_to_next")], {"world_size": 1},
     ["rollout.sampling.sigma_one", "embedded engine only"]),
    ("every_step_refuses_step0", [sampling(sde_step_mode="every_step", timestep_fraction=0.9)], {},
     ["rollout.sampling", "step 0", "every_step", "clamp_to_next"]),
    ("cps_gaussian_last_step", [sampling(sde_type="cps", sde_indices=[6, 7], sde_pool=[6, 7],
                                         num_sde_steps=2)], {},
     ["rollout.sampling.sde_type", "last step 7", "cps_log_prob='reference'"]),
    ("cps_gaussian_every_step", [sampling(sde_type="cps", sde_step_mode="every_step",
                                          timestep_fraction=0.5)], {},
     ["rollout.sampling.sde_type", "noise on the last step 7"]),
    ("timestep_fraction_trains_nothing",
     [sampling(sde_step_mode="every_step", sigma_one="clamp_to_next", timestep_fraction=0.1)], {},
     ["rollout.sampling.timestep_fraction", "trains no step"]),
    ("updates_not_dividing_rank_slice", ["train.num_updates_per_batch=3"], {"world_size": 2},
     ["train.num_updates_per_batch (--num-updates-per-batch)=3", "the 4 samples per rank"]),
    ("updates_not_dividing_global", ["train.num_updates_per_batch=3"], {},
     ["train.num_updates_per_batch", "the 8 samples"]),
    ("micro_batch_not_dividing_update", ["train.micro_batch_size=3"], {"world_size": 1},
     ["train.micro_batch_size (--micro-batch-size)=3", "the 4 samples of one update"]),
    ("rollout_batch_vs_world", [], {"world_size": 3},
     ["rollout.rollout_batch_size (--rollout-batch-size)=2", "world size 3"]),
    ("world_from_launch_nproc", ["launch.nproc=3"], {}, ["world size 3"]),
    ("group_of_one", ["rollout.n_samples_per_prompt=1"], {},
     ["rollout.n_samples_per_prompt (--n-samples-per-prompt)=1", ">= 2 for grpo"]),
    ("advantage_estimator", ["train.advantage_estimator=ppo"], {},
     ["train.advantage_estimator", "grpo"]),
    ("global_batch_size", ["rollout.global_batch_size=16"], {},
     ["rollout.global_batch_size (--global-batch-size)=16", "= 8"]),
    ("eta_zero", [sampling(eta=0.0)], {}, ["rollout.sampling.eta", "must be > 0"]),
    ("eta_negative", [sampling(eta=-0.5, sde_type="dance")], {},
     ["rollout.sampling.eta", "'dance'"]),
    ("sde_type_unknown", [sampling(sde_type="ode")], {}, ["rollout.sampling.sde_type", "'ode'"]),
    ("std_mode_unknown", ["reward.std_mode=global"], {},
     ["reward.std_mode (--generative-advantage-std-mode)", "'global'"]),
    ("runtime_unknown", ["reward.runtime=dedicated"], {}, ["reward.runtime", "'dedicated'"]),
    ("scheduler_unknown", ["train.lr_scheduler=step"], {}, ["train.lr_scheduler", "'step'"]),
    ("scheduler_without_decay", ["train.lr_scheduler=cosine"], {},
     ["train.lr_scheduler", "'cosine' needs train.lr_decay_iters"]),
    ("param_dtype_unknown", ["fsdp.param_dtype=fp16"], {}, ["fsdp.param_dtype", "'fp16'"]),
    ("reduce_dtype_unknown", ["fsdp.reduce_dtype=float64"], {}, ["fsdp.reduce_dtype", "'float64'"]),
    ("master_dtype_unknown", ["fsdp.master_dtype=fp8"], {}, ["fsdp.master_dtype", "'fp8'"]),
    ("engine_dtype_unknown", ["rollout.engine_dtype=int8"], {}, ["rollout.engine_dtype", "'int8'"]),
    ("remote_without_endpoint", ["reward.runtime=remote"], {},
     ["reward.endpoint (--reward-endpoint)", "required"]),
    ("endpoint_not_url", ["reward.runtime=remote", "reward.endpoint=localhost:9000"], {},
     ["reward.endpoint", "not an http(s) URL"]),
    ("scorer_missing", ["reward.scorer_path=none"], {},
     ["reward.scorer_path (--reward-scorer-path)", "required"]),
    ("reward_model_path_not_found", ["reward.model_path=/nonexistent/pickscore"], {},
     ["reward.model_path", "does not exist"]),
    ("engine_unknown", ["rollout.engine=vllm"], {}, ["rollout.engine", "'vllm'"]),
    ("sglang_url_per_rank", ['rollout.sglang_urls=["http://a:1"]', "rollout.engine=sglang"],
     {"world_size": 2}, ["rollout.sglang_urls", "one URL per rank (2), got 1"]),
    ("sglang_no_urls", ["rollout.engine=sglang"], {}, ["rollout.sglang_urls", "one URL per rank"]),
    ("eps_clip_zero", ["train.eps_clip=0"], {}, ["train.eps_clip (--eps-clip)=0.0", "(0, 1)"]),
    ("eps_clip_one", ["train.eps_clip=1.5"], {}, ["train.eps_clip", "(0, 1)"]),
    ("eps_clip_high", ["train.eps_clip_high=-0.1"], {}, ["train.eps_clip_high", "> 0"]),
    ("adam_eps", ["train.adam_eps=0"], {}, ["train.adam_eps", "> 0"]),
    ("lr_not_positive", ["train.lr=0"], {}, ["train.lr (--lr)=0.0", "> 0"]),
    ("min_lr_above_lr", ["train.min_lr=1"], {}, ["train.min_lr", "[0, lr="]),
    ("eval_samples", ["data.n_samples_per_eval_prompt=0"], {},
     ["data.n_samples_per_eval_prompt (--n-samples-per-eval-prompt)=0", ">= 1"]),
    ("eval_sde_step0", ["data.eval_sde_indices=[0, 2]"], {}, ["data.eval_sde_indices", "step 0"]),
    ("prompt_data_not_found", ["data.prompt_data=/nonexistent/train.jsonl"], {},
     ["data.prompt_data", "not a file"]),
    ("resume_not_found", ["checkpoint.load=/nonexistent/ckpt"], {},
     ["checkpoint.load", "not a directory"]),
    ("profile_steps", ["logging.profile_steps=5:2"], {}, ["logging.profile_steps", "'A:B'"]),
    ("backend_cuda_on_cpu", ["weight_sync.backend=cuda"], {}, ["weight_sync.backend", "'cuda'"]),
    ("device_unknown", ["launch.device=tpu"], {}, ["launch.device", "'tpu'"]),
]


@pytest.mark.parametrize("overrides,kwargs,expected", [r[1:] for r in ERROR_RULES],
                         ids=[r[0] for r in ERROR_RULES])
def test_each_rule_names_its_violation(overrides, kwargs, expected):
    problems = problems_of(tiny(*overrides), **kwargs)
    assert any(all(s in p for s in expected) for p in problems), (expected, problems)


# Configs close to a rule's boundary that must pass.
ALLOWED = [
    ("dance_trains_step0",
     [sampling(sde_type="dance", sde_indices=[0, 2], sde_pool=[0, 1, 2])], {}),
    ("cps_trains_step0", [sampling(sde_type="cps", sde_pool=[0, 1, 2])], {}),
    ("fraction_starting_at_1_over_T",  # lo = 1/8 must not floor to step 0
     [sampling(sde_indices=None, sde_pool=None, sde_timestep_fraction=[1 / 8, 1.0])], {}),
    ("kl_with_lora", ["fsdp.trainable_mode=lora", "lora.rank=4", "train.kl_coef=0.04"], {}),
    ("explicit_sync_mode_agreeing", ["fsdp.trainable_mode=lora", "lora.rank=4",
                                     "lora.adapter_mode=true", "weight_sync.mode=adapter"], {}),
    ("custom_reward_without_scorer", ["reward.scorer_path=none",
                                      "reward.custom_reward_path=mypkg.rewards.score"], {}),
    ("remote_without_scorer", ["reward.scorer_path=none", "reward.runtime=remote",
                               "reward.endpoint=http://127.0.0.1:9000/score"], {}),
    ("sglang_one_url_per_rank", ["rollout.engine=sglang",
                                 'rollout.sglang_urls=["http://a:1", "http://b:1"]',
                                 # a family SGLang serves (trainer/engine/README.md)
                                 "model.adapter_path=trainer.models.qwen_image.QwenImageAdapter",
                                 # stock SGLang: its own sigmas and noise (see test_sglang_client)
                                 'rollout.sampling={"driver_sigmas": false, "driver_xt": false}'],
     {"world_size": 2}),
    ("eval_disabled_ignores_eval_keys", ["data.eval_prompt_data=none",
                                         "data.n_samples_per_eval_prompt=0"], {}),
    ("missing_paths_unchecked", ["model.model_path=/nonexistent/qwen",
                                 "data.prompt_data=/nonexistent/train.jsonl"],
     {"check_paths": False}),
    ("existing_paths", [], {"world_size": 2}),  # model 'toy', data 'toy:*' need no file
    ("linear_with_decay", ["train.lr_scheduler=linear", "train.lr_decay_iters=100"], {}),
]


@pytest.mark.parametrize("overrides,kwargs", [r[1:] for r in ALLOWED], ids=[r[0] for r in ALLOWED])
def test_boundary_configs_pass(overrides, kwargs):
    preflight(tiny(*overrides), **kwargs)


def test_existing_local_paths_pass(tmp_path):
    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    model.mkdir()
    data.write_text('{"prompt": "a red circle"}\n')
    preflight(tiny(f"model.model_path={model}", f"data.prompt_data={data}",
                   f"reward.model_path={model}", f"checkpoint.load={model}"))


def test_all_violations_reported_together():
    cfg = tiny("model.task=v2v", "lora.dropout=0.1", "lora.rank=4", "train.kl_coef=-1",
               sampling(guidance_scale=0.9, sde_indices=[0, 1]), "weight_sync.wire_dtype=fp16",
               "launch.colocate=false", "rollout.n_samples_per_prompt=1",
               'reward.component_weights={}', "reward.runtime=remote")
    with pytest.raises(ConfigError) as info:
        preflight(cfg, world_size=3)
    expected = ["model.task", "lora.dropout", "must agree", "train.kl_coef", "guidance_scale",
                "step 0", "wire_dtype", "launch.colocate", "n_samples_per_prompt",
                "no weight", "reward.endpoint", "world size 3"]
    text = str(info.value)
    missing = [e for e in expected if e not in text]
    assert not missing, (missing, text)
    assert len(info.value.problems) >= len(expected)
    assert text.count("\n  - ") == len(info.value.problems)  # one error, one line per problem


WARNING_RULES = [
    ("lora_master_not_fp32", ["fsdp.trainable_mode=lora", "lora.rank=4", "fsdp.master_dtype=bf16"],
     ["fsdp.master_dtype (--fsdp-master-dtype)='fp32'", "policy stops moving"]),
    ("lora_bf16_params_no_master", ["fsdp.trainable_mode=lora", "lora.rank=4",
                                    "fsdp.param_dtype=bf16", "fsdp.master_dtype=none"],
     ["fsdp.master_dtype (--fsdp-master-dtype)='fp32'", "policy stops moving"]),
    ("decay_iters_with_constant", ["train.lr_decay_iters=100"],
     ["train.lr_decay_iters (--lr-decay-iters)=100", "ignored", "'constant'"]),
    ("one_update_per_batch", ["train.num_updates_per_batch=1"],
     ["train.num_updates_per_batch (--num-updates-per-batch)=1", "clipped loss is 0"]),
    ("cpu_offload_full", ["fsdp.cpu_offload=true"], ["fsdp.cpu_offload", "No backend type"]),
    ("retention_unbounded", ["rollout.artifact_retention_rollouts=0"],
     ["rollout.artifact_retention_rollouts", "without bound"]),
    ("sglang_urls_ignored", ['rollout.sglang_urls=["http://a:1"]'], ["sglang_urls", "ignored"]),
]


@pytest.mark.parametrize("overrides,expected", [r[1:] for r in WARNING_RULES],
                         ids=[r[0] for r in WARNING_RULES])
def test_each_warning_is_returned_and_logged(overrides, expected, caplog):
    with caplog.at_level(logging.WARNING, logger="trainer.preflight"):
        warnings = preflight(tiny(*overrides), world_size=1)
    assert len(warnings) == 1 and all(s in warnings[0] for s in expected), warnings
    assert [r.getMessage() for r in caplog.records if r.name == "trainer.preflight"] == warnings


def test_lora_with_fp32_params_and_no_master_is_not_warned():
    """Without a master dtype the LoRA tensors stay in the param dtype: fp32 needs no master."""
    assert preflight(tiny("fsdp.trainable_mode=lora", "lora.rank=4", "fsdp.param_dtype=fp32",
                          "fsdp.master_dtype=none"), world_size=1) == []


def test_warnings_are_logged_even_when_errors_raise(caplog):
    with caplog.at_level(logging.WARNING, logger="trainer.preflight"):
        with pytest.raises(ConfigError):
            preflight(tiny("train.num_updates_per_batch=1", "model.task=x"))
    assert any("clipped loss is 0" in r.getMessage() for r in caplog.records)


SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_load_and_pass(name):
    cfg = load_config(name)
    local = name in ("tiny", "toy")  # run on one machine: 1 or 2 ranks, shipped weights
    worlds = (1, 2) if local else (8,)
    for world in worlds:
        # Real-model recipes carry placeholder paths that the user overrides.
        assert preflight(cfg, world_size=world, gpus_per_node=min(world, 8),
                         check_paths=local) == []
    if not local:
        one_gpu = name.endswith("-1gpu")  # a reference recipe's one-GPU variant
        assert cfg.launch.nproc == (1 if one_gpu else 8)
        assert preflight(cfg, check_paths=False) == []


def test_shipped_recipe_set_and_sync_modes():
    assert {"tiny", "qwen-image-t2i-lora", "qwen-image-t2i-full", "sd3-t2i-lora",
            "flux-t2i-lora"} <= set(SHIPPED)
    assert load_config("qwen-image-t2i-lora").sync_mode == "adapter"
    assert load_config("qwen-image-t2i-full").sync_mode == "full"
    assert load_config("tiny").model.model_path == "toy"


def test_sde_resolution_arithmetic():
    assert fraction_window([0.0, 0.5], 12) == [0, 1, 2, 3, 4, 5]
    assert fraction_window([1 / 12, 1.0], 12)[0] == 1
    spec_table = {"num_inference_steps": 12, "num_sde_steps": 3,
                  "sde_timestep_fraction": [0.0, 0.5]}
    assert static_sde_indices(spec_table) == [0, 2, 4]
    assert static_sde_indices({**spec_table, "sde_indices": [5, 3, 3]}) == [3, 5]
    reference = load_config("qwen-image-t2i-lora").rollout.sampling
    assert static_sde_indices(reference) == [3, 4, 5]
    assert trainable_indices_upper_bound(reference) == [1, 2, 3, 4, 5]
    no_pool = {**spec_table, "sde_resample_per_rollout": True, "sde_indices": [3]}
    assert trainable_indices_upper_bound(no_pool) == [0, 1, 2, 3, 4, 5]  # pool = the window
    assert trainable_indices_upper_bound({"num_inference_steps": 12}) == []


def test_local_sample_count_follows_the_loop_split():
    cfg = load_config("qwen-image-t2i-lora")
    assert local_sample_count(cfg, 8) == 32  # 32 groups / 8 ranks * 8 candidates
    assert local_sample_count(load_config("qwen-image-t2i-full"), 8) == 8


def _rollout_resolver():
    try:
        from trainer.rollout import resolve_sde_indices
    except ImportError:
        try:
            from trainer.rollout.sde_indices import resolve_sde_indices
        except ImportError:
            pytest.skip("trainer.rollout.resolve_sde_indices has not landed")
    return resolve_sde_indices


AGREEMENT_TABLE = [
    {"num_inference_steps": 12, "num_sde_steps": 3, "sde_timestep_fraction": [0.0, 0.5]},
    {"num_inference_steps": 12, "num_sde_steps": 3, "sde_timestep_fraction": [0.25, 0.75]},
    {"num_inference_steps": 10, "num_sde_steps": 4},
    {"num_inference_steps": 12, "sde_indices": [5, 3, 4, 3]},
    {"num_inference_steps": 12, "sde_indices": [3, 4, 5], "sde_resample_per_rollout": True,
     "num_sde_steps": 3, "sde_pool": [1, 2, 3, 4, 5]},
    {"num_inference_steps": 8, "sde_resample_per_rollout": True, "num_sde_steps": 2,
     "sde_timestep_fraction": [0.125, 0.75]},
    {"num_inference_steps": 12},
]


@pytest.mark.parametrize("sde_type", ["sde", "dance"])
@pytest.mark.parametrize("table", AGREEMENT_TABLE)
def test_agrees_with_the_rollout_resolver(table, sde_type):
    """Our torch-free twin and trainer.rollout's resolver: same static path, same reachable
    set over many rollout ids, and the same step-0 verdict under 'sde'."""
    resolve = _rollout_resolver()
    s = {**table, "sde_type": sde_type}
    upper = trainable_indices_upper_bound(s)
    if sde_type == "sde" and 0 in upper:
        with pytest.raises(ValueError, match="step 0"):
            resolve(s, rollout_id=None)
        return
    assert resolve(s, rollout_id=None) == static_sde_indices(s)
    reached = set(static_sde_indices(s))
    for rollout_id in range(64):
        reached |= set(resolve(s, rollout_id=rollout_id))
    assert sorted(reached) == upper


def test_rollout_resolver_rejects_step0_in_window_pool():
    resolve = _rollout_resolver()
    s = {"num_inference_steps": 12, "sde_type": "sde", "sde_indices": [3],
         "sde_resample_per_rollout": True, "num_sde_steps": 2}
    assert 0 in trainable_indices_upper_bound(s)
    with pytest.raises(ValueError, match="step 0"):
        resolve(s, rollout_id=0)


def test_preflight_imports_no_torch():
    code = (
        "import sys\n"
        "from trainer.config import load_config, ConfigError\n"
        "from trainer.preflight import preflight\n"
        "preflight(load_config('tiny'), world_size=2)\n"
        "try:\n"
        "    preflight(load_config('tiny', ['model.task=x']))\n"
        "except ConfigError:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'diffusers', 'transformers', 'triton')\n"
        "               if m in sys.modules)\n"
        "print(heavy)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
