"""The colocated runtime on a CUDA device (skipped without one). Needs torch + transformers
only: the tiny CLIP directory is written by the benchmark's own builder (byte-level
tokenizer), so no open_clip is needed on the GPU machine."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from trainer.rewards import build_reward_manager, clear_reward_manager_cache, compute_advantages
from trainer.rewards.preprocess import resize_like_pil

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PICKSCORE = "trainer.rewards.pickscore.PickScoreScorer"


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    spec = importlib.util.spec_from_file_location(
        "bench_rewards", os.path.join(REPO, "bench", "bench_rewards.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    directory = tmp_path_factory.mktemp("gpu_clip")
    bench.build_model_dir(str(directory), tiny=True, device=torch.device("cpu"))
    return str(directory)


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_reward_manager_cache()
    yield
    clear_reward_manager_cache()


def batch(n=12, size=160):
    g = torch.Generator().manual_seed(0)
    base = torch.rand(n, 3, size // 16, size // 16, generator=g)
    x = torch.nn.functional.interpolate(base, size=(size, size), mode="bilinear") * 255
    images = x.round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    prompts = [f"prompt {i % 3} about a red panda" for i in range(n)]
    return images, prompts, [{} for _ in prompts]


def test_colocated_fp32_matches_cpu(clip_dir):
    images, prompts, metadata = batch()
    cpu, _ = build_reward_manager(scorer_path=PICKSCORE, model_path=clip_dir,
                                  runtime="cpu").score(images, prompts, metadata)
    manager = build_reward_manager(scorer_path=PICKSCORE, model_path=clip_dir,
                                   runtime="colocate", dtype="float32")
    assert manager.device == torch.device("cuda", torch.cuda.current_device())
    gpu, metrics = manager.score(images.cuda(), prompts, metadata)
    assert gpu["pickscore"].device.type == "cpu" and metrics["reward/score_time"] > 0
    # the only difference is the resize path (float two-pass vs uint8), one level at most
    torch.testing.assert_close(gpu["pickscore"], cpu["pickscore"], rtol=0, atol=2e-3)


def test_colocated_default_is_bf16_and_close(clip_dir):
    images, prompts, metadata = batch()
    manager = build_reward_manager(scorer_path=PICKSCORE, model_path=clip_dir, runtime="colocate")
    assert manager.scorers[0].clip.dtype == torch.bfloat16
    fp32 = build_reward_manager(scorer_path=PICKSCORE, model_path=clip_dir, runtime="colocate",
                                dtype="float32")
    a = manager.score(images.cuda(), prompts, metadata)[0]["pickscore"]
    b = fp32.score(images.cuda(), prompts, metadata)[0]["pickscore"]
    torch.testing.assert_close(a, b, rtol=0, atol=3e-2)


def test_float_resize_path_on_cuda_matches_uint8_path():
    images = torch.randint(0, 256, (4, 3, 384, 384), dtype=torch.uint8)
    cpu = resize_like_pil(images, (224, 224), uint8_path=True)
    gpu = resize_like_pil(images.cuda(), (224, 224)).cpu()
    assert gpu.eq(gpu.round()).all() and (gpu - cpu).abs().max().item() <= 2.0


def test_advantages_on_cuda_equal_cpu():
    g = torch.Generator().manual_seed(1)
    values = torch.rand(64, generator=g)
    values[5] = float("nan")
    groups = torch.arange(64) // 8
    for mode in ("group", "batch", "none"):
        a, ma, fa = compute_advantages({"r": values}, groups, weights={"r": 1.0}, required=["r"],
                                       std_mode=mode)
        b, mb, fb = compute_advantages({"r": values.cuda()}, groups.cuda(), weights={"r": 1.0},
                                       required=["r"], std_mode=mode)
        assert fa == fb == [0] and b.device.type == "cuda"
        torch.testing.assert_close(b.cpu(), a)
        assert ma.keys() == mb.keys()


def test_jpeg_scorer_takes_cuda_images():
    pytest.importorskip("PIL")
    images, prompts, metadata = batch(4, 64)
    manager = build_reward_manager(scorer_path="trainer.rewards.jpeg.JpegCompressibilityScorer",
                                   model_path=None, runtime="colocate")
    gpu = manager.score(images.cuda(), prompts, metadata)[0]["jpeg_compressibility"]
    cpu = build_reward_manager(scorer_path="trainer.rewards.jpeg.JpegCompressibilityScorer",
                               model_path=None, runtime="cpu").score(images, prompts, metadata)[0]
    assert torch.equal(gpu, cpu["jpeg_compressibility"])
