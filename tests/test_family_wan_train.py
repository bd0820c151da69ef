"""The Wan recipes end to end on the CPU, shrunk by --set to the tiny Wan 2.1 / 2.2 models of
tests/wan_models.py: preflight accepts them, the loop trains (rollout of videos -> a dense video
reward -> replay of 3-D latents -> LoRA update -> weight sync -> eval), the first update's ratio
is exactly 1, and the reward rises beyond the eval's own noise within a few rollouts.

The reward is this test's own (``redness``): mean over every frame and pixel of R - (G + B) / 2,
dense and easy to move; it reads a video [B, F, H, W, 3] whole and a single frame alike.
The tiny models are those of weight seed 0 (tests/wan_models.py builds them deterministically,
as the toy learning test uses the toy's shipped weights): within 12 rollouts a random tiny
model's learnable share of the reward differs from seed to seed, and not every seed moves it
beyond the eval's noise that soon.
The eval's sample grid gets each video's first frame (``first_frames``): animated pictures of
video are trainer/visuals.py's work, not this family's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eval_gain import train_and_measure

from wan_models import TINY_VIDEO, build_tiny_wan_dir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]
H, W, F = TINY_VIDEO


def redness(images: torch.Tensor, prompts, metadata) -> torch.Tensor:
    """Mean over frames and pixels of R - (G + B) / 2, in [-1, 1]."""
    x = images.float() / 255.0
    red = x[..., 0] - 0.5 * (x[..., 1] + x[..., 2])
    return red.flatten(1).mean(dim=1)


redness.component = "red"


def first_frames(monkeypatch) -> None:
    """The loop's sample grids (eval and training samples), given each video's first frame
    (the grids draw images)."""
    import trainer.loop
    from trainer.visuals import log_pictures, log_samples

    def first(images):
        return images[:, 0] if images is not None and images.dim() == 5 else images

    def grid_of_first_frames(metrics, tag, step, images, *args, **kwargs):
        return log_samples(metrics, tag, step, first(images), *args, **kwargs)

    def pictures_of_first_frames(metrics, run_dir, step, samples, **kwargs):
        if samples is not None:
            samples = (first(samples[0]), *samples[1:])
        return log_pictures(metrics, run_dir, step, samples, **kwargs)

    monkeypatch.setattr(trainer.loop, "log_samples", grid_of_first_frames)
    monkeypatch.setattr(trainer.loop, "log_pictures", pictures_of_first_frames)


def _prompts(tmp: Path) -> tuple[Path, Path]:
    words = [f"{w}, take {i}" for i in range(2) for w in ["a red panda", "a bowl of fruit", "a lighthouse",
             "two dogs in the snow", "a cat on a chair", "an astronaut on a horse", "a teacup", "a boat"]]
    train, held_out = tmp / "train.jsonl", tmp / "eval.jsonl"
    train.write_text("\n".join(json.dumps({"prompt": f"{w} number {i}", "metadata": {"sample_id": f"t{i:02d}"}})
                               for i, w in enumerate(words * 2)))
    held_out.write_text("\n".join(json.dumps({"prompt": f"{w}, a video", "metadata": {"sample_id": f"e{i}"}})
                                  for i, w in enumerate(words)))
    return train, held_out


def shrink(model_dir: Path, tmp: Path, *, steps: int, pool: list[int]) -> list[str]:
    """The recipe at the tiny model's size on one CPU process (every value the CPU forces)."""
    train, held_out = _prompts(tmp)
    sampling = {"height": H, "width": W, "num_frames": F, "num_inference_steps": steps,
                "sde_indices": pool[:2], "sde_pool": pool, "num_sde_steps": 2}
    return [f"model.model_path={model_dir}", 'model.adapter_options={"max_sequence_length": 16}',
            "reward.runtime=cpu", "reward.custom_reward_path=test_family_wan_train.redness",
            "reward.scorer_path=none", "reward.required_components=[]", "reward.component_weights={}",
            f"data.prompt_data={train}", f"data.eval_prompt_data={held_out}", "data.eval_max_prompts=16", "data.n_samples_per_eval_prompt=4",
            "data.eval_interval=100", f"logging.run_dir={tmp / 'run'}", "logging.progress=false", "logging.log_interval=1",
            "logging.tensorboard=false", "rollout.write_artifacts=false", "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=4", "rollout.global_batch_size=8", "rollout.engine_dtype=fp32",
            "rollout.offload_rollout=false", f"rollout.sampling={json.dumps(sampling)}",
            "train.micro_batch_size=2", "train.lr=1e-1", "train.eps_clip=0.5", "fsdp.param_dtype=fp32",
            "fsdp.activation_checkpointing=false", "fsdp.load_wave_size=0", "fsdp.offload_train=false",
            "lora.rank=8", "lora.alpha=16", "weight_sync.wire_dtype=fp32", "weight_sync.bucket_size_mb=64",
            f"checkpoint.save={tmp / 'ckpt'}", "checkpoint.save_interval=0", "launch.device=cpu",
            "launch.nproc=1"]


# Wan 2.2's tiny model moves its expert boundary to 0.5: at the published 0.875 the trained
# high-noise expert takes only the first eighth of the trajectory, too little for a random VAE's
# colours to move in a few rollouts; steps 0-3 of 6 are then the high-noise expert's, and the
# frozen low-noise expert still takes the rest.
@pytest.mark.parametrize("variant, recipe, steps, pool", [
    ("wan2.1", "wan2.1-t2v", 6, [1, 2, 3]), ("wan2.2", "wan2.2-t2v", 6, [1, 2, 3])])
def test_a_dense_video_reward_rises_within_a_few_rollouts(tmp_path, monkeypatch, variant, recipe, steps,
                                                          pool):
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    model_dir = build_tiny_wan_dir(variant, tmp_path, boundary_ratio=0.5)
    cfg = load_config(recipe, shrink(model_dir, tmp_path, steps=steps, pool=pool) + ["train.num_rollouts=12"])
    assert preflight(cfg, world_size=1) == []
    first_frames(monkeypatch)

    def check_step(rollout_id: int, metrics: dict) -> None:
        assert metrics["train/first_update_ratio_mean"] == 1.0
        assert metrics["train/policy_version"] == rollout_id + 1

    before, after, gain, noise = train_and_measure(
        Trainer(cfg, rank=0, world=1, device="cpu"), cfg.train.num_rollouts, check_step)
    print(f"{variant} redness eval before {before} after {after}: gain {gain:.4f}, noise {noise:.4f}")
    assert gain > 2 * noise, (before, after)


@pytest.mark.parametrize("variant, recipe", [("wan2.1", "wan2.1-t2v"), ("wan2.2", "wan2.2-t2v")])
def test_the_merged_export_of_a_trained_run_is_a_pipeline_diffusers_wan_pipeline_runs(
        tmp_path, monkeypatch, variant, recipe):
    """Two rollouts, the end-of-run checkpoint, ``python -m trainer export --form merged
    --verify``: a pipeline folder with the trained (merged) transformer and, for Wan 2.2, the
    untouched low-noise expert beside it, which diffusers' WanPipeline loads and runs."""
    from diffusers import WanPipeline
    from safetensors.torch import load_file

    from trainer.cli import main as cli_main
    from trainer.config import load_config
    from trainer.loop import Trainer

    model_dir = build_tiny_wan_dir(variant, tmp_path, boundary_ratio=0.5)
    cfg = load_config(recipe, shrink(model_dir, tmp_path, steps=6, pool=[1, 2, 3]) + ["train.num_rollouts=2"])
    first_frames(monkeypatch)
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        trainer.train()
    finally:
        trainer.close()
    out = tmp_path / "merged"
    assert cli_main(["export", "--save-dir", str(tmp_path / "ckpt"), "--output-dir", str(out),
                     "--form", "merged", "--base-model-path", str(model_dir), "--task", "t2v",
                     "--verify"]) == 0
    pipe = WanPipeline.from_pretrained(out)
    assert (pipe.transformer_2 is not None) == (variant == "wan2.2")
    base, merged = (load_file(next((d / "transformer").glob("*.safetensors"))) for d in (model_dir, out))
    assert base.keys() == merged.keys()
    assert any(not torch.equal(base[k], merged[k]) for k in base)              # the LoRA was folded in
    if variant == "wan2.2":  # the frozen expert is the base's, bit for bit
        low_base, low_out = (load_file(next((d / "transformer_2").glob("*.safetensors")))
                             for d in (model_dir, out))
        assert all(torch.equal(low_base[k], low_out[k]) for k in low_base)
    video = pipe(prompt="a red panda", height=H, width=W, num_frames=F, num_inference_steps=2,
                 guidance_scale=1.0, output_type="pt", max_sequence_length=16).frames
    assert video.shape == (1, F, 3, H, W) and torch.isfinite(video).all()
