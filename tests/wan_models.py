"""Tiny random-weight Wan 2.1 / 2.2 text-to-video models in diffusers' on-disk layout (CPU tests).

    build_tiny_wan_dir(variant, root) -> Path     variant in WAN_VARIANTS

writes ``root/<variant>/`` as ``WanPipeline.save_pretrained`` lays out the published
``Wan-AI/Wan2.1-T2V-*-Diffusers`` and ``Wan-AI/Wan2.2-T2V-A14B-Diffusers`` checkpoints
(model_index.json, transformer/ [+ transformer_2/], vae/, text_encoder/ (UMT5), tokenizer/,
scheduler/), so tests load it through the real from_pretrained path.

What is kept real: the VAE's structure (causal 3-D convolutions, x8 spatial and x4 temporal
compression, per-channel latent statistics), the transformer's (1, 2, 2) patches and 3-D
rotary split, the text width chain UMT5 -> transformer, the published scheduler
(UniPC with flow sigmas and ``flow_shift`` 3.0), and for 2.2 the second, low-noise transformer
with its ``boundary_ratio``. Everything else is as small as the classes accept.
``TINY_VIDEO`` (height, width, frames) is a valid small geometry: 32 x 32 pixels, 5 frames ->
a [4, 2, 4, 4] latent.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tiny_models import _CORPUS

WAN_VARIANTS = ("wan2.1", "wan2.2")
TINY_VIDEO = (32, 32, 5)  # height, width, frames
#: Wan 2.2 A14B's published boundary: the high-noise transformer takes t >= 0.875 * 1000.
WAN22_BOUNDARY = 0.875
TEXT_DIM = 16
LATENT_CHANNELS = 4


def tiny_wan_transformer(seed: int = 0):
    from diffusers import WanTransformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # attention_head_dim 12 splits into the rotary (t, h, w) = (4, 4, 4) as the real 128 does
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                     in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
                                     text_dim=TEXT_DIM, freq_dim=32, ffn_dim=48, num_layers=2,
                                     cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                     rope_max_seq_len=64)


def tiny_wan_vae():
    from diffusers import AutoencoderKLWan

    # four levels: x8 spatial; temporal downsampling in the last two: x4, as the published VAE.
    # Width 16, not the narrowest: a narrower random decoder barely lets the latents move the
    # pixels, and the learning test needs videos that differ within a group
    return AutoencoderKLWan(base_dim=16, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True],
                            latents_mean=[-0.76, -0.71, -0.91, 0.11], latents_std=[2.82, 1.45, 2.33, 2.66],
                            scale_factor_temporal=4, scale_factor_spatial=8)


def write_umt5_tokenizer(out: Path) -> int:
    """A T5-style Unigram tokenizer (<pad>=0, </s>=1, <unk>=2) over the corpus' words and
    characters, its pieces and scores fixed (``tokenizers``' Unigram trainer is not
    deterministic across runs, and a test that trains must see the same token ids each run)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = sorted({w.strip(",.") for line in _CORPUS for w in line.lower().split()} - {""})
    chars = sorted({c for line in _CORPUS for c in line.lower()} - {" "})
    pieces = ["<pad>", "</s>", "<unk>", "\u2581"] + ["\u2581" + w for w in words] + chars
    tok = Tokenizer(models.Unigram([(p, -float(i)) for i, p in enumerate(pieces)], unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "T5Tokenizer", "extra_ids": 0, "model_max_length": 512,
        "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    return tok.get_vocab_size()


def _umt5(vocab: int):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=vocab, d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1,
                                       num_heads=2, relative_attention_num_buckets=8,
                                       relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
                                       decoder_start_token_id=0))


def build_tiny_wan_dir(variant: str, root: Path | str, *, seed: int = 0,
                       boundary_ratio: float = WAN22_BOUNDARY) -> Path:
    """Build, save and return ``root/<variant>``: a tiny random Wan ``variant`` model
    (``boundary_ratio``: Wan 2.2's expert boundary, the published one unless a test moves it)."""
    from diffusers import UniPCMultistepScheduler, WanPipeline
    from transformers import AutoTokenizer

    if variant not in WAN_VARIANTS:
        raise ValueError(f"unknown Wan variant {variant!r}; tiny models exist for {WAN_VARIANTS}")
    out = Path(root) / variant
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vocab = write_umt5_tokenizer(out / "_t5_src")
        two = variant == "wan2.2"
        # the published Wan schedulers: UniPC on flow sigmas, shift 3.0 (480p)
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            flow_shift=3.0, num_train_timesteps=1000)
        WanPipeline(tokenizer=AutoTokenizer.from_pretrained(out / "_t5_src"), text_encoder=_umt5(vocab),
                    vae=tiny_wan_vae(), scheduler=scheduler, transformer=tiny_wan_transformer(seed),
                    transformer_2=tiny_wan_transformer(seed + 1) if two else None,
                    boundary_ratio=boundary_ratio if two else None).save_pretrained(out)
    shutil.rmtree(out / "_t5_src")
    return out
