"""The sd3-flowgrpo recipe end to end, shrunk by --set to a tiny SD3 on the CPU: two training
steps with CFG (guidance 4.5 in rollout and replay), noise at every step with step 0 clamped and
trained, reference advantages and KL, EMA updated every optimizer step, an ODE eval on the EMA
weights, and a checkpoint whose EMA reloads exactly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _shrink(model_dir: Path, tmp: Path) -> list[str]:
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"a photo of a cat number {i}",
                                             "metadata": {"sample_id": f"p{i:03d}"}})
                                 for i in range(8)))
    held_out = tmp / "eval.jsonl"  # preflight refuses eval prompts that are also trained on
    held_out.write_text("\n".join(json.dumps({"prompt": f"a photo of a dog number {i}",
                                              "metadata": {"sample_id": f"e{i:03d}"}})
                                  for i in range(2)))
    return [f"model.model_path={model_dir}", "model.adapter_options={}",
            "reward.runtime=cpu", "reward.scorer_path=trainer.rewards.jpeg.JpegCompressibilityScorer",
            "reward.model_path=none", "reward.required_components=[]", "reward.component_weights={}",
            f"data.prompt_data={prompts}", f"data.eval_prompt_data={held_out}",
            "data.eval_max_prompts=2", "data.eval_interval=1", "data.eval_num_inference_steps=3",
            f"logging.run_dir={tmp / 'run'}", "logging.progress=false", "logging.tensorboard=false",
            "rollout.write_artifacts=false", "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=4", "rollout.global_batch_size=8",
            "rollout.engine_dtype=fp32", "rollout.offload_rollout=false",
            'rollout.sampling={"height": 32, "width": 32, "num_inference_steps": 4}',
            "train.num_rollouts=2", "train.micro_batch_size=2", "train.lr=1e-3",
            "fsdp.param_dtype=fp32", "fsdp.activation_checkpointing=false", "fsdp.load_wave_size=0",
            "fsdp.offload_train=false", "lora.rank=4", "lora.alpha=8", "weight_sync.wire_dtype=fp32",
            "ema.update_interval=1", f"checkpoint.save={tmp / 'ckpt'}", "launch.device=cpu",
            "launch.nproc=1"]


def test_sd3_flowgrpo_recipe_two_steps_with_cfg_and_ema(tiny_model_dir, tmp_path):
    from trainer.config import load_config
    from trainer.ema import ParameterEMA
    from trainer.loop import Trainer
    from trainer.models.guidance import NEGATIVE_PREFIX
    from trainer.preflight import preflight

    cfg = load_config("sd3-flowgrpo", _shrink(tiny_model_dir("sd3"), tmp_path))
    assert preflight(cfg, world_size=1) == []
    assert cfg.rollout.sampling.guidance_scale == 4.5 and cfg.ema.enabled
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        batch = trainer.rollout(0)  # what train_step(0) will also draw: the same rollout id
        assert batch.sde_indices == [0, 1, 2] and batch.sigmas[0, 0].item() == 1.0
        assert batch.guidance_scale == 4.5
        assert any(k.startswith(NEGATIVE_PREFIX) for k in batch.conditions)
        assert batch.sde_options["sigma_one"] == "clamp_to_next"
        history = trainer.train()
    finally:
        trainer.close()
    last = history["last"]
    assert last["train/policy_version"] >= 2.0
    # pi_old from the sampler: the first ratio is 1 up to the engine/replay numerics
    assert last["train/first_update_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert "train/kl" in last and last["train/kl"] >= 0.0
    assert "eval/reward_mean" in history["eval_start"] and "eval/reward_mean" in last
    # ema.per_micro_batch (the reference): 2 rollouts x 4 micro-batches of 2, interval 1
    assert trainer.actor.ema.updates == 8
    live = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(trainer.actor.ema.shadow[n], live[n].float()) for n in live)
    iters = sorted((tmp_path / "ckpt").rglob("ema"))
    assert iters, "the checkpoint has no EMA state"
    reloaded = ParameterEMA(trainer.model, decay=0.9, update_interval=1)
    reloaded.load(iters[-1])
    assert reloaded.updates == 8
    assert all(torch.equal(reloaded.shadow[n], t) for n, t in trainer.actor.ema.shadow.items())
    # export --ema: a PEFT adapter holding the EMA weights, readable by --lora-init-path
    from trainer.checkpoint.export import export_checkpoint
    from trainer.lora_init import _canonical, read_lora_file
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "export", form="adapter", ema=True)
    exported = read_lora_file(out, rank=4, alpha=8)
    want = {_canonical(n): t for n, t in trainer.actor.ema.shadow.items()}
    assert exported.keys() == want.keys()
    assert all(torch.equal(exported[k], want[k]) for k in want)
