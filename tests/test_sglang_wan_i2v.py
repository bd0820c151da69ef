"""Wan 2.1 image-to-video served by SGLang's own native ``WanImageToVideoPipeline``
(sglang==0.5.23), on CPU: what its rollout answer carries, which is why preflight refuses
``rollout.engine = "sglang"`` for the ``wan_i2v`` family (trainer/models/wan_i2v.py,
``sglang_refusal``).

tests/sglang_fixtures.py serves the tiny Wan 2.1 I2V checkpoint (tests/wan_i2v_models.py) as a
user serves the published one (``--model-id Wan2.1-I2V-14B-480P-Diffusers``): SGLang's native
Wan DiT, its text and CLIP image encoding, its image VAE stage, latent and timestep preparation,
the denoising stage with the rollout hooks, decoding; the request is SGLang's own
``RolloutRequest`` with the first frame as a file in ``image_path``. The answer holds the video,
the trajectory and the frame's CLIP embeddings, but no first-frame condition latents: the
replay cannot be given what the DiT saw beside the noise.
"""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

from sglang_fixtures import require_sglang, serve_sglang

from trainer.engine.sglang.rollout import decode_tensors
from trainer.media import ImageRef
from trainer.models.geometry import Geometry
from wan_i2v_models import build_tiny_wan_i2v_dir
from wan_models import TINY_VIDEO

require_sglang()

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_single_thread")]
H, W, F = TINY_VIDEO


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_wan_i2v_dir("wan2.1-i2v", tmp_path_factory.mktemp("wan_i2v"))
    with serve_sglang(model_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_frames")
    out = {}
    for name, colour in (("red", (210, 40, 30)), ("blue", (30, 40, 210))):
        pixels = np.full((H, W, 3), colour, dtype=np.uint8)
        pixels[4:14, 6:16] = 255 - np.array(colour, dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{name}.png")
        out[name] = str(root / f"{name}.png")
    return out


def _rollout(url: str, frame: str) -> dict:
    """One SGLang rollout request (its own schema) with ``frame`` as the first frame."""
    import msgspec

    body = {"prompt": "a red panda walks", "seed": 5, "width": W, "height": H, "num_frames": F,
            "num_inference_steps": 4, "num_outputs_per_prompt": 1, "guidance_scale": 1.0,
            "rollout": True, "rollout_sde_type": "sde", "rollout_noise_level": 0.7,
            "rollout_sde_step_indices": [1, 2], "rollout_return_dit_trajectory": True,
            "rollout_return_denoising_env": True, "rollout_debug_mode": False,
            "suppress_logs": True, "image_path": [frame]}
    request = urllib.request.Request(url + "/rollout/generate", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer = decode_tensors(msgspec.msgpack.decode(reply.read()))
    assert isinstance(answer, list) and len(answer) == 1
    return answer[0]


def _tensor_shapes(obj) -> list[tuple[int, ...]]:
    if isinstance(obj, torch.Tensor):
        return [tuple(obj.shape)]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _tensor_shapes(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _tensor_shapes(v)]
    return []


def test_sglang_takes_the_first_frame_by_path_and_returns_no_condition_latents(server, frames):
    """SGLang's native pipeline reads the first frame from ``image_path`` (its CLIP embeddings
    differ between two frames, and equal our adapter's) and returns a video rollout, but none of the tensors of its
    denoising env has the shape of the first-frame condition latents our adapter computes for
    the same frame (mask + VAE latents, what Wan's DiT is given beside the noise): that is the
    refusal's reason, shown on SGLang's own pipeline."""
    from trainer.models import adapter_class

    red, blue = _rollout(server.url, frames["red"]), _rollout(server.url, frames["blue"])
    assert tuple(red["generated_output"].shape) == (3, F, H, W)
    assert red["dit_trajectory"]["latents"].shape[0] == 5  # T + 1
    clip = red["denoising_env"]["image_kwargs"]["encoder_hidden_states_image"]
    clip_blue = blue["denoising_env"]["image_kwargs"]["encoder_hidden_states_image"]
    assert not torch.equal(clip[0], clip_blue[0])  # SGLang read each frame

    adapter = server.adapter
    frozen = adapter.load_frozen(device="cpu", dtype=torch.float32)
    ours = adapter.encode_conditions(frozen, ["a red panda walks"], [(ImageRef(frames["red"]),)],
                                     Geometry(H, W, F))
    # what SGLang does return is what our adapter encodes: the CLIP embeddings bit for bit, the
    # prompt embeddings to fp32 rounding (two T5 implementations)
    assert torch.equal(clip[0], ours["image_embeds"][0])
    prompt = red["denoising_env"]["pos_cond_kwargs"]["encoder_hidden_states"]
    prompt = prompt[0] if isinstance(prompt, list) else prompt
    assert prompt.shape == ours["prompt_embeds"][0].shape
    assert float((prompt - ours["prompt_embeds"][0]).abs().max()) < 1e-5
    condition = tuple(ours["condition_latents"].shape)
    shapes = _tensor_shapes(red["denoising_env"])
    assert condition not in shapes and condition[1:] not in shapes, (condition, shapes)
    assert adapter_class("wan_i2v").sglang_refusal.startswith(
        "SGLang 0.5.23's native WanImageToVideoPipeline")
