"""The merged export of a LoRA run on a diffusers pipeline is a complete pipeline folder
(``model_index.json``, the merged transformer, the base's other parts) that the family's own
diffusers pipeline loads and runs, with a model card naming the base model, the recipe, the
LoRA rank and the final eval. The base is a tiny SD3 pipeline built from config
(tests/tiny_models.py); the checkpoint comes from real optimizer steps."""
import json

import pytest
import torch

import test_checkpoint_harness as h
from tiny_models import build_tiny_model_dir
from trainer.checkpoint import save_checkpoint
from trainer.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _sd3_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(1, 4, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(1, 5, 48, generator=g),
                pooled_projections=torch.randn(1, 40, generator=g),
                timestep=torch.tensor([500.0]))


@pytest.fixture(scope="module")
def sd3_lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export_pipeline")
    base = build_tiny_model_dir("sd3", tmp / "models")
    run = tmp / "runs" / "sd3-t2i-lora"
    tr = h.make_trainer(base, run / "checkpoints", lora=True,
                        adapter_cls=h.DiffusersDirAdapter,
                        extra=["train.lr_warmup_iters=0", "train.lr=0.02"])
    for step in range(2):
        tr.model(**_sd3_inputs(step)).sample.square().mean().backward()
        tr.optimizer.step()
        tr.optimizer.zero_grad()
    tr.next_rollout = tr.policy_version = 2
    assert save_checkpoint(tr.checkpointer, 2) is not None
    from trainer.config import dump_toml
    (run / "config.toml").write_text(dump_toml(tr.cfg))
    rows = [{"step": 0, "eval/reward_mean": 0.25, "eval/ocr_mean": 0.25},
            {"step": 1, "reward/mean": 0.3},
            {"step": 2, "eval/reward_mean": 0.4375, "eval/ocr_mean": 0.4375},
            {"step": 3, "eval/reward_mean": 0.9}]  # after the checkpoint: not its eval
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp, base, run, tr


def test_merged_export_is_a_pipeline_folder_the_sd3_pipeline_loads(sd3_lora_run, tmp_path):
    """The merged export was a transformer only: no model_index.json, no pipeline."""
    from diffusers import DiffusionPipeline, StableDiffusion3Pipeline
    from trainer.actor.sync import merged_full_tensors
    _, base, run, tr = sd3_lora_run
    out = tmp_path / "merged"
    assert cli_main(["export", "--save-dir", str(run / "checkpoints"), "--output-dir", str(out),
                     "--form", "merged", "--base-model-path", str(base), "--verify"]) == 0
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    pipe = StableDiffusion3Pipeline.from_pretrained(str(out))
    assert type(DiffusionPipeline.from_pretrained(str(out))) is StableDiffusion3Pipeline
    state = pipe.transformer.state_dict()
    for k, v in dict(merged_full_tensors(tr.model, scaling=8 / 4)).items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)  # the trained policy
    base_pipe = StableDiffusion3Pipeline.from_pretrained(str(base))
    for part in ("vae", "text_encoder", "text_encoder_3"):
        for (name, got), want in zip(getattr(pipe, part).state_dict().items(),
                                     getattr(base_pipe, part).state_dict().values()):
            assert torch.equal(got, want), (part, name)
    image = pipe("a sign reading \"OPEN\"", num_inference_steps=2, height=32, width=32,
                 guidance_scale=1.0, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 32, 32, 3) and torch.isfinite(torch.from_numpy(image)).all()


def test_merged_export_has_a_model_card_with_base_recipe_rank_and_final_eval(sd3_lora_run,
                                                                              tmp_path):
    """The merged export had no model card."""
    _, base, run, _ = sd3_lora_run
    out = tmp_path / "merged"
    assert cli_main(["export", "--save-dir", str(run / "checkpoints"), "--output-dir", str(out),
                     "--form", "merged", "--base-model-path", str(base)]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: diffusers\n")
    assert str(base / "transformer") in card or str(base) in card        # base model
    assert "LoRA rank 4, alpha 8.0 (merged into the base weights)" in card
    assert "training_config.toml" in card and "run directory `sd3-t2i-lora`" in card
    assert (out / "training_config.toml").read_text() == (run / "config.toml").read_text()
    assert "At step 2" in card and "| eval/reward_mean | 0.4375 |" in card
    assert "0.9000" not in card                                     # an eval after the step
    assert "DiffusionPipeline.from_pretrained" in card


def test_model_card_names_a_hub_base_and_says_when_it_knows_no_run(tmp_path):
    from trainer.checkpoint.model_card import model_card
    snapshot = "/root/.cache/huggingface/hub/models--stabilityai--stable-diffusion-3.5-medium/" \
               "snapshots/abc/transformer"
    card = model_card(form="merged", contract={"mode": "lora", "rank": 32, "alpha": 64.0,
                                               "base_model_path": snapshot},
                      state={"iteration": 7}, run_dir=None, pipeline=True)
    assert "base_model: stabilityai/stable-diffusion-3.5-medium" in card
    assert "recipe: unknown" in card and "No evaluation was recorded" in card
