"""The adapter export loads with diffusers' own ``pipe.load_lora_weights(dir)`` for every
shipped family, at full strength: the pipeline's output equals the merged export's and
differs from the base's. The checkpoints come from two real optimizer steps on the family
adapter's own forward (tiny random pipelines of tests/tiny_models.py)."""
import json

import pytest
import torch

import test_checkpoint_harness as h
from tiny_models import FAMILIES, TINY_HEIGHT, TINY_WIDTH
from trainer.checkpoint import save_checkpoint
from trainer.cli import main as cli_main
from trainer.models import adapter_class
from trainer.models.geometry import Geometry

pytestmark = pytest.mark.usefixtures("torch_single_thread")
PROMPT = "a red panda in a teacup"


def train_two_steps(family, base, root):
    tr = h.make_trainer(base, root, lora=True, adapter_cls=adapter_class(family),
                        extra=["train.lr_warmup_iters=0", "train.lr=0.02"])
    frozen = tr.adapter.load_frozen(device="cpu", dtype=torch.float32)
    conditions = tr.adapter.encode_prompts(frozen, [PROMPT])
    g = torch.Generator().manual_seed(0)
    shape = tr.adapter.latent_shape(Geometry(TINY_HEIGHT, TINY_WIDTH))
    for step in range(2):
        latents = torch.randn(1, *shape, generator=g)
        target = torch.randn(1, *shape, generator=g)
        sigma = torch.tensor([0.3 + 0.4 * step])
        v = tr.adapter.velocity(tr.model, latents, sigma, conditions, Geometry(TINY_HEIGHT, TINY_WIDTH))
        (v - target).square().mean().backward()
        tr.optimizer.step()
        tr.optimizer.zero_grad()
    tr.next_rollout = tr.policy_version = 2
    assert save_checkpoint(tr.checkpointer, 2) is not None
    return tr


def run_pipeline(pipe):
    with torch.no_grad():
        return pipe(PROMPT, height=TINY_HEIGHT, width=TINY_WIDTH, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(1), output_type="latent").images


@pytest.mark.parametrize("family", FAMILIES)
def test_load_lora_weights_equals_merged_export(family, tiny_model_dir, tmp_path):
    import diffusers
    from safetensors import safe_open
    base = tiny_model_dir(family)
    train_two_steps(family, base, tmp_path / "ckpt")
    lora_dir, merged_dir = tmp_path / "lora", tmp_path / "merged"
    # no --base-model-path: both read the base recorded in the checkpoint
    assert cli_main(["export", "--save-dir", str(tmp_path / "ckpt"), "--output-dir",
                     str(lora_dir), "--form", "adapter", "--verify"]) == 0
    assert cli_main(["export", "--save-dir", str(tmp_path / "ckpt"), "--output-dir",
                     str(merged_dir), "--form", "merged"]) == 0

    with safe_open(str(lora_dir / "pytorch_lora_weights.safetensors"), framework="pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert keys and all(k.startswith("transformer.") for k in keys)
    config = json.loads(meta["lora_adapter_metadata"])
    assert (config["transformer.r"], config["transformer.lora_alpha"]) == (4, 8)

    pipe = diffusers.DiffusionPipeline.from_pretrained(base)
    pipe.set_progress_bar_config(disable=True)
    base_out = run_pipeline(pipe)
    pipe.load_lora_weights(str(lora_dir))
    lora_out = run_pipeline(pipe)
    # the merged export of a pipeline base is a whole pipeline folder: loaded on its own
    merged = diffusers.DiffusionPipeline.from_pretrained(merged_dir)
    assert type(merged) is type(pipe)
    merged.set_progress_bar_config(disable=True)
    merged_out = run_pipeline(merged)

    torch.testing.assert_close(lora_out, merged_out, rtol=1e-4, atol=1e-5)
    gap = (lora_out - base_out).abs().max().item()
    assert gap > 100 * (lora_out - merged_out).abs().max().item() and gap > 1e-4


def test_verify_catches_a_lost_alpha(tiny_model_dir, tmp_path):
    """A diffusers file without the adapter metadata loads with alpha = rank: --verify's
    diffusers reload names it."""
    from safetensors.torch import load_file, save_file
    from trainer.checkpoint.export import (export_checkpoint, plan_export, read_model_tensors,
                                           verify_export)
    base = tiny_model_dir("sd3")
    train_two_steps("sd3", base, tmp_path / "ckpt")
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "a", form="adapter")
    plan = plan_export(tmp_path / "ckpt", tmp_path / "a", form="adapter", verify=True,
                       overwrite=True)
    tensors = read_model_tensors(plan.iter_dir)
    assert verify_export(plan, tensors, out) == []
    weights = out / "pytorch_lora_weights.safetensors"
    save_file(load_file(str(weights)), str(weights), metadata={"format": "pt"})
    problems = "\n".join(verify_export(plan, tensors, out))
    assert "diffusers read r=4 alpha=4" in problems
