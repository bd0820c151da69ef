"""The Wan image-to-video recipes end to end on the CPU, shrunk by --set to the tiny Wan 2.1 I2V /
Wan 2.2 I2V models of tests/wan_i2v_models.py: preflight accepts them and their first-frame
data, the loop trains (rollouts of videos from each record's first frame -> a dense video reward
-> replay of 3-D latents with the recorded conditions -> LoRA update -> weight sync -> eval), the
first update's ratio is exactly 1, and the reward rises beyond the eval's own noise within a
few rollouts. The merged export of a trained run is a pipeline folder that diffusers' own
WanImageToVideoPipeline loads and runs.

The reward is tests/test_family_wan_train.py's ``redness`` (mean over every frame and pixel of
R - (G + B) / 2). The first frames are grey, green and blue pictures: a video that only kept
its first frame would not be red, so the reward has room to rise. The loop's pictures are the
real video ones (frame strips after each first frame, trainer/visuals.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from eval_gain import train_and_measure
from PIL import Image

from wan_i2v_models import build_tiny_wan_i2v_dir
from wan_models import TINY_VIDEO

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]
H, W, F = TINY_VIDEO
COLOURS = [(128, 128, 128), (40, 160, 60), (40, 60, 200), (200, 200, 200)]
#: Wan 2.2's tiny model moves its expert boundary to 0.75: with its shift of 5.0 the trained
#: high-noise expert then takes steps 0-3 of 6 (enough for a random VAE's colours to move in a
#: few rollouts) and the frozen low-noise expert the last two.
WAN22_TEST_BOUNDARY = 0.75


def write_first_frames(root: Path, name: str, prompts: list[str]) -> Path:
    """A JSONL of records, each with its own first frame (a flat colour with a lighter square)."""
    root.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, prompt in enumerate(prompts):
        pixels = np.full((H, W, 3), COLOURS[i % len(COLOURS)], dtype=np.uint8)
        pixels[8 + i % 8:20 + i % 8, 6:18] = 230
        Image.fromarray(pixels).save(root / f"{name}_{i}.png")
        lines.append(json.dumps({"prompt": prompt, "images": [f"{name}_{i}.png"],
                                 "metadata": {"sample_id": f"{name}{i:02d}"}}))
    path = root / f"{name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def shrink(model_dir: Path, tmp: Path, *, steps: int, pool: list[int]) -> list[str]:
    """The recipe at the tiny model's size on one CPU process (every value the CPU forces)."""
    words = ["a red panda walks", "a bowl of fruit", "a lighthouse at night", "two dogs in the snow",
             "a cat on a chair", "an astronaut on a horse", "a teacup", "a boat"]
    train = write_first_frames(tmp / "data", "train", [f"{w}, take {i}" for i in range(4) for w in words])
    held_out = write_first_frames(tmp / "data", "eval", [f"{w}, a video" for w in words * 2])
    sampling = {"height": H, "width": W, "num_frames": F, "num_inference_steps": steps,
                "sde_indices": pool[:2], "sde_pool": pool, "num_sde_steps": 2}
    return [f"model.model_path={model_dir}", "reward.runtime=cpu",
            "reward.custom_reward_path=test_family_wan_train.redness",
            "reward.scorer_path=none", "reward.required_components=[]", "reward.component_weights={}",
            f"data.prompt_data={train}", f"data.eval_prompt_data={held_out}", "data.eval_max_prompts=16",
            "data.n_samples_per_eval_prompt=4", "data.eval_interval=100", f"logging.run_dir={tmp / 'run'}",
            "logging.progress=false", "logging.log_interval=1", "logging.tensorboard=false",
            "rollout.write_artifacts=false", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
            "rollout.global_batch_size=8", "rollout.engine_dtype=fp32", "rollout.offload_rollout=false",
            f"rollout.sampling={json.dumps(sampling)}", "train.micro_batch_size=2", "train.lr=1e-1",
            "train.eps_clip=0.5", "fsdp.param_dtype=fp32", "fsdp.activation_checkpointing=false",
            "fsdp.load_wave_size=0", "fsdp.offload_train=false", "lora.rank=8", "lora.alpha=16",
            "weight_sync.wire_dtype=fp32", "weight_sync.bucket_size_mb=64", f"checkpoint.save={tmp / 'ckpt'}",
            "checkpoint.save_interval=0", "launch.device=cpu", "launch.nproc=1"]


@pytest.mark.parametrize("variant, recipe", [("wan2.1-i2v", "wan2.1-i2v"), ("wan2.2-i2v", "wan2.2-i2v")])
def test_a_dense_video_reward_rises_within_a_few_rollouts_from_first_frames(tmp_path, variant, recipe):
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    model_dir = build_tiny_wan_i2v_dir(variant, tmp_path, boundary_ratio=WAN22_TEST_BOUNDARY)
    cfg = load_config(recipe, shrink(model_dir, tmp_path, steps=6, pool=[1, 2, 3]) + ["train.num_rollouts=12"])
    assert preflight(cfg, world_size=1) == []

    def check_step(rollout_id: int, metrics: dict) -> None:
        assert metrics["train/first_update_ratio_mean"] == 1.0
        assert metrics["train/policy_version"] == rollout_id + 1

    before, after, gain, noise = train_and_measure(
        Trainer(cfg, rank=0, world=1, device="cpu"), cfg.train.num_rollouts, check_step)
    print(f"{variant} redness eval before {before} after {after}: gain {gain:.4f}, noise {noise:.4f}")
    assert gain > 2 * noise, (before, after)


def test_preflight_names_each_record_without_a_first_frame(tmp_path):
    from trainer.config import load_config
    from trainer.config.sections import ConfigError
    from trainer.preflight import preflight

    model_dir = build_tiny_wan_i2v_dir("wan2.1-i2v", tmp_path)
    overrides = shrink(model_dir, tmp_path, steps=6, pool=[1, 2, 3])
    text_only = tmp_path / "text_only.jsonl"
    text_only.write_text(json.dumps({"prompt": "a boat", "metadata": {"sample_id": "x0"}}) + "\n")
    with pytest.raises(ConfigError, match=r"1 record\(s\) carry no source images \(first at .*text_only.jsonl:1\)"):
        preflight(load_config("wan2.1-i2v", overrides + [f"data.prompt_data={text_only}"]), world_size=1)


@pytest.mark.parametrize("variant", ["wan2.1-i2v", "wan2.2-i2v"])
def test_a_trained_runs_sidecars_replay_and_its_merged_export_runs_in_diffusers_wan_i2v_pipeline(
        tmp_path, variant):
    """Two rollouts with artifacts: the first rollout's sidecar names each candidate's first
    frame, holds the conditions the replay needs, and replays to its recorded log-probs with the
    base weights (that rollout's policy) bit for bit. Then the end-of-run checkpoint, ``python
    -m trainer export --form merged --verify``: a pipeline folder with the trained (merged)
    transformer beside the base's CLIP image encoder (2.1) or untouched low-noise expert (2.2),
    which WanImageToVideoPipeline loads and runs from a first frame."""
    from diffusers import WanImageToVideoPipeline
    from safetensors.torch import load_file

    import flowgrpo_kernels as kernels
    from trainer.cli import main as cli_main
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.models import adapter_class
    from trainer.rollout.artifacts import load_group_sidecar

    model_dir = build_tiny_wan_i2v_dir(variant, tmp_path, boundary_ratio=WAN22_TEST_BOUNDARY)
    cfg = load_config(variant, shrink(model_dir, tmp_path, steps=6, pool=[1, 2, 3])
                      + ["train.num_rollouts=2", "rollout.write_artifacts=true"])
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        trainer.train()
    finally:
        trainer.close()
    sidecar = next((tmp_path / "run" / "artifacts" / "i2v" / "rollout_0000000").glob("group_*.safetensors"))
    rows = load_group_sidecar(sidecar, with_images=False)
    assert len(rows.sources) == 4 and all(len(refs) == 1 and refs[0].entry.endswith(".png") for refs in rows.sources)
    adapter = adapter_class(cfg.model.adapter_path)(str(model_dir))
    assert set(rows.conditions) == set(adapter.condition_keys)
    assert len(list(sidecar.parent.glob(f"{sidecar.stem}_sample_*.gif"))) == 4   # a video per candidate
    base = adapter.load_train_model()
    with torch.no_grad():
        replayed = torch.stack([kernels.sde_log_prob(
            rows.latents[:, s], adapter.replay_velocity(base, rows, s), rows.next_latents[:, s], rows.sigmas[:, s],
            rows.sigmas_next[:, s], eta=rows.eta, sde_type=rows.sde_type) for s in range(len(rows.sde_indices))], 1)
    assert torch.equal(replayed, rows.log_probs)
    out = tmp_path / "merged"
    assert cli_main(["export", "--save-dir", str(tmp_path / "ckpt"), "--output-dir", str(out),
                     "--form", "merged", "--base-model-path", str(model_dir), "--task", "i2v",
                     "--verify"]) == 0
    pipe = WanImageToVideoPipeline.from_pretrained(out)
    assert (pipe.image_encoder is not None) == (variant == "wan2.1-i2v")
    assert (pipe.transformer_2 is not None) == (variant == "wan2.2-i2v")
    base, merged = (load_file(next((d / "transformer").glob("*.safetensors"))) for d in (model_dir, out))
    assert base.keys() == merged.keys()
    assert any(not torch.equal(base[k], merged[k]) for k in base)              # the LoRA was folded in
    if variant == "wan2.2-i2v":  # the frozen expert is the base's, bit for bit
        low_base, low_out = (load_file(next((d / "transformer_2").glob("*.safetensors"))) for d in (model_dir, out))
        assert all(torch.equal(low_base[k], low_out[k]) for k in low_base)
    first_frame = Image.open(tmp_path / "data" / "eval_0.png")

    def run(pipeline):
        return pipeline(image=first_frame, prompt="a boat", height=H, width=W, num_frames=F, num_inference_steps=2,
                        guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0)).frames

    merged_out = run(pipe)
    assert merged_out.shape == (1, 4, 2, 4, 4) and torch.isfinite(merged_out).all()
    # the adapter form through diffusers' own LoRA loader (the image cross-attention's included)
    lora_dir = tmp_path / "adapter"
    assert cli_main(["export", "--save-dir", str(tmp_path / "ckpt"), "--output-dir", str(lora_dir),
                     "--form", "adapter", "--base-model-path", str(model_dir), "--task", "i2v", "--verify"]) == 0
    with_lora = WanImageToVideoPipeline.from_pretrained(model_dir)
    with_lora.load_lora_weights(str(lora_dir))
    lora_names = {n for n, _ in with_lora.transformer.named_modules() if n.endswith("lora_A")}
    assert ("blocks.0.attn2.add_k_proj.lora_A" in lora_names) == (variant == "wan2.1-i2v")
    torch.testing.assert_close(run(with_lora), merged_out)               # merged == base + adapter
    assert not torch.allclose(run(WanImageToVideoPipeline.from_pretrained(model_dir)), merged_out)  # != base
