"""Forward FLOPs of the MMDiT and Wan transformers, from their diffusers config alone.

Counted: every matrix multiply at 2 * in * out per token (linear layers, the patch-embedding
convolution as the linear it is), and attention's Q K^T and A V at 2 * L * L * inner each per
sample over the joint text + image sequence L. Not counted (as torch's FlopCounterMode, which
the tests compare against, does not count them): elementwise work (norms, modulation, GELU,
softmax, rotary embeddings, residual adds), biases and the sinusoidal timestep features. These
are O(L * inner) per block against the O(L * inner^2) of the matmuls: well under 1 % at the
published widths.

Counted by the diffusers class the adapter names (``transformer_class``), so the toy model
(an SD3Transformer2DModel) shares SD3's count. Per-sample terms (timestep / pooled-text
embeddings, every block's adaLN modulation) are counted once per sample, as the models apply
them to one vector per sample.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one transformer forward over ``batch`` samples: matmuls of the linear layers
    and the attention products, separately (their sum is ``total``)."""

    linear: int
    attention: int

    @property
    def total(self) -> int:
        return self.linear + self.attention


def _lin(n_in: int, n_out: int) -> int:
    return 2 * n_in * n_out


def _ff(dim: int) -> int:
    """diffusers' FeedForward(dim, dim_out=dim), mult 4, per token."""
    return _lin(dim, 4 * dim) + _lin(4 * dim, dim)


def _attention(tokens: int, inner: int) -> int:
    """Q K^T and A V over ``tokens`` queries and keys, per sample."""
    return 2 * (2 * tokens * tokens * inner)


def _inner(cfg: Mapping[str, Any]) -> int:
    return int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])


def qwen_image(cfg: Mapping[str, Any], image_tokens: int, text_tokens: int) -> FlopCount:
    """QwenImageTransformer2DModel, per sample: dual-stream blocks (separate image / text
    projections, MLPs and adaLN modulations, one joint attention)."""
    if cfg.get("zero_cond_t"):
        raise ValueError("zero_cond_t (two timesteps per sample) is not counted")
    d, layers, p = _inner(cfg), int(cfg["num_layers"]), int(cfg["patch_size"])
    out = int(cfg.get("out_channels") or cfg["in_channels"])
    per_sample = _lin(256, d) + _lin(d, d) + layers * 2 * _lin(d, 6 * d) + _lin(d, 2 * d)
    stream = layers * (4 * _lin(d, d) + _ff(d))
    image = _lin(int(cfg["in_channels"]), d) + stream + _lin(d, p * p * out)
    text = _lin(int(cfg["joint_attention_dim"]), d) + stream
    linear = per_sample + image * image_tokens + text * text_tokens
    return FlopCount(linear, layers * _attention(image_tokens + text_tokens, d))


def sd3(cfg: Mapping[str, Any], image_tokens: int, text_tokens: int) -> FlopCount:
    """SD3Transformer2DModel, per sample: joint blocks; the last is context_pre_only (no text
    output projection, no text MLP, a 2-way text modulation); ``dual_attention_layers`` add an
    image-only attention (9-way modulation)."""
    d, layers, p = _inner(cfg), int(cfg["num_layers"]), int(cfg["patch_size"])
    dual = {int(i) for i in cfg.get("dual_attention_layers") or ()}
    out = int(cfg.get("out_channels") or cfg["in_channels"])
    per_sample = (_lin(256, d) + _lin(d, d) + _lin(int(cfg["pooled_projection_dim"]), d)
                  + _lin(d, d) + _lin(d, 2 * d))
    image = _lin(int(cfg["in_channels"]) * p * p, d) + _lin(d, p * p * out)
    text = _lin(int(cfg["joint_attention_dim"]), int(cfg["caption_projection_dim"]))
    attention = 0
    for i in range(layers):
        pre_only = i == layers - 1
        per_sample += _lin(d, (9 if i in dual else 6) * d) + _lin(d, (2 if pre_only else 6) * d)
        image += 4 * _lin(d, d) + _ff(d) + (4 * _lin(d, d) if i in dual else 0)
        text += 3 * _lin(d, d) + (0 if pre_only else _lin(d, d) + _ff(d))
        attention += _attention(image_tokens + text_tokens, d)
        if i in dual:
            attention += _attention(image_tokens, d)
    return FlopCount(per_sample + image * image_tokens + text * text_tokens, attention)


def flux(cfg: Mapping[str, Any], image_tokens: int, text_tokens: int) -> FlopCount:
    """FluxTransformer2DModel, per sample: dual-stream blocks, then single-stream blocks over
    the joint sequence (fused q, k, v + MLP input, one output projection of [attn, mlp])."""
    d, p = _inner(cfg), int(cfg["patch_size"])
    double, single = int(cfg["num_layers"]), int(cfg["num_single_layers"])
    out = int(cfg.get("out_channels") or cfg["in_channels"])
    embed = 2 if cfg.get("guidance_embeds") else 1  # timestep (+ guidance) embedders
    per_sample = (embed * (_lin(256, d) + _lin(d, d)) + _lin(int(cfg["pooled_projection_dim"]), d)
                  + _lin(d, d) + double * 2 * _lin(d, 6 * d) + single * _lin(d, 3 * d)
                  + _lin(d, 2 * d))
    stream = double * (4 * _lin(d, d) + _ff(d))
    image = _lin(int(cfg["in_channels"]), d) + stream + _lin(d, p * p * out)
    text = _lin(int(cfg["joint_attention_dim"]), d) + stream
    joint = single * (3 * _lin(d, d) + _lin(d, 4 * d) + _lin(5 * d, d))
    tokens = image_tokens + text_tokens
    linear = per_sample + image * image_tokens + text * text_tokens + joint * tokens
    return FlopCount(linear, (double + single) * _attention(tokens, d))


def wan(cfg: Mapping[str, Any], image_tokens: int, text_tokens: int) -> FlopCount:
    """WanTransformer3DModel, per sample, ``image_tokens`` the video tokens: blocks of
    self-attention over the video tokens, cross-attention from them to the text tokens (k and v
    projected from the text once per block) and an MLP of width ``ffn_dim``; the text passes a
    two-layer projection once. Text-to-video only (no image embedder)."""
    if cfg.get("image_dim") is not None or cfg.get("added_kv_proj_dim") is not None:
        raise ValueError("Wan's image-conditioned branch (image_dim, added_kv_proj_dim) is not counted")
    d, layers, ffn = _inner(cfg), int(cfg["num_layers"]), int(cfg["ffn_dim"])
    patch = 1
    for p in cfg["patch_size"]:
        patch *= int(p)
    out = int(cfg.get("out_channels") or cfg["in_channels"])
    per_sample = _lin(int(cfg["freq_dim"]), d) + _lin(d, d) + _lin(d, 6 * d)
    video = (_lin(int(cfg["in_channels"]) * patch, d) + layers * (6 * _lin(d, d) + _lin(d, ffn) + _lin(ffn, d))
             + _lin(d, patch * out))
    text = _lin(int(cfg["text_dim"]), d) + _lin(d, d) + layers * 2 * _lin(d, d)
    attention = layers * (_attention(image_tokens, d) + 2 * (2 * image_tokens * text_tokens * d))
    return FlopCount(per_sample + video * image_tokens + text * text_tokens, attention)


#: diffusers transformer class -> its per-sample count.
COUNTERS: dict[str, Callable[[Mapping[str, Any], int, int], FlopCount]] = {
    "QwenImageTransformer2DModel": qwen_image,
    "SD3Transformer2DModel": sd3,
    "FluxTransformer2DModel": flux,
    "WanTransformer3DModel": wan,
}


def transformer_forward(transformer_class: str, cfg: Mapping[str, Any], *, image_tokens: int,
                        text_tokens: int, batch: int = 1) -> FlopCount:
    """FLOPs of one forward of ``batch`` samples; ValueError for a class not counted here."""
    counter = COUNTERS.get(transformer_class)
    if counter is None:
        raise ValueError(f"no FLOP count for {transformer_class!r} (counted: {sorted(COUNTERS)})")
    one = counter(cfg, int(image_tokens), int(text_tokens))
    return FlopCount(one.linear * batch, one.attention * batch)
