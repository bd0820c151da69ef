"""Tiny random-weight models of each family in the diffusers on-disk layout, for CPU tests.

    build_tiny_model_dir(family, root) -> Path      family in FAMILIES

writes ``root/<family>/`` as ``save_pretrained`` lays out a real checkpoint (model_index.json,
transformer/, vae/, scheduler/, text_encoder*/, tokenizer*/), so tests load it through the
real from_pretrained path. Use the session-cached ``tiny_model_dir`` fixture of conftest.py
rather than calling this per test (each build costs seconds of CPU).

Every dimension is the smallest the architecture accepts; what is kept real is what loading
and shape logic depend on: real tokenizer vocabularies (CLIP's BPE from open_clip's bundled
vocabulary, a T5 Unigram and a Qwen2 byte-level BPE trained with ``tokenizers`` on a small
corpus), the text/pooled dimension chains between encoders and transformer, the schedulers'
shift settings of the real models, the VAEs' scaling/shift factors and latent statistics.
``TINY_HEIGHT`` x ``TINY_WIDTH`` pixels is a valid (small) resolution for every family.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import torch

from trainer.models import ADAPTERS

FAMILIES = ("qwen_image", "sd3", "flux")
# The image-editing families (task "edit": prompt + reference images); built like the others
# by build_tiny_model_dir, kept out of FAMILIES, whose tests are text-to-image.
EDIT_FAMILIES = ("qwen_image_edit", "qwen_image_edit_plus")
TINY_HEIGHT, TINY_WIDTH = 32, 32
ADAPTER_PATHS = {family: ADAPTERS[family] for family in FAMILIES}  # dotpath of each family's adapter

# Text the tiny T5 / Qwen2 tokenizers are trained on (their vocabularies come from it).
_CORPUS = [
    "a photo of a cat sitting on a red chair", "a red panda in a teacup",
    "the quick brown fox jumps over the lazy dog", "an astronaut riding a horse on the moon",
    "two dogs playing in the snow at sunset, digital art", "a bowl of fruit on a wooden table",
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background", "a watercolor painting of a lighthouse",
]


# ---- tokenizers ---------------------------------------------------------------------------
def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))


def write_clip_tokenizer(out: Path) -> int:
    """CLIP's real BPE (49,408 tokens) from open_clip's bundled merges; returns the vocab size."""
    import open_clip
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    bpe = os.path.join(os.path.dirname(open_clip.__file__), "bpe_simple_vocab_16e6.txt.gz")
    merges = gzip.open(bpe).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]
    byte_chars = list(bytes_to_unicode().values())
    vocab = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps({tok: i for i, tok in enumerate(vocab)}))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    return len(vocab)


def write_t5_tokenizer(out: Path) -> int:
    """A T5-style Unigram tokenizer (<pad>=0, </s>=1, <unk>=2) trained on _CORPUS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(_CORPUS, trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "T5Tokenizer", "extra_ids": 0, "model_max_length": 512,
        "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"})
    return tok.get_vocab_size()


def write_qwen2_tokenizer(out: Path) -> int:
    """A Qwen2-style byte-level BPE with the chat-template special tokens, trained on _CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(out))  # vocab.json + merges.txt, loaded by Qwen2Tokenizer
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 32768, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok.get_vocab_size()


# ---- text encoders ------------------------------------------------------------------------
def _clip_text(cls, vocab: int, hidden: int, projection: int | None = None):
    from transformers import CLIPTextConfig

    cfg = CLIPTextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                         projection_dim=projection or hidden, bos_token_id=vocab - 2,
                         eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    return cls(cfg)


def _t5_encoder(vocab: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab, d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model,
                                   num_layers=1, num_heads=2, relative_attention_num_buckets=8,
                                   relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0))


def _kl_vae(scaling: float, shift: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                         layers_per_block=1, norm_num_groups=4, scaling_factor=scaling,
                         shift_factor=shift, use_quant_conv=False, use_post_quant_conv=False)


# ---- families -----------------------------------------------------------------------------
def _build_qwen_image(out: Path) -> None:
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok_dir = out / "_qwen_src"
    vocab = write_qwen2_tokenizer(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    hidden = 32
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=hidden, fullatt_block_indexes=[0]),
    ))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                 temperal_downsample=[False], latents_mean=[-0.7, 0.1, 0.4, -0.2],
                                 latents_std=[2.8, 1.4, 2.3, 1.9])
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=hidden, axes_dims_rope=(4, 6, 6))
    # Qwen-Image's scheduler settings: exponential resolution-dependent shift and terminal stretch.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      transformer=transformer).save_pretrained(out)


def _build_sd3(out: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import AutoTokenizer, CLIPTextModelWithProjection

    clip_vocab = write_clip_tokenizer(out / "_clip_src")
    t5_vocab = write_t5_tokenizer(out / "_t5_src")
    clip_l = _clip_text(CLIPTextModelWithProjection, clip_vocab, hidden=16, projection=16)
    clip_g = _clip_text(CLIPTextModelWithProjection, clip_vocab, hidden=24, projection=24)
    # SD3 zero-pads the concatenated CLIP-L/G states (16 + 24) to the T5 width, and projects the
    # concatenated pooled outputs (16 + 24): joint 48, pooled 40.
    t5 = _t5_encoder(t5_vocab, d_model=48)
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=48,
                                        caption_projection_dim=16, pooled_projection_dim=40, out_channels=4,
                                        pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    clip_tok = AutoTokenizer.from_pretrained(out / "_clip_src")
    StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=_kl_vae(1.5305, 0.0609),
        text_encoder=clip_l, tokenizer=clip_tok, text_encoder_2=clip_g, tokenizer_2=clip_tok,
        text_encoder_3=t5, tokenizer_3=AutoTokenizer.from_pretrained(out / "_t5_src"),
    ).save_pretrained(out)


def _build_flux(out: Path, guidance_embeds: bool = True) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextModel

    clip_vocab = write_clip_tokenizer(out / "_clip_src")
    t5_vocab = write_t5_tokenizer(out / "_t5_src")
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=16, guidance_embeds=guidance_embeds,
                                         axes_dims_rope=(4, 6, 6))
    # FLUX.1's scheduler: shift 3 and a linear resolution-dependent mu.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    FluxPipeline(
        scheduler=scheduler, vae=_kl_vae(0.3611, 0.1159),
        text_encoder=_clip_text(CLIPTextModel, clip_vocab, hidden=16),
        tokenizer=AutoTokenizer.from_pretrained(out / "_clip_src"),
        text_encoder_2=_t5_encoder(t5_vocab, d_model=32),
        tokenizer_2=AutoTokenizer.from_pretrained(out / "_t5_src"), transformer=transformer,
    ).save_pretrained(out)


_BUILDERS = {"qwen_image": _build_qwen_image, "sd3": _build_sd3, "flux": _build_flux}


# Qwen2.5-VL's vision markers, in the tiny tokenizer of the editing families (the processor
# expands <|image_pad|> to one token per merged image patch; the text encoder finds them by id)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _tiny_qwen_vl(vocab: int, hidden: int, token_ids: dict[str, int]):
    """A Qwen2.5-VL with a one-block vision tower whose patching matches the tiny processor's."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]},
                         bos_token_id=None, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=hidden, fullatt_block_indexes=[0], patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56),
        image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
    ))


def _build_qwen_image_edit(out: Path, pipeline_name: str = "QwenImageEditPipeline") -> None:
    """Qwen-Image-Edit(-Plus): Qwen-Image's tiny parts plus what editing adds, a Qwen2-VL
    processor (the tokenizer with the vision markers and a Qwen2-VL image processor bounded to
    a few patches) and a text encoder whose vision tower reads what it produces."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import (AutoTokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)

    tok_dir = out / "_qwen_src"
    write_qwen2_tokenizer(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    hidden = 32
    text_encoder = _tiny_qwen_vl(len(tokenizer), hidden, ids)
    image_processor = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2,
                                            min_pixels=56 * 56, max_pixels=112 * 112)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=Qwen2VLVideoProcessor())
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                 temperal_downsample=[False], latents_mean=[-0.7, 0.1, 0.4, -0.2],
                                 latents_std=[2.8, 1.4, 2.3, 1.9])
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=hidden, axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    getattr(diffusers, pipeline_name)(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        processor=processor, transformer=transformer).save_pretrained(out)


def _build_qwen_image_edit_plus(out: Path) -> None:
    _build_qwen_image_edit(out, "QwenImageEditPlusPipeline")


_BUILDERS.update({"qwen_image_edit": _build_qwen_image_edit,
                  "qwen_image_edit_plus": _build_qwen_image_edit_plus})


def build_tiny_model_dir(family: str, root: Path | str, *, seed: int = 0) -> Path:
    """Build, save and return ``root/<family>``: a tiny random model of ``family``.

    Weights are drawn under ``torch.manual_seed(seed)`` (the global RNG is restored after).
    """
    if family not in _BUILDERS:
        raise ValueError(f"unknown family {family!r}; tiny models exist for {FAMILIES + EDIT_FAMILIES}")
    out = Path(root) / family
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _BUILDERS[family](out)
    for scratch in out.glob("_*_src"):  # tokenizer sources; save_pretrained wrote the real ones
        shutil.rmtree(scratch)
    return out
