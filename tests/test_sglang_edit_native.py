"""Qwen-Image-Edit and Qwen-Image-Edit-Plus served by SGLang's own native
``QwenImageEditPipeline`` / ``QwenImageEditPlusPipeline`` (sglang==0.5.23), on CPU.

tests/sglang_fixtures.py serves the tiny checkpoints (tests/tiny_models.py) with the family's
native pipeline and config (``NATIVE_PIPELINES``): SGLang's input validation (it reads each
reference from ``RolloutRequest.image_path`` and sizes it at its config's area, at the
reference's own aspect ratio), its image encoding with the Qwen2.5-VL processor and text
encoder, its image VAE stage, latent and timestep preparation, the native Qwen-Image DiT with
the references' grids in ``img_shapes``, the denoising stage with the rollout hooks, decoding.
One stand-in beyond the fixture's usual ones, for GPU speed: SGLang's hard-coded 1024 * 1024
reference area is patched down to ``AREA`` (the fixture's item 7: a megapixel reference on this
CPU is minutes per candidate); the adapter is configured with the same area, as a user sets
``reference_area = 1048576`` against a real server.

- Stock SGLang returns the prompt embeddings and the references' grids (``img_shapes``) but not
  the references' latents: preflight refuses stock SGLang (``sglang_stock_refusal``).
- With the trainer's extension (which returns ``batch.image_latent``): the native rollout,
  candidates mixing reference aspect ratios, replays through our diffusers transformer with
  the grids SGLang's DiT used (first ratio 1), a full sync is verified by SGLang's checker and
  serves the next rollout, and a training run samples every rollout from the weights it synced.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from sglang_fixtures import require_sglang, serve_sglang, stock_rollout, tensor_shapes

from trainer.media import ImageRef
from trainer.models.geometry import Geometry

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]
H = W = 32
#: The reference area both sides use (SGLang's patched down from 1024 * 1024): a 40x24 picture
#: is sized 64x32, a square one 64x64 (different grids and token counts).
AREA = 48 * 48
FAMILIES = ("qwen_image_edit", "qwen_image_edit_plus")


@pytest.fixture(scope="module", params=FAMILIES)
def server(request, tiny_model_dir):
    with serve_sglang(tiny_model_dir(request.param), extension=True, reference_area=AREA) as srv:
        srv.family = request.param
        yield srv


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    root = tmp_path_factory.mktemp("edit_references")
    out = {}
    for name, colour, size in (("wide", (210, 40, 30), (40, 24)), ("square", (30, 40, 210), (40, 40)),
                               ("grey", (128, 128, 128), (40, 24))):
        pixels = np.full((size[1], size[0], 3), colour, dtype=np.uint8)
        pixels[4:14, 6:16] = 255 - np.array(colour, dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{name}.png")
        out[name] = str(root / f"{name}.png")
    return out


def references(server, pictures, first: str) -> tuple:
    """A candidate's references: Edit's one, Plus's two (the second always the grey one)."""
    refs = (ImageRef(pictures[first]),)
    return refs if server.family == "qwen_image_edit" else refs + (ImageRef(pictures["grey"]),)


def _raw_rollout(url: str, paths: list[str]) -> dict:
    """One SGLang rollout request in its own schema (no extension block: stock behaviour)."""
    return stock_rollout(url, prompt="make it blue", width=W, height=H, true_cfg_scale=1.0,
                         image_path=paths)


def test_stock_answer_has_the_reference_grids_but_not_their_latents(server, pictures):
    """Without our block (stock behaviour) SGLang sizes the reference at its area (the grids
    in its answer's ``img_shapes`` are the ones our adapter computes at the same area, not the
    output's) and returns no tensor of the references' latents' shape: the stock refusal's
    reason, on SGLang's own pipeline."""
    from trainer.models.qwen_image_edit import grids_from_img_shapes

    adapter = server.adapter
    refs = references(server, pictures, "wide")
    answer = _raw_rollout(server.url, [pictures["wide"]] + [pictures["grey"]] * (len(refs) - 1))
    assert tuple(answer["generated_output"].shape[-2:]) == (H, W)
    env = answer["denoising_env"]
    grids = grids_from_img_shapes(env["pos_cond_kwargs"]["img_shapes"])
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    ours = adapter.encode_conditions(frozen, ["make it blue"], [refs], Geometry(H, W))
    assert torch.equal(grids, ours["reference_grids"][0])
    output_grid = [H // adapter.vae_scale_factor // 2, W // adapter.vae_scale_factor // 2]
    assert grids[0].tolist() != output_grid
    shapes = tensor_shapes(env)
    latents = tuple(ours["image_latents"].shape)
    assert latents not in shapes and latents[1:] not in shapes, (latents, shapes)
    assert "batch.image_latent" in type(adapter).sglang_stock_refusal


# ---- through the trainer's extension -----------------------------------------------------------
PROMPTS = ["make it blue"] * 2 + ["keep it"] * 2
IDS = ["prompt:1:sample:0", "prompt:1:sample:1", "prompt:2:sample:0", "prompt:2:sample:1"]
SAMPLING = {"height": H, "width": W, "num_inference_steps": 4, "eta": 0.7,
            "driver_sigmas": False, "driver_xt": False, "guidance_scale": 1.0}


def _edit_request(server, pictures):
    """Four candidates, two with a wide reference and two with a square one."""
    refs = [references(server, pictures, "wide")] * 2 + [references(server, pictures, "square")] * 2
    return server.adapter.build_rollout_request(PROMPTS, IDS, SAMPLING, rollout_id=0, seed=7,
                                                sde_indices=[1, 2], images=refs)


def _serving_the_checkpoint(server):
    """A client of ``server`` after syncing it the checkpoint's weights (tests of this module
    that train sync others)."""
    from trainer.engine.sglang.client import SGLangEngineClient
    from trainer.engine.sglang.sync import SGLangWeightSync

    client = SGLangEngineClient(server.url, embedded=False, extension=True)
    SGLangWeightSync(client, served_dit=type(server.adapter).sglang_dit).sync(
        100, server.adapter.load_train_model().named_parameters())
    return client


def test_extension_rollout_replays_through_our_transformer(server, pictures, tmp_path):
    """With the extension, each candidate's references reach SGLang as files, the answer
    carries their latents (``flowgrpo_image_latent``, equal to our adapter's at the same area up
    to fp32 rounding) and SGLang's grids, candidates of two reference aspect ratios in one
    batch, and our diffusers transformer replays SGLang's native rollout with those grids: the
    first ratio is 1 up to fp32 rounding."""
    from trainer.actor.replay import replay_log_probs

    adapter = server.adapter
    request = _edit_request(server, pictures)
    media = tmp_path / "media"
    media.mkdir()
    client = _serving_the_checkpoint(server)
    client.media_root = str(media)
    response = client.generate(request)
    assert list(media.iterdir()) == []
    batch = adapter.pack_trajectory(response, request)
    assert batch.images.shape == (4, H, W, 3)
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    grids = batch.conditions["reference_grids"]
    for row, name in ((0, "wide"), (2, "square")):
        ours = adapter.encode_conditions(frozen, [PROMPTS[row]], [references(server, pictures, name)],
                                         Geometry(H, W))
        assert torch.equal(grids[row], ours["reference_grids"][0])
        length = ours["image_latents"].shape[1]
        gap = float((batch.conditions["image_latents"][row, :length] - ours["image_latents"][0]).abs().max())
        print(f"{server.family} {name}: SGLang's reference latents vs our adapter's: {gap:.3g}")
        assert gap < 1e-5  # two resizing and VAE implementations, one picture at one size
    assert not torch.equal(grids[0], grids[2])
    with torch.no_grad():
        replay = replay_log_probs(adapter, adapter.load_train_model().eval(), batch, backend="torch")
    gap = float((replay - batch.log_probs).abs().max())
    ratio = float((replay - batch.log_probs).exp().sub(1).abs().max())
    print(f"{server.family} native-vs-replay (extension): max |logp gap| {gap:.3g}, "
          f"max |ratio - 1| {ratio:.3g}")
    assert gap < 2e-4 and ratio < 2e-4


def test_full_sync_is_verified_by_sglangs_checker_and_serves_the_next_rollout(server, pictures):
    """SGLang's stock weight path (``/update_weights_from_tensor`` + its checker) into the
    native DiT the Edit pipeline serves: the served tensors are the trainer's, a wrong digest
    is refused, and the next edit rollout is sampled by the new weights."""
    from sglang_fixtures import as_served

    from trainer.engine.sglang.client import SGLangEngineClient
    from trainer.engine.sglang.sync import SGLangSyncError, SGLangWeightSync, tensor_sha256

    adapter = server.adapter
    client = SGLangEngineClient(server.url, embedded=False, extension=True)
    request = _edit_request(server, pictures)
    before = client.generate(request)
    model = adapter.load_train_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    sender = SGLangWeightSync(client, served_dit=type(adapter).sglang_dit, bucket_bytes=1 << 16)
    stats = sender.sync(3, model.named_parameters())
    assert stats.tensors == len(list(model.parameters())) and client.committed_version == 3
    served = server.served_tensors()
    trained = as_served(model.named_parameters(), type(adapter).sglang_dit)
    assert set(trained) == set(served)
    assert all(torch.equal(served[n], p) for n, p in trained.items())
    digests = {n: tensor_sha256(p) for n, p in trained.items()}
    with pytest.raises(SGLangSyncError, match="checksum mismatch"):
        sender._check({**digests, next(iter(digests)): "0" * 64}, 4)
    after = client.generate(request)
    assert after["policy_version"] == 3
    assert not torch.equal(after["images"], before["images"])


def _run_overrides(server, pictures, tmp_path) -> list[str]:
    """A tiny edit run on ``server`` with the extension and the server's reference area."""
    from sglang_fixtures import trainer_overrides

    over = trainer_overrides(server.adapter.model_path, server.url, tmp_path)
    lines = []
    for i in range(8):
        refs = references(server, pictures, ("wide", "square")[i % 2])
        lines.append(json.dumps({"prompt": f"make shape {i} blue", "images": [r.entry for r in refs],
                                 "metadata": {"sample_id": f"p{i:03d}"}}))
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines))
    return over + ["model.task=edit", "train.num_rollouts=3", "rollout.sglang_extension=true",
                   f"model.adapter_options={json.dumps({'reference_area': AREA})}"]


def test_preflight_allows_the_extension_at_sglangs_area_only(server, pictures, tmp_path):
    """Preflight reads SGLang's reference sizing from its own config code (here the patched
    area): the run at that area with the extension passes; stock SGLang is refused with the
    stock reason; another area (or none) is refused naming both numbers."""
    from trainer.config import load_config
    from trainer.engine.sglang.sync import sglang_config_problems

    over = _run_overrides(server, pictures, tmp_path)

    def family_problems(*extra):
        cfg = load_config("tiny", over + list(extra))
        return [p for p in sglang_config_problems(cfg.model, cfg.rollout, cfg.lora)
                if p.startswith("model family")]

    assert family_problems() == []
    stock = family_problems("rollout.sglang_extension=false")
    assert len(stock) == 1 and type(server.adapter).sglang_stock_refusal in stock[0]
    for options, named in (({"reference_area": 1024 * 1024}, "1048576 pixels"),
                           ({}, "unset (each reference at the output geometry)")):
        refused = family_problems(f"model.adapter_options={json.dumps(options)}")
        assert len(refused) == 1 and named in refused[0], refused
        assert "SGLang sizes each reference at about 4096 pixels" in refused[0]  # 64x64 square


def test_training_run_through_the_extension_samples_from_the_weights_it_synced(server, pictures,
                                                                               tmp_path):
    """A CPU training run of the edit family on SGLang with the extension: every prompt's
    references reach SGLang's native pipeline, each step's weights go through our ipc/
    transport into the native DiT, the first update's ratio is 1, and the next rollout's
    log-probs are the new policy's replay, not the old one's."""
    from sglang_fixtures import train_through_extension

    from trainer.config import load_config

    cfg = load_config("tiny", _run_overrides(server, pictures, tmp_path) + ["train.lr=2e-2"])
    # two training rollouts and two checking ones, 4 candidates each, all sampled by SGLang
    assert train_through_extension(cfg, server, server.adapter) == 16
