"""Tiny random-weight Wan 2.1 / 2.2 image-to-video models in diffusers' on-disk layout (CPU tests).

    build_tiny_wan_i2v_dir(variant, root) -> Path     variant in WAN_I2V_VARIANTS

writes ``root/<variant>/`` as ``WanImageToVideoPipeline.save_pretrained`` lays out the published
``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers`` and ``Wan-AI/Wan2.2-I2V-A14B-Diffusers`` checkpoints
(model_index.json, transformer/ [+ transformer_2/], vae/, text_encoder/ (UMT5), tokenizer/,
scheduler/, and for 2.1 image_encoder/ (CLIP vision) and image_processor/), so tests load it
through the real from_pretrained path.

What is kept real, besides what tests/wan_models.py keeps for text-to-video: the transformer's
input channels, latents + the first-frame mask (one channel per frame of the VAE's x4 temporal
step) + the condition's latents (4 + 4 + 4 = 12, as 16 + 4 + 16 = 36 published); for 2.1 the
CLIP vision tower whose second-to-last hidden states the transformer's ``image_dim`` embedder
takes, and the image cross-attention (``added_kv_proj_dim`` = the inner width, as published);
for 2.2 no image encoder, two experts and a ``boundary_ratio``. The CLIP processor crops 32
pixels (the published one 224) so the tower stays small.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from wan_models import LATENT_CHANNELS, TEXT_DIM, _umt5, tiny_wan_vae, write_umt5_tokenizer

WAN_I2V_VARIANTS = ("wan2.1-i2v", "wan2.2-i2v")
#: Wan 2.2 I2V-A14B's published boundary: the high-noise transformer takes t >= 0.9 * 1000.
WAN22_I2V_BOUNDARY = 0.9
IMAGE_DIM = 8                 # the CLIP tower's hidden width (1280 for the published ViT-H/14)
MASK_CHANNELS = 4             # the VAE's temporal factor: the mask has one channel per frame of a latent frame


def tiny_wan_i2v_transformer(seed: int = 0, *, image_conditioned: bool = True):
    """A WanTransformer3DModel taking [latents; mask; condition latents], with (2.1) or without
    (2.2) the CLIP image embedder and image cross-attention."""
    from diffusers import WanTransformer3DModel

    heads, head_dim = 2, 12
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
            in_channels=2 * LATENT_CHANNELS + MASK_CHANNELS, out_channels=LATENT_CHANNELS,
            text_dim=TEXT_DIM, freq_dim=32, ffn_dim=48, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
            image_dim=IMAGE_DIM if image_conditioned else None,
            added_kv_proj_dim=heads * head_dim if image_conditioned else None)


def tiny_clip_vision(image_size: int = 32):
    """(CLIPVisionModel, CLIPImageProcessor): 2 layers, so that the pipeline's
    ``hidden_states[-2]`` is a layer's output, as in the published 32-layer tower; 8-pixel
    patches, so ``image_size`` 128 gives the published tower's 257 tokens (which SGLang's
    native Wan DiT assumes)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    model = CLIPVisionModel(CLIPVisionConfig(hidden_size=IMAGE_DIM, intermediate_size=16, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=image_size, patch_size=8,
                                             projection_dim=IMAGE_DIM))
    return model, CLIPImageProcessor(size={"shortest_edge": image_size},
                                     crop_size={"height": image_size, "width": image_size})


def build_tiny_wan_i2v_dir(variant: str, root: Path | str, *, seed: int = 0,
                           boundary_ratio: float = WAN22_I2V_BOUNDARY, clip_image_size: int = 32) -> Path:
    """Build, save and return ``root/<variant>``: a tiny random Wan image-to-video ``variant``
    (``boundary_ratio``: Wan 2.2's expert boundary, the published one unless a test moves it;
    ``clip_image_size``: Wan 2.1's CLIP input side, ``tiny_clip_vision``)."""
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline
    from transformers import AutoTokenizer

    if variant not in WAN_I2V_VARIANTS:
        raise ValueError(f"unknown Wan I2V variant {variant!r}; tiny models exist for {WAN_I2V_VARIANTS}")
    out = Path(root) / variant
    out.mkdir(parents=True, exist_ok=True)
    two = variant == "wan2.2-i2v"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vocab = write_umt5_tokenizer(out / "_t5_src")
        image_encoder, image_processor = (None, None) if two else tiny_clip_vision(clip_image_size)
        # the published I2V schedulers: UniPC on flow sigmas (480p: shift 3.0 for 2.1, 5.0 for 2.2)
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            flow_shift=5.0 if two else 3.0, num_train_timesteps=1000)
        WanImageToVideoPipeline(
            tokenizer=AutoTokenizer.from_pretrained(out / "_t5_src"), text_encoder=_umt5(vocab),
            vae=tiny_wan_vae(), scheduler=scheduler, image_processor=image_processor,
            image_encoder=image_encoder,
            transformer=tiny_wan_i2v_transformer(seed, image_conditioned=not two),
            transformer_2=tiny_wan_i2v_transformer(seed + 1, image_conditioned=False) if two else None,
            boundary_ratio=boundary_ratio if two else None).save_pretrained(out)
    shutil.rmtree(out / "_t5_src")
    return out
