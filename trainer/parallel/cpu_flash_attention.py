"""An attention backend for diffusers' dispatcher that runs on the CPU and returns the
log-sum-exp, so that diffusers' ring attention can run (and be tested) without an accelerator.

diffusers' ring attention (``TemplatedRingAttention``) computes attention against one
key/value chunk at a time and merges the partial results through each chunk's log-sum-exp;
its backward recomputes every chunk's gradient from the merged output and log-sum-exp. It
reaches a backend only through that backend's forward/backward op pair. diffusers' only CPU
backend (``native``, torch SDPA) has no log-sum-exp; torch's CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``) has both. This
module is that op pair and the backend that hands it to diffusers' templated context-parallel
attention; the ring itself (chunk rotation, merge, gradient accumulation) is diffusers' code.

Layouts: diffusers passes query/key/value as (batch, tokens, heads, head_dim) and expects the
log-sum-exp as (batch, tokens, heads); torch's kernel works in (batch, heads, tokens, ...).

Masks: diffusers' ring hands every chunk's op call the mask of this rank's own keys and its
backward passes no mask at all, which is right only for a mask that masks nothing. Qwen-Image
masks its padded text tokens, so the op gathers the ring's masks once (first forward call) and
gives each call the mask of the chunk it attends to. It relies on diffusers' ring order,
which visits the chunks of ranks r, r+1, ... (mod the ring degree) in forward and backward
alike; the two-rank tests against one rank with a padded prompt check that order. A masked
key gets the most negative finite score, not -inf: a chunk whose keys are all masked for some
query then has a finite log-sum-exp, and the ring merge gives it weight zero instead of
spreading a NaN.

diffusers names backends by members of its ``AttentionBackendName`` enum, which has no way to
add one, so ``register()`` adds the member to the enum's tables; it checks first that
diffusers is a version this was written against (0.42) and that its templated attention still
takes a forward/backward op pair, and refuses otherwise.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from diffusers.models import attention_dispatch as dispatch

#: the backend's name in diffusers' dispatcher (``processor._attention_backend``)
NAME = "flowgrpo_cpu_flash"
_MEMBER = "FLOWGRPO_CPU_FLASH"
#: diffusers versions (major.minor) whose ring and dispatcher this was written against
WRITTEN_FOR = ("0.42",)

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous()


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean keep-mask as the additive float mask the kernel takes (it refuses booleans);
    a float mask as it is, in the query's dtype."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def _ring(parallel_config) -> tuple[int, int] | None:
    """(rank in the ring, ring degree) under diffusers' ring alone; None otherwise."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or cp.ring_degree == 1:
        return None
    if cp.ulysses_degree > 1:
        raise ValueError(f"the {NAME} attention backend runs ring or Ulysses attention, not "
                         f"both (ring {cp.ring_degree} x ulysses {cp.ulysses_degree})")
    return cp._ring_local_rank, cp.ring_degree


def _gather_ring_masks(mask: torch.Tensor, key: torch.Tensor, parallel_config) -> list:
    """Every ring rank's key mask, in ring-rank order (a collective over the ring group)."""
    if mask.shape[-1] != key.shape[1]:
        raise ValueError(f"ring attention with a mask needs each rank's mask over its own "
                         f"{key.shape[1]} keys; got a mask of shape {tuple(mask.shape)}")
    cp = parallel_config.context_parallel_config
    masks = [torch.empty_like(mask) for _ in range(cp.ring_degree)]
    dist.all_gather(masks, mask.contiguous(), group=cp._ring_mesh.get_group())
    return masks


def _call_mask(ctx, mask: torch.Tensor | None, key: torch.Tensor, first: bool,
               parallel_config, counter: str) -> torch.Tensor | None:
    """The mask of the keys this op call attends to: ``mask`` itself outside a ring; in a
    ring, the mask of the chunk that the ``counter``-th call visits. A pass makes one call per
    ring rank, so the count taken modulo the degree also holds for a repeated backward."""
    ring = _ring(parallel_config)
    if ring is None:
        return mask
    rank, degree = ring
    if first:  # the ring's first forward call: the masks of every chunk, the counts from 0
        ctx.ring_masks = None if mask is None else _gather_ring_masks(mask, key, parallel_config)
        ctx.forward_calls = ctx.backward_calls = 0
    step = getattr(ctx, counter)
    setattr(ctx, counter, step + 1)
    return None if ctx.ring_masks is None else ctx.ring_masks[(rank + step) % degree]


def _forward_op(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                return_lse: bool = False, _save_ctx: bool = True, _parallel_config=None):
    """Attention of (B, S, H, D) inputs through torch's CPU flash kernel: the output, and with
    ``return_lse`` its log-sum-exp as (B, S, H). Saves what ``_backward_op`` needs when
    ``_save_ctx`` (the ring's first call)."""
    if dropout_p or enable_gqa:
        raise ValueError(f"the {NAME} attention backend supports neither dropout nor GQA "
                         f"(dropout_p={dropout_p}, enable_gqa={enable_gqa})")
    mask = _call_mask(ctx, attn_mask, key, _save_ctx, _parallel_config, "forward_calls")
    out, lse = _FLASH(_heads_first(query), _heads_first(key), _heads_first(value),
                      0.0, is_causal, attn_mask=_additive(mask, query.dtype), scale=scale)
    out, lse = out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()
    if _save_ctx:
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.attn_mask, ctx.is_causal, ctx.scale = mask, is_causal, scale
    return (out, lse) if return_lse else out


def _backward_op(ctx, grad_out: torch.Tensor, *args, query: torch.Tensor | None = None,
                 key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None, **kwargs):
    """Gradients of query, key and value (B, S, H, D) through torch's CPU flash backward. The
    ring passes each call's key/value chunk and the merged output and log-sum-exp (the whole
    softmax's normaliser); unpassed tensors are the saved ones."""
    t = {"query": query, "key": key, "value": value, "out": out, "lse": lse}
    if any(tensor is None for tensor in t.values()):
        # read only when needed: the ring passes all five and has read the saved tensors
        # itself, and under activation checkpointing they may be unpacked only once
        saved = dict(zip(t, ctx.saved_tensors))
        t = {name: saved[name] if tensor is None else tensor for name, tensor in t.items()}
    config = getattr(ctx, "_parallel_config", None)
    mask = (_call_mask(ctx, None, t["key"], False, config, "backward_calls")
            if _ring(config) else ctx.attn_mask)
    grads = _FLASH_BACKWARD(
        _heads_first(grad_out), *(_heads_first(t[n]) for n in ("query", "key", "value", "out")),
        _heads_first(t["lse"]).to(torch.float64 if t["query"].dtype == torch.float64
                                  else torch.float32),
        0.0, ctx.is_causal, attn_mask=_additive(mask, t["query"].dtype), scale=ctx.scale)
    return tuple(g.transpose(1, 2).contiguous() for g in grads)


def cpu_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False, return_lse: bool = False,
                        _parallel_config=None):
    """The backend diffusers' dispatcher calls: under context parallelism, diffusers' templated
    ring/Ulysses attention with this module's op pair; otherwise torch's CPU flash kernel
    directly (torch differentiates it)."""
    if _parallel_config is not None:
        return dispatch._templated_context_parallel_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            forward_op=_forward_op, backward_op=_backward_op, _parallel_config=_parallel_config)
    if dropout_p or enable_gqa:
        raise ValueError(f"the {NAME} attention backend supports neither dropout nor GQA")
    out, lse = _FLASH(_heads_first(query), _heads_first(key), _heads_first(value), 0.0,
                      is_causal, attn_mask=_additive(attn_mask, query.dtype), scale=scale)
    out = out.transpose(1, 2)
    return (out, lse.transpose(1, 2)) if return_lse else out


def _version_problems() -> list[str]:
    import diffusers

    problems = []
    version = ".".join(diffusers.__version__.split(".")[:2])
    if version not in WRITTEN_FOR:
        problems.append(f"diffusers {diffusers.__version__} is not a version the {NAME} backend "
                        f"was written against ({', '.join(WRITTEN_FOR)})")
    params = inspect.signature(dispatch._templated_context_parallel_attention).parameters
    if not {"forward_op", "backward_op", "_parallel_config"} <= params.keys():
        problems.append("diffusers' templated context-parallel attention no longer takes a "
                        "forward/backward op pair")
    return problems


def register() -> dispatch.AttentionBackendName:
    """Add the backend to diffusers' dispatcher (once; later calls return the same name),
    marked as supporting context parallelism. Refuses a diffusers it was not written for."""
    names = dispatch.AttentionBackendName
    if NAME in names._value2member_map_:
        return names(NAME)
    problems = _version_problems()
    if problems:
        raise RuntimeError("ring attention on the CPU cannot be set up: " + "; ".join(problems))
    member = str.__new__(names, NAME)
    member._name_, member._value_ = _MEMBER, NAME
    names._member_map_[_MEMBER] = member
    names._value2member_map_[NAME] = member
    names._member_names_.append(_MEMBER)
    dispatch._AttentionBackendRegistry.register(
        member, constraints=[dispatch._check_device, dispatch._check_shape],
        supports_context_parallel=True)(cpu_flash_attention)
    return member
