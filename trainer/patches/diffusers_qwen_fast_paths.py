"""Faster paths inside diffusers' Qwen-Image transformer, computing the same values.

diffusers' transformer looks these functions up in its module at each call, so
``install_fast_paths`` swaps them in place (and ``install_fast_paths(False)`` puts diffusers'
own back: the bench's peer row runs stock diffusers). Loading a Qwen-Image transformer
through the adapter installs them, in the actor and in the engine alike, so both run the same
kernels and their log-probs stay comparable.

- ``text_seq_len_from_mask`` replaces ``compute_text_seq_len_from_mask``: the fallback length
  there is a scalar built on the host and copied to the device, a copy that makes the host
  wait for the GPU at the start of every forward given a mask (diffusers' pipeline passes no
  mask when it is all ones and never meets it; the engine and the replay always pass one).
  A Python scalar in ``torch.where`` needs no copy.
- The rotary embedding in real arithmetic. diffusers builds the RoPE frequencies as complex
  numbers and rotates q and k with a complex multiply; TorchInductor generates no code for
  complex operators, so inside every compiled block the four rotations ran as separate eager
  kernels (to complex64, multiply, back) around the fused ones, forward and backward. Here
  the position-embedding module (outside the compiled blocks) hands out each frequency as a
  (cos, sin) pair, and the rotation computes the complex product's own formula,
  (x_r cos - x_i sin, x_r sin + x_i cos), in float32 as diffusers does: the same values
  (tested bit-equal eagerly), and code Inductor fuses with the q/k norm around it.
"""
from __future__ import annotations

import dataclasses

import torch

_STOCK = "_stock_fast_path_originals"


def text_seq_len_from_mask(encoder_hidden_states: torch.Tensor,
                           encoder_hidden_states_mask: torch.Tensor | None):
    """diffusers' ``compute_text_seq_len_from_mask``, the same values without its host copy."""
    batch_size, text_seq_len = encoder_hidden_states.shape[:2]
    if encoder_hidden_states_mask is None:
        return text_seq_len, None, None
    if encoder_hidden_states_mask.shape[:2] != (batch_size, text_seq_len):
        raise ValueError(f"encoder_hidden_states_mask shape {encoder_hidden_states_mask.shape} "
                         f"must match (batch_size, text_seq_len)=({batch_size}, {text_seq_len})")
    mask = encoder_hidden_states_mask.to(torch.bool)
    positions = torch.arange(text_seq_len, device=encoder_hidden_states.device)
    last = torch.where(mask, positions, 0).max(dim=1).values + 1
    return text_seq_len, torch.where(mask.any(dim=1), last, text_seq_len), mask


def rotate_real(x: torch.Tensor, freqs: torch.Tensor, use_real: bool = True,
                use_real_unbind_dim: int = -1) -> torch.Tensor:
    """``apply_rotary_emb_qwen`` for the complex convention (``use_real=False``) without
    complex tensors: ``x`` [B, S, H, D] holds (real, imaginary) pairs along D; ``freqs`` is
    [S, D/2] complex or its [S, D/2, 2] (cos, sin) view. The real convention goes to diffusers'."""
    if use_real:
        stock = getattr(_module(), _STOCK)["apply_rotary_emb_qwen"]
        return stock(x, freqs, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim)
    pairs = torch.view_as_real(freqs) if freqs.is_complex() else freqs
    cos, sin = pairs[..., 0].unsqueeze(1), pairs[..., 1].unsqueeze(1)  # [S, 1, D/2]
    xr, xi = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((xr * cos - xi * sin, xr * sin + xi * cos), dim=-1)
    return rotated.flatten(3).type_as(x)


def _real_pair_rope_forward(self, *args, **kwargs):
    """``QwenEmbedRope.forward`` handing out its frequencies as (cos, sin) pairs: the view
    is taken here, in eager code, so no complex tensor enters a compiled block."""
    stock = getattr(_module(), _STOCK)["QwenEmbedRope.forward"]
    return tuple(torch.view_as_real(f) if f.is_complex() else f
                 for f in stock(self, *args, **kwargs))


def _module():
    from diffusers.models.transformers import transformer_qwenimage

    return transformer_qwenimage


def _patch_points(module) -> dict:
    """name -> (owner, attribute, replacement); diffusers releases before the text-length
    function have nothing to replace there."""
    points = {"apply_rotary_emb_qwen": (module, "apply_rotary_emb_qwen", rotate_real),
              "QwenEmbedRope.forward": (module.QwenEmbedRope, "forward",
                                        _real_pair_rope_forward)}
    if hasattr(module, "compute_text_seq_len_from_mask"):
        points["compute_text_seq_len_from_mask"] = (module, "compute_text_seq_len_from_mask",
                                                    text_seq_len_from_mask)
    return points


def install_fast_paths(install: bool = True) -> None:
    """Point diffusers' Qwen-Image transformer at the fast paths (``install=False``: at
    diffusers' own). Both rotary halves change together: a stock rotation given (cos, sin)
    pairs would be wrong, so they are never installed apart. diffusers' context-parallel plan
    for the position embedding expects its complex [S, D/2] output: sequence parallelism takes
    its plan through ``context_parallel_plan``, which follows what is installed."""
    module = _module()
    points = _patch_points(module)
    if not hasattr(module, _STOCK):
        setattr(module, _STOCK, {name: getattr(owner, attr)
                                 for name, (owner, attr, _) in points.items()})
    stock = getattr(module, _STOCK)
    for name, (owner, attr, fast) in points.items():
        setattr(owner, attr, fast if install else stock[name])


def context_parallel_plan(plan: dict) -> dict:
    """diffusers' context-parallel plan for the Qwen-Image transformer, with the position
    embedding's outputs split as the installed rotary hands them out: while the fast paths are
    installed they are [S, D/2, 2] real pairs, not complex [S, D/2], and diffusers leaves an
    input of another rank than the plan's unsplit (which breaks the rotation)."""
    if _module().QwenEmbedRope.forward is not _real_pair_rope_forward:
        return plan
    pairs = {index: dataclasses.replace(split, expected_dims=split.expected_dims + 1)
             for index, split in plan["pos_embed"].items()}
    return {**plan, "pos_embed": pairs}
