"""Building the actor: load, LoRA, FSDP2, activation checkpointing, optimizer, LR schedule.

FSDP2 is applied in one place (``apply_fsdp``): ``fully_shard`` per transformer block, then the
root, as torchtitan does (a world-1 LoRA actor: the root only, ``block_units``); each block is
compiled first (``model.compile``). Mixed precision
comes from --fsdp-param-dtype / --fsdp-reduce-dtype; trainable parameters are cast to
--fsdp-master-dtype (fp32 for LoRA) before sharding so the optimizer keeps fp32 master copies
while the forward gathers bf16. A LoRA actor's frozen base is loaded in the compute dtype.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing as _apply_ac, checkpoint_wrapper)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from trainer.parallel.sequence import (ParallelMesh, apply_sequence_parallel, build_mesh,
                                       shard_over_data_and_sequence)
from trainer.patches.fsdp_grad_copy_in import install as install_flat_copy_in
from trainer.patches.fsdp_one_rank_unshard import install as install_flat_unshard
from trainer.config import FSDPConfig, LoRAConfig, TrainConfig
from trainer.utils.dtypes import TORCH_DTYPES
from trainer.lora_init import load_lora_init
from trainer.models.base import GenerativeModelAdapter
from trainer.models.compile import compile_blocks, compile_wanted
from trainer.models.lora import apply_lora

# Inserted by torch's checkpoint wrapper into every wrapped block's parameter names; stripped
# before names leave the actor (otherwise the engine would silently skip every block).
_AC_SEGMENT = "_checkpoint_wrapped_module."


def strip_wrapper_names(name: str) -> str:
    return name.replace(_AC_SEGMENT, "")


def lora_options(lora: LoRAConfig, adapter: GenerativeModelAdapter) -> dict:
    """``trainer.models.lora.apply_lora`` keywords for this run's LoRA layers."""
    return {"rank": lora.rank, "alpha": lora.alpha or lora.rank,
            "target_modules": list(lora.target_modules or adapter.lora_target_modules()),
            "dropout": lora.dropout, "init_a": lora.init_a}


def lora_spec(lora: LoRAConfig, adapter: GenerativeModelAdapter) -> dict | None:
    """What the engine needs to build the same LoRA layers (so adapter-mode names match)."""
    if lora.rank <= 0:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha or lora.rank,
            "target_modules": list(lora.target_modules or adapter.lora_target_modules()),
            "merge": lora.engine_merge}


def inner_model(model: nn.Module) -> nn.Module:
    """The diffusers transformer inside an optional peft wrapper."""
    base = getattr(model, "base_model", None)
    return base.model if base is not None and hasattr(base, "model") else model


def assert_trainable_boundary(model: nn.Module, lora: bool) -> None:
    """Full: nothing frozen. LoRA: adapters exist and are the only trainable tensors."""
    problems = []
    names = [(n, p.requires_grad) for n, p in model.named_parameters()]
    if lora:
        lora_names = [n for n, _ in names if "lora_" in n]
        if not lora_names:
            problems.append("LoRA mode but the model has no lora_ parameters")
        problems += [f"base parameter {n} is trainable" for n, g in names
                     if g and "lora_" not in n][:5]
        problems += [f"LoRA parameter {n} is frozen" for n, g in names
                     if not g and "lora_" in n][:5]
    else:
        problems += [f"parameter {n} is frozen in full mode" for n, g in names if not g][:5]
    if problems:
        raise RuntimeError("trainable boundary violated:\n  - " + "\n  - ".join(problems))


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module]) -> None:
    block_ids = {id(b) for b in blocks}
    _apply_ac(model, checkpoint_wrapper_fn=checkpoint_wrapper,
              check_fn=lambda m: id(m) in block_ids)


def _world_one() -> bool:
    """A process group of one rank: FSDP2 there has nothing to shard across."""
    return dist.is_initialized() and dist.get_world_size() == 1


def reshard_after_forward(fsdp: FSDPConfig) -> bool:
    """fsdp.reshard_after_forward, with None resolved: keep the gathered blocks at world 1."""
    if fsdp.reshard_after_forward is not None:
        return bool(fsdp.reshard_after_forward)
    return not _world_one()


def shard_frozen(fsdp: FSDPConfig) -> bool:
    """fsdp.shard_frozen, with None resolved: shard the frozen parameters only at world > 1."""
    if fsdp.shard_frozen is not None:
        return bool(fsdp.shard_frozen)
    return not _world_one()


def block_units(fsdp: FSDPConfig, lora: LoRAConfig) -> bool:
    """fsdp.block_units, with None resolved: one unit per block unless the frozen parameters
    stay out of FSDP2 at world 1 (then the only unit is the root's, holding the adapter)."""
    if fsdp.block_units is not None:
        return bool(fsdp.block_units)
    return not (_world_one() and not shard_frozen(fsdp) and lora.rank > 0)


def accumulate_unsharded(fsdp: FSDPConfig) -> bool:
    """fsdp.accumulate_unsharded, with None resolved: on at world 1, where the gathered
    parameters and unsharded gradients are no more than the shards."""
    if fsdp.accumulate_unsharded is not None:
        return bool(fsdp.accumulate_unsharded)
    return _world_one()


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], fsdp: FSDPConfig,
               lora: LoRAConfig, mesh: ParallelMesh | None = None) -> nn.Module:
    """FSDP2 over ``blocks`` then the root; with ``fsdp.sequence_parallel > 1`` over ``mesh``
    (the run's data x sequence mesh; None: built here)."""
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[fsdp.param_dtype],
                              reduce_dtype=TORCH_DTYPES[fsdp.reduce_dtype])
    kwargs = {"mp_policy": mp, "reshard_after_forward": reshard_after_forward(fsdp)}
    if not shard_frozen(fsdp):
        # left to the module as plain tensors: no gather copy, no mixed-precision cast (a LoRA
        # base is loaded in the compute dtype already), no DTensor dispatch
        frozen = {p for p in model.parameters() if not p.requires_grad}
        if frozen:
            kwargs["ignored_params"] = frozen
    if fsdp.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    install_flat_copy_in()  # one rank: gradients copied flat, not through _chunk_cat (slow)
    install_flat_unshard()  # one rank: parameters cast in one foreach copy, not one by one
    units = blocks if block_units(fsdp, lora) else []
    if fsdp.sequence_parallel > 1:
        # the transformer's tokens split over sequence groups; FSDP2 then shards over data x
        # sequence and sums gradients over each sequence group (docs/fsdp2.md)
        mesh = mesh or build_mesh(fsdp.sequence_parallel)
        apply_sequence_parallel(inner_model(model), mesh)
        return shard_over_data_and_sequence(model, units, mesh, **kwargs)
    for block in units:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def current_blocks(model: nn.Module, adapter: GenerativeModelAdapter) -> list[nn.Module]:
    """The adapter's blocks, or their checkpoint wrappers once AC has wrapped them."""
    blocks = adapter.transformer_blocks(inner_model(model))
    parents = {}
    for mod in model.modules():
        inner = getattr(mod, "_checkpoint_wrapped_module", None)
        if inner is not None:
            parents[id(inner)] = mod
    return [parents.get(id(b), b) for b in blocks]


def build_actor(adapter: GenerativeModelAdapter, train: TrainConfig, fsdp: FSDPConfig,
                lora: LoRAConfig, device: torch.device, distributed: bool, shard: bool = True,
                *, compile: str = "auto", mesh: ParallelMesh | None = None) -> nn.Module:
    """Load, LoRA, master dtype, device, AC; then FSDP2 when ``distributed`` and ``shard``
    (``shard=False`` leaves the collective ``fully_shard`` to ``shard_actor``, for wave
    loading: fully_shard must run on all ranks together). ``compile``: ``model.compile``;
    ``mesh``: the run's data x sequence mesh (``apply_fsdp``)."""
    torch.manual_seed(train.seed)  # LoRA init: identical on every rank
    use_lora = lora.rank > 0
    # LoRA: the frozen base is stored in the compute dtype (half the memory and offload traffic
    # of fp32, no cast per forward); only the trainable tensors get the master dtype below.
    load_dtype = TORCH_DTYPES[fsdp.param_dtype] if use_lora else torch.float32
    model = adapter.load_train_model(dtype=load_dtype, device="cpu")
    if use_lora:
        model.requires_grad_(False)
        model = apply_lora(model, **lora_options(lora, adapter))
    else:
        model.requires_grad_(True)
    master = TORCH_DTYPES[fsdp.master_dtype] if fsdp.master_dtype else None
    if master is not None:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(master)
    if use_lora and lora.init_path:  # after the master cast: loaded at full precision
        load_lora_init(model, lora.init_path, rank=lora.rank, alpha=lora.alpha or lora.rank)
    model.to(device)
    assert_trainable_boundary(model, use_lora)
    if fsdp.activation_checkpointing:
        apply_activation_checkpointing(model, adapter.transformer_blocks(inner_model(model)))
    if compile_wanted(compile, device):
        # before fully_shard: its hooks then wrap the compiled forward (torchtitan's order)
        compile_blocks(current_blocks(model, adapter), adapter.block_dynamic_dims)
    if distributed and shard:
        apply_fsdp(model, current_blocks(model, adapter), fsdp, lora, mesh)
    return model


def shard_actor(model: nn.Module, adapter: GenerativeModelAdapter, fsdp: FSDPConfig,
                lora: LoRAConfig, mesh: ParallelMesh | None = None) -> nn.Module:
    """FSDP2 over a model ``build_actor(..., shard=False)`` built."""
    return apply_fsdp(model, current_blocks(model, adapter), fsdp, lora, mesh)


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    fused = t.adam_fused
    if fused is None:  # fused on a GPU (faster, less memory), the CPU keeps foreach
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                             eps=t.adam_eps, weight_decay=t.weight_decay,
                             **({"fused": True} if fused else {}))


def lr_at_step(step: int, t: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then the schedule."""
    if t.lr_warmup_iters > 0 and step < t.lr_warmup_iters:
        return t.lr * (step + 1) / t.lr_warmup_iters
    if t.lr_scheduler == "constant" or not t.lr_decay_iters:
        return t.lr
    progress = min(1.0, (step - t.lr_warmup_iters) / max(1, t.lr_decay_iters))
    if t.lr_scheduler == "linear":
        return t.min_lr + (t.lr - t.min_lr) * (1.0 - progress)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass
class OffloadState:
    """Host copies of the actor's device storage while the engine holds the GPU."""

    host: dict[int, tuple[torch.Tensor, int]]  # id(tensor) -> (pinned copy, storage bytes)

    @property
    def nbytes(self) -> int:
        """Bytes held on the host (what crosses PCIe each way)."""
        return sum(cpu.nbytes for cpu, _ in self.host.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard as a plain tensor sharing storage (detached: resizing / refilling it
    in place must not go through autograd's view tracking of to_local())."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


def _offload_tensors(tensors: list[torch.Tensor]) -> dict[int, tuple[torch.Tensor, int]]:
    host = {}
    for t in tensors:
        loc = _local(t)
        if loc.device.type != "cuda" or loc.untyped_storage().size() == 0:
            continue
        cpu = torch.empty(loc.shape, dtype=loc.dtype, pin_memory=True)
        cpu.copy_(loc, non_blocking=True)
        # the storage can be larger than the view (FSDP2 pads a shard to an even split):
        # remember its size so onload restores the same layout
        host[id(t)] = (cpu, loc.untyped_storage().nbytes())
    torch.cuda.synchronize()  # NOTE: host sync; the copies must land before storage is freed
    for t in tensors:
        if id(t) in host:
            _local(t).untyped_storage().resize_(0)
    return host


def _onload_tensors(tensors: list[torch.Tensor], host: dict[int, tuple[torch.Tensor, int]],
                    copy_stream: torch.cuda.Stream | None = None) -> None:
    """Restore each tensor's storage and copy its host copy back; the copies go on
    ``copy_stream`` when given (the storage is allocated on the current stream, which the copy
    stream waits for first: the memory may be the last user's)."""
    restored = []
    for t in tensors:
        entry = host.get(id(t))
        if entry is None:
            continue
        cpu, nbytes = entry
        loc = _local(t)
        loc.untyped_storage().resize_(nbytes)
        restored.append((loc, cpu))
    if copy_stream is not None:
        copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):  # None: the current stream
        for loc, cpu in restored:
            loc.copy_(cpu, non_blocking=True)


class PendingOnload:
    """Optimizer-state copies still in flight on a side stream. ``wait()`` (idempotent, no
    host sync) makes the current stream wait for them; it also runs as a one-shot step
    pre-hook of the optimizer, so no optimizer step reads the state before it has landed."""

    def __init__(self, event: torch.cuda.Event | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.event = event
        self.hook = (optimizer.register_step_pre_hook(lambda *_: self.wait())
                     if event is not None and optimizer is not None else None)

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
            self.event = None
        if self.hook is not None:
            self.hook.remove()
            self.hook = None


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The state's tensors with storage worth moving (the 0-dim step counters stay)."""
    return [v for state in optimizer.state.values() for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0]


def actor_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return model_tensors(model) + optimizer_state_tensors(optimizer)


def reshard_gathered(model: nn.Module) -> None:
    """Free FSDP2's gathered parameters. Without resharding after forward (world 1), a no-grad
    forward leaves them gathered: the module then holds the gathered tensors in place of its
    sharded parameters, so nothing may read ``model.parameters()`` (or offload) until this
    runs."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _module_list(model: nn.Module) -> list[nn.Module]:
    """``model.modules()`` as a list, kept per model (the actor's tree is fixed once built;
    walking its thousand modules costs the host about a millisecond each time)."""
    modules = _MODULES.get(model)
    if modules is None:
        modules = _MODULES[model] = list(model.modules())
    return modules


def ensure_train_mode(model: nn.Module) -> None:
    """``model.train()`` unless every module is in training mode already: ``train()`` sets
    the flag through ``nn.Module.__setattr__`` on each of the actor's modules, milliseconds of
    host time at the start of every train stage while the GPU waits."""
    if not all(m.training for m in _module_list(model)):
        model.train()


def reduce_each_backward(model: nn.Module, reduce: bool) -> None:
    """Whether each backward reduces its gradients and frees the gathered parameters (FSDP2's
    default, ``reduce=True``), or leaves both unsharded for the next micro-batch, its gradients
    accumulated in the reduce dtype (``fsdp.accumulate_unsharded``: the update turns this off
    for all but its last micro-batch)."""
    for module in _module_list(model):
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(reduce, recurse=False)
            module.set_reshard_after_backward(reduce, recurse=False)


@torch.no_grad()
def offload_actor(model: nn.Module, optimizer: torch.optim.Optimizer) -> OffloadState:
    """Free the actor's device storage (params, grads, AdamW state) into pinned host memory.

    Resizing the local shard's storage to 0 is what actually frees it under fully_shard
    (reassigning param.data would free nothing: the shard keeps its storage).
    """
    reshard_gathered(model)
    state = OffloadState(_offload_tensors(actor_tensors(model, optimizer)))
    # hand the freed blocks back to the device, not just to this process's caching allocator:
    # the colocated engine is another process
    torch.cuda.empty_cache()
    return state


@torch.no_grad()
def onload_actor(model: nn.Module, optimizer: torch.optim.Optimizer, state: OffloadState, *,
                 state_stream: torch.cuda.Stream | None = None) -> PendingOnload:
    """Bring the actor back from host memory. The parameters (and gradients) are copied on the
    current stream, so the next forward follows them. With ``state_stream``, the optimizer
    state (2x the parameters' bytes under AdamW) is copied on that stream instead, overlapping
    the forwards and backwards that need only the parameters; the returned handle's ``wait()``
    (also run by the optimizer's next step) orders the current stream after those copies."""
    _onload_tensors(model_tensors(model), state.host)
    _onload_tensors(optimizer_state_tensors(optimizer), state.host, state_stream)
    state.host.clear()  # pinned blocks return to torch's host cache once their copies are done
    if state_stream is None:
        return PendingOnload()
    return PendingOnload(state_stream.record_event(), optimizer)
