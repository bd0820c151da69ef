"""The tiny toy model: its parts built from config, and the diffusers-style directory they live in.

Layout written by ``save_model_dir`` (and read back only through ``from_pretrained``)::

    model_index.json      component -> [library, class], as diffusers pipelines list them
    toy_config.json       resolution, prompt length, how the weights were made
    transformer/          diffusers SD3Transformer2DModel, pixel space (in/out channels = 3)
    text_encoder/         transformers CLIPTextModel (tiny, causal, EOS-pooled)
    tokenizer/            transformers PreTrainedTokenizerFast over the world's words
    scheduler/            diffusers FlowMatchEulerDiscreteScheduler (shift 1, the default schedule)

Pixel space, no VAE: the latent *is* the image in [-1, 1] ([3, H, W]) and the transformer's
own 4x4 patch embedding does the patchifying. A VAE would shorten the token sequence as a
larger patch does, at the price of a second model to pretrain and a lossy decode that the
reward would see; for flat colour blobs on black that was not worth trying (not measured).
``model_index.json`` names a class diffusers does not have (``ToyPixelFlowPipeline``): the
directory is a bag of diffusers/transformers parts that ToyAdapter loads one by one, not a
pipeline that DiffusionPipeline.from_pretrained should try to assemble.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

from trainer.toy import world

PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
# EOS must not be id 2: CLIPTextModel treats eos_token_id == 2 as a legacy config and pools
# at the argmax token id instead of at the first EOS.
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)
MAX_PROMPT_TOKENS = 12     # longest prompt: 8 words + BOS + EOS

# Patch 4 x width 96 x 4 blocks (1.3 M params, 64 tokens) is the size that pretrains within the
# budget and leaves RL rollouts cheap on a CPU; the step times of the sizes compared are in
# bench/reports/2026-12-04_cpu-h200_comment-figures.md.
DEFAULT_TRANSFORMER: dict[str, Any] = dict(
    sample_size=32, patch_size=4, in_channels=3, out_channels=3, num_layers=4,
    attention_head_dim=32, num_attention_heads=3, pos_embed_max_size=8,
)
DEFAULT_TEXT_ENCODER: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over ``world.vocabulary()``: lower-cased, whitespace-split,
    [BOS] ... [EOS], unknown words -> [UNK]; pads to MAX_PROMPT_TOKENS on the right."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in world.vocabulary():
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        model_max_length=MAX_PROMPT_TOKENS, padding_side="right")


def build_text_encoder(tokenizer: PreTrainedTokenizerFast, **overrides: Any) -> CLIPTextModel:
    cfg = dict(DEFAULT_TEXT_ENCODER, **overrides)
    config = CLIPTextConfig(
        vocab_size=len(tokenizer), max_position_embeddings=MAX_PROMPT_TOKENS,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, projection_dim=cfg["hidden_size"], **cfg)
    return CLIPTextModel(config)


def build_transformer(text_hidden: int, **overrides: Any) -> SD3Transformer2DModel:
    """SD3 joint-attention transformer in pixel space; caption projection width = model width
    (SD3 requires it), pooled projection = the text encoder's width."""
    cfg = dict(DEFAULT_TRANSFORMER, **overrides)
    inner = cfg["attention_head_dim"] * cfg["num_attention_heads"]
    return SD3Transformer2DModel(joint_attention_dim=text_hidden, caption_projection_dim=inner,
                                 pooled_projection_dim=text_hidden, **cfg)


def build_scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)


def save_model_dir(out: str | Path, *, transformer: SD3Transformer2DModel,
                   text_encoder: CLIPTextModel, tokenizer: PreTrainedTokenizerFast,
                   resolution: int, info: dict[str, Any] | None = None) -> Path:
    """Write the diffusers-style directory (safetensors weights) and return its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)
    tokenizer.save_pretrained(out / "tokenizer")
    # transformers 5 writes its own class name ("TokenizersBackend"), which transformers 4
    # cannot resolve; PreTrainedTokenizerFast loads the same tokenizer.json under both.
    tok_cfg_path = out / "tokenizer" / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    build_scheduler().save_pretrained(out / "scheduler")
    index = {
        "_class_name": "ToyPixelFlowPipeline",
        "_note": "parts loaded one by one by trainer.toy.adapter.ToyAdapter",
        "transformer": ["diffusers", type(transformer).__name__],
        "text_encoder": ["transformers", type(text_encoder).__name__],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    toy = {"resolution": resolution, "max_prompt_tokens": MAX_PROMPT_TOKENS,
           "latent_space": "pixel", "info": info or {}}
    (out / "toy_config.json").write_text(json.dumps(toy, indent=2) + "\n")
    return out


def build_untrained(seed: int = 0, *, transformer: dict[str, Any] | None = None,
                    text_encoder: dict[str, Any] | None = None):
    """(transformer, text_encoder, tokenizer) with seeded random init."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    te = build_text_encoder(tokenizer, **(text_encoder or {}))
    tr = build_transformer(te.config.hidden_size, **(transformer or {}))
    return tr, te, tokenizer


def load_parts(model_dir: str | Path):
    """(transformer, text_encoder, tokenizer) of a saved toy model directory, trainable fp32."""
    model_dir = Path(model_dir)
    transformer = SD3Transformer2DModel.from_pretrained(model_dir / "transformer",
                                                        torch_dtype=torch.float32)
    text_encoder = CLIPTextModel.from_pretrained(model_dir / "text_encoder",
                                                 torch_dtype=torch.float32)
    return transformer.train(), text_encoder.train(), build_tokenizer()
