"""Adam / AdamW steps over FSDP2's DTensor parameters, run on their local shards.

``optimizer.step()`` over DTensors sends every foreach / fused call through DTensor's
dispatch (sharding propagation over hundreds of tensor arguments), which costs the host more
than the GPU work it launches for a LoRA. Adam's update is elementwise, so stepping each
rank's local shard with its local gradient and state is the same arithmetic on the same
numbers as the DTensor step, for Shard and Replicate placements alike (a Partial placement
would not be: those steps keep the DTensor path). The optimizer object, its param groups and
its state (DTensors, as checkpoints read them) are untouched, and its step hooks run as in
``optimizer.step()`` (the training progress bar counts updates with one): only the call is
different.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam
from torch.optim.optimizer import _default_to_fused_or_foreach


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (plain tensors as they are)."""
    # the attribute, not to_local(): that is an autograd Function call per tensor
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


def _elementwise_safe(tensors: list[torch.Tensor]) -> bool:
    """Every DTensor among ``tensors`` has no Partial placement (a pending sum)."""
    return all(not any(p.is_partial() for p in t.placements)
               for t in tensors if isinstance(t, DTensor))


def scale_gradients(params: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Every gradient of ``params`` times ``coef``, in place on its local shard."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(local_tensors(grads), coef)


def step_adam_on_local_shards(optimizer: torch.optim.Optimizer,
                              clip_coef: torch.Tensor | None = None) -> None:
    """``optimizer.step()`` of a torch Adam / AdamW on the local shards (module docstring);
    the optimizer's ``found_inf`` / ``grad_scale`` and a tensor lr apply as in its own step.
    Any other optimizer, or a Partial placement on a parameter or gradient, steps through
    ``optimizer.step()`` (the state is created like its parameter, so it follows).

    ``clip_coef``: the gradient-norm clip's coefficient c, applied by this step. A fused group
    on the local shards hands 1/c to the kernel as its ``grad_scale``, which divides each
    gradient as it loads it, so the gradients get no pass of their own (for full fine-tuning,
    a read and a write of 4 bytes a parameter). Without clipping c is 1 and the step is the
    same bit for bit; with it, a gradient divided by 1/c may differ from one multiplied by c in
    its last bit. Every other case scales the gradients by c first."""
    tensors = [t for group in optimizer.param_groups for p in group["params"]
               for t in (p, p.grad) if t is not None]
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) \
            or not _elementwise_safe(tensors):
        if clip_coef is not None:
            scale_gradients([p for group in optimizer.param_groups for p in group["params"]],
                            clip_coef)
        optimizer.step()
        return
    _hooked_local_step(optimizer, clip_coef)


@torch.optim.Optimizer.profile_hook_step  # the step hooks and profiler range of step()
@torch.no_grad()
def _hooked_local_step(optimizer: torch.optim.Optimizer,
                       clip_coef: torch.Tensor | None = None) -> None:
    for group in optimizer.param_groups:
        lists = ([], [], [], [], [], [])  # params, grads, exp_avgs, exp_avg_sqs, max, steps
        has_complex = optimizer._init_group(group, *lists)  # creates missing state, as step()
        if not lists[0]:
            continue
        beta1, beta2 = group["betas"]
        foreach = group["foreach"]
        if foreach is None and not group["fused"]:  # the choice step() makes on DTensors
            _, foreach = _default_to_fused_or_foreach(lists[0], group["differentiable"])
        local = [local_tensors(ts) for ts in lists]
        grad_scale = getattr(optimizer, "grad_scale", None)
        if clip_coef is not None:
            if group["fused"] and grad_scale is None:
                grad_scale = clip_coef.float().reciprocal()
            else:
                torch._foreach_mul_(local[1], clip_coef)
        adam(*local, amsgrad=group["amsgrad"],
             has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=group["maximize"], foreach=foreach,
             capturable=group["capturable"], differentiable=group["differentiable"],
             fused=group["fused"], grad_scale=grad_scale,
             found_inf=getattr(optimizer, "found_inf", None),
             decoupled_weight_decay=group["decoupled_weight_decay"])
