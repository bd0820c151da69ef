"""FSDP2's unshard at one rank: one foreach copy for the whole parameter group.

With one rank there is nothing to all-gather: FSDP2's ``FSDPParamGroup.wait_for_unshard``
fills each parameter's unsharded storage from its local shard in a Python loop, and for every
parameter casts the shard to the compute dtype into a new tensor (one kernel), then copies
that into the unsharded storage (a second one). A LoRA unit holds a hundred or more small
parameters, so each unshard costs milliseconds of host time while the GPU runs almost nothing:
the train stage unshards the adapter before its first forward and again after each
optimizer step.

``install()`` replaces ``wait_for_unshard`` by a method that, for a one-rank group whose
parameters are all plainly sharded (no tensor-subclass all-gather hooks, no CPU offload),
casts every shard into its unsharded storage with one ``torch._foreach_copy_`` and then does
what torch's one-rank branch does after its loop. The cast is the same rounding, so the
parameters get the same bytes. Anything else runs torch's method unchanged. The method is
reimplemented, not wrapped, so it is installed only where torch's method is one of the
versions it was written from (compared by its source, comments and whitespace removed).
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import re

import torch

try:  # FSDP2's internals, which the replacement calls as torch's own method does
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState, alloc_storage
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
except ImportError:  # a torch without them: install() leaves FSDP2 as it is
    FSDPParamGroup = None

log = logging.getLogger("trainer")

# sha256 of torch's wait_for_unshard (from its ``def`` on, comments and whitespace removed):
# torch 2.11 and torch 2.14
_KNOWN_SOURCES = {"77bb52df1b2df600", "48fc7ce6981a7e05"}
_torch_wait_for_unshard = None  # torch's own method, kept for every other case


def source_fingerprint(source: str) -> str:
    text = source[source.index("def wait_for_unshard"):]
    text = re.sub(r"#[^\n]*", "", text)
    return hashlib.sha256(re.sub(r"\s+", "", text).encode()).hexdigest()[:16]


def flat_unshard_copy(fsdp_params: list, device: torch.device) -> None:
    """Every parameter's local shard cast into its unsharded storage (allocated as torch's
    one-rank branch allocates it), by one foreach copy."""
    outs, shards = [], []
    for fsdp_param in fsdp_params:
        shard = fsdp_param._sharded_param_data
        fsdp_param.init_all_gather_outputs(
            [shard.numel()], [fsdp_param.param_dtype or shard.dtype], 1, device)
        out = fsdp_param.all_gather_outputs[0]
        alloc_storage(out)
        outs.append(out)
        shards.append(shard)
    # the unsharded parameters alias these outputs; autograd must not see the refill as an
    # in-place change of a tensor it saved (torch's loop does the same per tensor)
    with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
        torch._foreach_copy_(outs, shards)


def _flat_eligible(group) -> bool:
    if isinstance(group.mesh_info, FSDPMeshInfo) and group._all_gather_process_group.size() != 1:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    return all(p.sharded_state == ShardedState.SHARDED and not p.offload_to_cpu
               and not hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather")
               for p in group.fsdp_params)


def _wait_for_unshard(self) -> None:
    if not self._all_gather_result or not _flat_eligible(self):
        return _torch_wait_for_unshard(self)
    if self._training_state == TrainingState.FORWARD:
        previous = self.comm_ctx.all_gather_state
        if previous:
            self._wait_all_gather_streams_on_event(previous.event)
            self.comm_ctx.all_gather_state = None
    flat_unshard_copy(self.fsdp_params, self.device)
    for fsdp_param in self.fsdp_params:
        fsdp_param.init_unsharded_param()
    self._to_unsharded()
    copied = self.device_handle.Event()
    copied.record()
    self._wait_all_gather_streams_on_event(copied)
    self._all_gather_result = None


def installed() -> bool:
    return FSDPParamGroup is not None and FSDPParamGroup.wait_for_unshard is _wait_for_unshard


def install() -> bool:
    """Route FSDP2's unshard through ``_wait_for_unshard`` (once per process); False where
    torch's method is absent or not one this was written from."""
    global _torch_wait_for_unshard
    if installed():
        return True
    original = getattr(FSDPParamGroup, "wait_for_unshard", None)
    try:
        known = source_fingerprint(inspect.getsource(original)) in _KNOWN_SOURCES
    except (TypeError, OSError, ValueError):
        known = False
    if not known:
        log.info("FSDP2's wait_for_unshard is not a version the one-rank unshard was written "
                 "from: kept as is")
        return False
    _torch_wait_for_unshard = original
    FSDPParamGroup.wait_for_unshard = _wait_for_unshard
    return True
