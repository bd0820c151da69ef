"""Built-in scorers: tiny random models written in the published on-disk formats, loaded
through the real loading code, and checked against an independent computation done with the
owning library's own processor and forward."""
from __future__ import annotations

import gzip
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from trainer.rewards import build_reward_manager, clear_reward_manager_cache
from trainer.rewards.preprocess import (resize_like_pil, transform_from_hf_processor,
                                        transform_from_open_clip)

open_clip = pytest.importorskip("open_clip")
transformers = pytest.importorskip("transformers")

# NOTE: tiny models run faster on one thread on a shared machine (conftest).
pytestmark = pytest.mark.usefixtures("torch_single_thread")

IMAGE = 32  # the tiny towers' input size: scoring images of this size makes resize a no-op


def smooth_images(n: int, height: int, width: int, seed: int) -> torch.Tensor:
    """Natural-looking uint8 [n, H, W, 3]: low-frequency colour fields plus mild noise."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(n, 3, height // 12 + 2, width // 12 + 2, generator=g)
    x = F.interpolate(base, size=(height, width), mode="bilinear", align_corners=False) * 255
    x = x + torch.randn(n, 3, height, width, generator=g) * 6
    return x.clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def write_clip_tokenizer(directory) -> None:
    """A transformers CLIPTokenizer from the BPE vocabulary open_clip ships (same ids as the
    released CLIP tokenizer: bytes, bytes + </w>, the merges, then the two specials)."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe

    merges = gzip.open(default_bpe()).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    vocab = list(bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({token: i for i, token in enumerate(vocab)}, f)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": 77}, f)


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A transformers CLIP directory (model + processor) with random weights."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    directory = tmp_path_factory.mktemp("tiny_clip")
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=49408, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=IMAGE, patch_size=8),
        projection_dim=16)
    model = CLIPModel(config)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(40.0))  # not the init value: the scorer must read it
    model.save_pretrained(directory)
    write_clip_tokenizer(directory)
    CLIPImageProcessor(size={"shortest_edge": IMAGE},
                       crop_size={"height": IMAGE, "width": IMAGE}).save_pretrained(directory)
    return str(directory)


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_reward_manager_cache()
    yield
    clear_reward_manager_cache()


def reference_clip_embeds(model_dir, images, prompts):
    """Independent path: CLIPProcessor + CLIPModel.get_*_features, fp32."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(model_dir).eval()
    processor = CLIPProcessor.from_pretrained(model_dir)
    inputs = processor(text=prompts, images=[Image.fromarray(a.numpy()) for a in images],
                       padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image = model.get_image_features(pixel_values=inputs["pixel_values"])
        text = model.get_text_features(input_ids=inputs["input_ids"],
                                       attention_mask=inputs["attention_mask"])
    image = image if isinstance(image, torch.Tensor) else image.pooler_output
    text = text if isinstance(text, torch.Tensor) else text.pooler_output
    return (image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True),
            model.logit_scale.exp().item())


PROMPTS = ["a red panda in a teacup", "an astronaut riding a horse on the moon",
           "a red panda in a teacup", "Tokyo at night, neon, rain",
           "an astronaut riding a horse on the moon", "a bowl of soup"]


def test_tokenizer_built_from_open_clip_vocab_matches_open_clip(tiny_clip_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_clip_dir)
    reference = open_clip.get_tokenizer("ViT-H-14")
    for prompt in PROMPTS + ["naïve café, 東京!!"]:
        ids = hf(prompt)["input_ids"]
        expected = reference([prompt])[0]
        assert ids == expected[:len(ids)].tolist() and expected[len(ids):].eq(0).all()


def test_pickscore_matches_processor_and_model_forward(tiny_clip_dir):
    images = smooth_images(len(PROMPTS), IMAGE, IMAGE, seed=1)
    manager = build_reward_manager(scorer_path="trainer.rewards.pickscore.PickScoreScorer",
                                   model_path=tiny_clip_dir, runtime="cpu")
    assert manager.components == ("pickscore",)
    scores, metrics = manager.score(images, PROMPTS, [{} for _ in PROMPTS])
    image, text, scale = reference_clip_embeds(tiny_clip_dir, images, PROMPTS)
    expected = scale * (image * text).sum(-1) / 26.0
    torch.testing.assert_close(scores["pickscore"], expected, rtol=1e-5, atol=1e-6)
    assert scores["pickscore"].dtype == torch.float32 and scores["pickscore"].shape == (6,)
    assert metrics["reward/score_time"] > 0 and metrics["reward/score_samples_per_s"] > 0
    # cached per configuration: the same arguments give the same loaded object
    again = build_reward_manager(scorer_path="trainer.rewards.pickscore.PickScoreScorer",
                                 model_path=tiny_clip_dir, runtime="cpu")
    assert again is manager
    other = build_reward_manager(scorer_path="trainer.rewards.pickscore.PickScoreScorer",
                                 model_path=tiny_clip_dir, runtime="cpu", batch_size=4)
    assert other is not manager
    # chunked scoring (batch_size 4 < 6 images) gives the same numbers
    torch.testing.assert_close(other.score(images, PROMPTS, [{}] * 6)[0]["pickscore"],
                               scores["pickscore"], rtol=1e-5, atol=1e-6)


def test_clipscore_matches_reference(tiny_clip_dir):
    images = smooth_images(len(PROMPTS), IMAGE, IMAGE, seed=2)
    manager = build_reward_manager(scorer_path="trainer.rewards.clipscore.CLIPScoreScorer",
                                   model_path=tiny_clip_dir, runtime="cpu")
    scores, _ = manager.score(images, PROMPTS, [{}] * len(PROMPTS))
    image, text, _ = reference_clip_embeds(tiny_clip_dir, images, PROMPTS)
    expected = 2.5 * (image * text).sum(-1).clamp_min(0)
    torch.testing.assert_close(scores["clipscore"], expected, rtol=1e-5, atol=1e-6)


def test_clipscore_own_weight_is_settable_and_cannot_pass_for_the_mixing_weight(tiny_clip_dir):
    """``weight`` in [reward.scorers.clipscore] is the mixing weight; CLIPScore's own 2.5
    rescale is also called ``weight``. Set alone it used to become the mixing weight without a
    word; now that is an error, and ``options`` gives the constructor its own."""
    from trainer.config import ConfigError, load_config
    from trainer.preflight.imports import check_imports
    from trainer.rewards import build_reward_manager_from_config

    base = ["reward.scorer_path=none", "reward.component_weights={}",
            "reward.required_components=[]"]
    table = json.dumps({"model_path": tiny_clip_dir, "weight": 100})
    with pytest.raises(ConfigError) as err:
        check_imports(load_config("tiny", base + [f'reward.scorers={{"clipscore": {table}}}']))
    assert "reward.scorers.clipscore.weight is read as the table's mixing weight, but " \
           "trainer.rewards.clipscore.CLIPScoreScorer also takes a constructor option " \
           "'weight'" in str(err.value)
    table = json.dumps({"model_path": tiny_clip_dir, "weight": 0.5,
                        "options": {"weight": 100}})
    cfg = load_config("tiny", base + [f'reward.scorers={{"clipscore": {table}}}'])
    check_imports(cfg)
    manager = build_reward_manager_from_config(cfg.reward)
    assert manager.weights == {"clipscore": 0.5}
    images = smooth_images(len(PROMPTS), IMAGE, IMAGE, seed=2)
    scores, _ = manager.score(images, PROMPTS, [{}] * len(PROMPTS))
    image, text, _ = reference_clip_embeds(tiny_clip_dir, images, PROMPTS)
    torch.testing.assert_close(scores["clipscore"], 100 * (image * text).sum(-1).clamp_min(0),
                               rtol=1e-5, atol=1e-5)


def _write_head(path, widths, seed):
    g = torch.Generator().manual_seed(seed)
    state, index = {}, 0
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        state[f"layers.{index}.weight"] = torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5
        state[f"layers.{index}.bias"] = torch.randn(fan_out, generator=g) * 0.1
        index += 2 if i < len(widths) - 3 else 1  # dropout between all but the last two
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file
        save_file(state, str(path))
    else:
        torch.save(state, str(path))
    return state


def test_aesthetic_head_from_laion_layout(tiny_clip_dir, tmp_path):
    images = smooth_images(4, IMAGE, IMAGE, seed=3)
    head = tmp_path / "head.safetensors"
    state = _write_head(head, [16, 12, 8, 6, 4, 1], seed=0)
    assert sorted(state) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7)
                                   for p in ("weight", "bias"))  # the LAION key layout
    manager = build_reward_manager(scorer_path="trainer.rewards.aesthetic.AestheticScorer",
                                   model_path=tiny_clip_dir, runtime="cpu", head_path=str(head))
    scores, _ = manager.score(images, ["x"] * 4, [{}] * 4)
    image, _, _ = reference_clip_embeds(tiny_clip_dir, images, ["x"] * 4)
    x = image
    for i in (0, 2, 4, 6, 7):
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(scores["aesthetic"], x.squeeze(-1), rtol=1e-5, atol=1e-6)


def test_aesthetic_head_errors(tiny_clip_dir, tmp_path):
    from trainer.rewards.aesthetic import AestheticScorer

    with pytest.raises(FileNotFoundError, match="aesthetic_head"):
        AestheticScorer(model_path=tiny_clip_dir)
    bad = tmp_path / "bad.pth"
    torch.save({"layers.0.weight": torch.zeros(8, 16), "layers.2.weight": torch.zeros(2, 5),
                "extra": torch.zeros(1)}, str(bad))
    with pytest.raises(ValueError) as err:
        AestheticScorer(model_path=tiny_clip_dir, head_path=str(bad))
    message = str(err.value)  # one error naming every problem
    assert "unexpected key 'extra'" in message and "takes 5 inputs" in message \
        and "gives 2 outputs, not 1" in message
    wrong_width = tmp_path / "wide.pth"
    _write_head(wrong_width, [24, 4, 1], seed=1)
    with pytest.raises(ValueError, match="takes 24-d embeddings"):
        AestheticScorer(model_path=tiny_clip_dir, head_path=str(wrong_width))


@pytest.fixture(scope="module")
def tiny_hps(tmp_path_factory):
    """An open_clip architecture + a checkpoint in the HPSv2 file format."""
    directory = tmp_path_factory.mktemp("tiny_hps")
    arch = directory / "tiny-hps-test.json"
    arch.write_text(json.dumps({
        "embed_dim": 16,
        "vision_cfg": {"image_size": IMAGE, "layers": 2, "width": 32, "head_width": 16,
                       "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2,
                     "layers": 2}}))
    open_clip.add_model_config(str(arch))
    torch.manual_seed(1)
    model = open_clip.create_model("tiny-hps-test", pretrained=None)
    checkpoint = directory / "HPS_v2.1_compressed.pt"
    # HPSv2 checkpoints wrap the weights as {"state_dict": ...} with DDP "module." names.
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}},
               str(checkpoint))
    return str(arch), str(directory), str(checkpoint)


def test_hps_matches_open_clip_forward(tiny_hps):
    arch, directory, checkpoint = tiny_hps
    images = smooth_images(len(PROMPTS), IMAGE, IMAGE, seed=4)
    manager = build_reward_manager(scorer_path="trainer.rewards.hps.HPSv2Scorer",
                                   model_path=directory, runtime="cpu",
                                   arch="tiny-hps-test", arch_config=arch)
    scores, _ = manager.score(images, PROMPTS, [{}] * len(PROMPTS))
    model, _, preprocess = open_clip.create_model_and_transforms("tiny-hps-test",
                                                                 pretrained=checkpoint)
    tokenizer = open_clip.get_tokenizer("tiny-hps-test")
    with torch.no_grad():
        pixels = torch.stack([preprocess(Image.fromarray(a.numpy())) for a in images])
        image = model.encode_image(pixels, normalize=True)
        text = model.encode_text(tokenizer(PROMPTS), normalize=True)
    torch.testing.assert_close(scores["hps"], torch.diagonal(image @ text.T), rtol=1e-5,
                               atol=1e-6)


def test_hps_errors(tiny_hps, tmp_path):
    from trainer.rewards.hps import HPSv2Scorer

    with pytest.raises(FileNotFoundError, match="HPS_v2"):
        HPSv2Scorer(model_path=str(tmp_path), arch="tiny-hps-test")
    with pytest.raises(ValueError, match="no architecture 'not-an-arch'"):
        HPSv2Scorer(model_path=tiny_hps[2], arch="not-an-arch")


@pytest.mark.parametrize("height,width,target", [(384, 384, 224), (96, 80, 56), (57, 200, 56)])
def test_torch_preprocessing_matches_the_libraries(tiny_clip_dir, tmp_path, height, width, target):
    """Resize + crop + normalise agree with transformers' processor and open_clip's transform
    to one uint8 level (both resize paths), and the crop offset conventions are exact."""
    from transformers import CLIPImageProcessor

    CLIPImageProcessor(size={"shortest_edge": target},
                       crop_size={"height": target, "width": target}).save_pretrained(tmp_path)
    images = smooth_images(2, height, width, seed=5)
    pils = [Image.fromarray(a.numpy()) for a in images]
    hf = transform_from_hf_processor(str(tmp_path))
    hf_ref = CLIPImageProcessor.from_pretrained(tmp_path)(images=pils, return_tensors="pt")
    oc = transform_from_open_clip({"size": target, "mean": open_clip.OPENAI_DATASET_MEAN,
                                   "std": open_clip.OPENAI_DATASET_STD})
    oc_ref = torch.stack([open_clip.image_transform(target, is_train=False)(p) for p in pils])
    one_level = 1.0 / 255 / min(hf.std) + 1e-6
    for ours, ref in ((hf(images), hf_ref["pixel_values"]), (oc(images), oc_ref)):
        assert ours.shape == ref.shape == (2, 3, target, target)
        assert (ours - ref).abs().max().item() <= one_level
        assert (ours - ref).abs().mean().item() < 0.1 * one_level


@pytest.mark.parametrize("height,width,size", [(384, 384, (224, 224)), (57, 200, (56, 196)),
                                               (96, 80, (67, 56))])
def test_both_resize_paths_match_pil(height, width, size):
    """The uint8 path (CPU) and the two-pass float path (CUDA) stay within one level of PIL's
    bicubic even on pure noise, where saturation makes a one-pass float resize drift."""
    for images in (smooth_images(2, height, width, seed=7),
                   torch.randint(0, 256, (2, height, width, 3), dtype=torch.uint8)):
        pil = torch.stack([torch.from_numpy(np.array(Image.fromarray(a.numpy()).resize(
            (size[1], size[0]), Image.BICUBIC))) for a in images]).permute(0, 3, 1, 2).float()
        for uint8_path in (True, False):
            out = resize_like_pil(images.permute(0, 3, 1, 2), size, uint8_path=uint8_path)
            assert out.shape == pil.shape and out.eq(out.round()).all()
            assert (out - pil).abs().max().item() <= 1.0


def test_jpeg_sizes_match_an_independent_encoder():
    """Sizes equal libjpeg-turbo's through torchvision (a separate binding of the codec)."""
    torchvision_io = pytest.importorskip("torchvision.io")
    images = torch.cat([smooth_images(2, 48, 40, seed=6),
                        torch.randint(0, 256, (1, 48, 40, 3), dtype=torch.uint8),
                        torch.full((1, 48, 40, 3), 128, dtype=torch.uint8)])
    manager = build_reward_manager(scorer_path="trainer.rewards.jpeg.JpegCompressibilityScorer",
                                   model_path=None, runtime="cpu", quality=80)
    inverse = build_reward_manager(
        scorer_path="trainer.rewards.jpeg.JpegIncompressibilityScorer", model_path=None,
        runtime="cpu", quality=80)
    comp, _ = manager.score(images, ["p"] * 4, [{}] * 4)
    incomp, _ = inverse.score(images, ["p"] * 4, [{}] * 4)
    expected = torch.tensor([len(torchvision_io.encode_jpeg(a.permute(2, 0, 1).contiguous(),
                                                            quality=80)) / 1000.0
                             for a in images])
    torch.testing.assert_close(incomp["jpeg_incompressibility"], expected)
    torch.testing.assert_close(comp["jpeg_compressibility"], -expected)
    # noise is the least compressible, a flat grey image the most
    assert incomp["jpeg_incompressibility"].argmax() == 2
    assert comp["jpeg_compressibility"].argmax() == 3
    with pytest.raises(ValueError, match="quality=0"):
        build_reward_manager(scorer_path="trainer.rewards.jpeg.JpegCompressibilityScorer",
                             model_path=None, runtime="cpu", quality=0)
