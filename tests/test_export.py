"""``python -m trainer export``: merged and adapter exports of a LoRA checkpoint, a full-model
export, refusals, and --verify catching a bad export. The base is a tiny diffusers SD3
transformer saved to disk; the checkpoints come from real training steps."""
import json

import pytest
import torch

import test_checkpoint_harness as h
from trainer.checkpoint import save_checkpoint
from trainer.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("torch_single_thread")
SD3_CONFIG = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                  caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
                  pos_embed_max_size=8)


def save_sd3(root, seed):
    from diffusers import SD3Transformer2DModel
    torch.manual_seed(seed)
    SD3Transformer2DModel(**SD3_CONFIG).save_pretrained(root / "transformer")
    return root


def sd3_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(2, 5, 16, generator=g),
                pooled_projections=torch.randn(2, 8, generator=g),
                timestep=torch.tensor([300.0, 700.0]))


def train_sd3(base, root, lora, steps=2):
    tr = h.make_trainer(base, root, lora=lora, adapter_cls=h.DiffusersDirAdapter,
                        extra=["train.lr_warmup_iters=0", "train.lr=0.02"])
    for step in range(steps):
        tr.model(**sd3_inputs(step)).sample.square().mean().backward()
        tr.optimizer.step()
        tr.optimizer.zero_grad()
    tr.next_rollout = tr.policy_version = steps
    assert save_checkpoint(tr.checkpointer, steps) is not None
    return tr


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export_lora")
    base = save_sd3(tmp / "base", seed=0)
    return tmp, base, train_sd3(base, tmp / "ckpt", lora=True)


def export(*args):
    return cli_main(["export", *map(str, args)])


def test_merged_export_loads_with_diffusers_and_equals_the_trained_policy(lora_run, tmp_path):
    from diffusers import SD3Transformer2DModel
    from safetensors import safe_open
    from trainer.actor.sync import merged_full_tensors
    tmp, base, tr = lora_run
    out = tmp_path / "merged"
    assert export("--save-dir", tmp / "ckpt", "--output-dir", out, "--form", "merged",
                  "--base-model-path", base, "--verify") == 0
    with safe_open(str(out / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if "lora_" in k]
    merged = SD3Transformer2DModel.from_pretrained(out)
    # the same weights the engine receives in merge-mode sync
    engine_view = dict(merged_full_tensors(tr.model, scaling=8 / 4))
    state = merged.state_dict()
    assert set(engine_view) <= set(state)
    for k, v in engine_view.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)
    base_state = SD3Transformer2DModel.from_pretrained(base / "transformer").state_dict()
    changed = [k for k in state if not torch.equal(state[k], base_state[k])]
    assert changed and all(any(t in k for t in ("to_q", "to_k", "to_v", "to_out")) for k in changed)
    with torch.no_grad():
        want = tr.model(**sd3_inputs(5)).sample
        got = merged(**sd3_inputs(5)).sample
    torch.testing.assert_close(got, want)


def test_adapter_export_loads_with_peft(lora_run, tmp_path):
    from diffusers import SD3Transformer2DModel
    from peft import PeftModel
    tmp, base, tr = lora_run
    out = tmp_path / "adapter"
    assert export("--save-dir", tmp / "ckpt" / "t2i", "--output-dir", out, "--form", "adapter",
                  "--verify") == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"])) == \
        (4, 8.0, ["to_k", "to_out.0", "to_q", "to_v"])
    model = PeftModel.from_pretrained(SD3Transformer2DModel.from_pretrained(base / "transformer"),
                                      out)
    trained = {n: p for n, p in tr.model.named_parameters() if "lora_" in n}
    loaded = dict(model.named_parameters())
    assert trained and all(torch.equal(loaded[n], p) for n, p in trained.items())
    with torch.no_grad():
        torch.testing.assert_close(model(**sd3_inputs(3)).sample, tr.model(**sd3_inputs(3)).sample)


def test_refusals_name_every_problem(lora_run, tmp_path, capsys):
    tmp, base, _ = lora_run
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert export("--save-dir", tmp / "ckpt", "--output-dir", busy, "--form", "merged",
                  "--dtype", "bf16", "--base-model-path", tmp_path / "nowhere") == 2
    err = capsys.readouterr().err
    assert "holds no diffusers transformer" in err and "is not empty" in err
    assert (busy / "keep.txt").exists() and len(list(busy.iterdir())) == 1
    assert export("--save-dir", tmp / "ckpt", "--output-dir", tmp_path / "o", "--form",
                  "full") == 2
    assert "holds only a LoRA adapter" in capsys.readouterr().err
    other = save_sd3(tmp_path / "other_base", seed=1)
    assert export("--save-dir", tmp / "ckpt", "--output-dir", tmp_path / "o", "--form",
                  "merged", "--base-model-path", other) == 2
    assert "not the one the adapter was trained on" in capsys.readouterr().err
    assert export("--save-dir", tmp / "ckpt", "--output-dir", tmp_path / "o", "--iteration",
                  "7", "--form", "adapter") == 2
    assert "iteration 7" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_verify_catches_a_bad_merged_export(lora_run, tmp_path):
    from safetensors.torch import load_file, save_file
    from trainer.checkpoint.export import (export_checkpoint, plan_export, read_model_tensors,
                                           verify_export)
    tmp, base, _ = lora_run
    out = export_checkpoint(tmp / "ckpt", tmp_path / "m", form="merged", base_model_path=base)
    plan = plan_export(tmp / "ckpt", tmp_path / "m", form="merged", base_model_path=base,
                       overwrite=True)
    tensors = read_model_tensors(plan.iter_dir)
    assert verify_export(plan, tensors, out) == []
    weights = out / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    victim = "transformer_blocks.0.attn.to_q.weight"
    state[victim] = state[victim] + 1e-3
    state["transformer_blocks.0.attn.to_q.lora_A.weight"] = torch.zeros(4, 16)
    save_file(state, str(weights), metadata={"format": "pt"})
    problems = "\n".join(verify_export(plan, tensors, out))
    assert victim in problems and "lora_A/lora_B" in problems


def test_full_checkpoint_exports_to_safetensors(tmp_path):
    from diffusers import SD3Transformer2DModel
    base = save_sd3(tmp_path / "base", seed=2)
    tr = train_sd3(base, tmp_path / "ckpt", lora=False, steps=1)
    out = tmp_path / "full"
    assert export("--save-dir", tmp_path / "ckpt", "--output-dir", out, "--dtype", "bf16",
                  "--verify") == 0  # base found through the checkpoint's recorded model path
    model = SD3Transformer2DModel.from_pretrained(out)
    state = model.state_dict()
    for n, p in tr.model.state_dict().items():
        assert torch.equal(state[n], p.to(torch.bfloat16)), n
    assert export("--save-dir", tmp_path / "ckpt", "--output-dir", tmp_path / "x", "--form",
                  "adapter") == 2
