"""The batch a sequence group trains on: its ranks' rollout slices joined, the same on each rank.

With ``fsdp.sequence_parallel = S`` every rank still rolls out, scores and normalises its own
``rollout_batch_size / world`` prompt groups, exactly as a run without the split does; rollouts,
rewards, advantages (their batch statistics included) and the reward metrics therefore count
each sample once. The ranks of one sequence group must then replay the same samples, since each
runs only a slice of every forward's tokens: before the update, ``gather_sequence_group`` hands
every rank of the group all of the group's slices and their advantages, joined in rank order.

Design choices:

- Gather, not generate identically. Rolling the same samples out on each of the S engines
  would spend S times the rollout compute and trust S engines (S GPUs, their own reduction
  orders) to produce bit-identical latents: a rank whose copy differed would have its tokens
  mixed silently into the others' attention. One rank rolling out for the whole group and
  broadcasting would leave S - 1 engines idle. Gathering keeps each engine's work what it is
  without the split and makes the group's copies identical by construction.
- Only what the update reads travels: the decoded images and the conditioning sources (the
  reward's and the pictures') stay on the rank that made them; the joined batch has none.
- Tensors travel in their own dtype (bool as uint8) on the device the collective backend uses
  (gloo: host, NCCL: the GPU), each right-padded to the group's largest shape and cut back
  after, since conditions of different ranks differ in padded text length; ``concat_batches``
  then pads them as it pads the waves of one rollout (a zero mask entry is a masked token).
- The prompt groups of each slice keep their order and are numbered after the previous
  slices' (``group_index`` stays one id per prompt group); the metadata stays as the rank's
  driver wrote it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from trainer.models.base import RolloutBatch
from trainer.models.batch import concat_batches

# the batch-first tensors the update reads (``conditions`` and the advantages come beside them)
_TENSOR_FIELDS = ("group_index", "latents", "next_latents", "sigmas", "sigmas_next", "log_probs",
                  "final_latents")
# the plain fields each slice keeps; concat_batches checks that the slices agree on the rest
_PLAIN_FIELDS = ("prompts", "sample_ids", "metadata", "sde_indices", "height", "width", "eta",
                 "sde_type", "policy_version", "rollout_id", "guidance_scale", "sde_options",
                 "frames")
_ADVANTAGES = "advantages"


def _tensors(batch: RolloutBatch, advantages: torch.Tensor) -> dict[str, torch.Tensor | None]:
    out = {name: getattr(batch, name) for name in _TENSOR_FIELDS}
    out.update({f"conditions/{k}": v for k, v in batch.conditions.items()})
    out[_ADVANTAGES] = advantages
    return out


def _header(batch: RolloutBatch, tensors: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    """What every rank must know of every slice before the tensors move."""
    index = batch.group_index
    return {"plain": {name: getattr(batch, name) for name in _PLAIN_FIELDS},
            "groups": int(index.max()) + 1 if index.numel() else 0,  # NOTE: host sync
            "tensors": {name: None if t is None else (tuple(t.shape), t.dtype)
                        for name, t in tensors.items()}}


def _header_problems(headers: list[dict[str, Any]]) -> list[str]:
    """Tensor fields the slices do not hold alike (a gather of them could not line up)."""
    problems = []
    first = headers[0]["tensors"]
    for rank, header in enumerate(headers[1:], start=1):
        mine = header["tensors"]
        if mine.keys() != first.keys():
            problems.append(f"rank {rank} of the group holds tensors {sorted(mine)}, rank 0 "
                            f"{sorted(first)}")
            continue
        for name, spec in mine.items():
            ref = first[name]
            if (spec is None) != (ref is None):
                problems.append(f"{name}: present on one rank of the group and not another")
            elif spec is not None and (len(spec[0]) != len(ref[0]) or spec[1] != ref[1]):
                problems.append(f"{name}: rank {rank} has {spec}, rank 0 has {ref}")
    return problems


def _all_gather_padded(t: torch.Tensor, shapes: list[tuple[int, ...]], group: dist.ProcessGroup,
                       device: torch.device) -> list[torch.Tensor]:
    """Every rank's ``t`` (its shape in ``shapes``), through one all-gather of tensors padded
    to the largest shape; each comes back at its own shape on ``t``'s device and dtype."""
    full = tuple(max(shape[d] for shape in shapes) for d in range(t.dim()))
    wire_dtype = torch.uint8 if t.dtype == torch.bool else t.dtype
    send = torch.zeros(full, dtype=wire_dtype, device=device)
    send[tuple(slice(0, n) for n in t.shape)] = t.to(device=device, dtype=wire_dtype)
    received = [torch.empty_like(send) for _ in shapes]
    dist.all_gather(received, send, group=group)
    return [r[tuple(slice(0, n) for n in shape)].to(device=t.device, dtype=t.dtype)
            for r, shape in zip(received, shapes)]


def gather_sequence_group(batch: RolloutBatch, advantages: torch.Tensor,
                          group: dist.ProcessGroup, device: torch.device
                          ) -> tuple[RolloutBatch, torch.Tensor]:
    """(the joined batch, its advantages) of ``group``'s ranks, in rank order, on every rank
    of it (a collective of the group; ``device``: where the backend moves tensors). A group of
    one rank returns its own batch untouched."""
    size = dist.get_world_size(group)
    if size == 1:
        return batch, advantages
    tensors = _tensors(batch, advantages)
    headers: list[Any] = [None] * size
    dist.all_gather_object(headers, _header(batch, tensors), group=group)
    problems = _header_problems(headers)
    if problems:
        raise ValueError("the ranks of a sequence group hold rollout batches that cannot be "
                         "joined:\n  - " + "\n  - ".join(problems))
    gathered = {name: _all_gather_padded(t, [h["tensors"][name][0] for h in headers], group,
                                         device)
                for name, t in sorted(tensors.items()) if t is not None}
    slices, offset = [], 0
    for rank, header in enumerate(headers):
        fields = {name: gathered[name][rank] if name in gathered else None
                  for name in _TENSOR_FIELDS}
        fields["group_index"] = fields["group_index"] + offset
        conditions = {name.partition("/")[2]: parts[rank] for name, parts in gathered.items()
                      if name.startswith("conditions/")}
        slices.append(dataclasses.replace(batch, **header["plain"], **fields,
                                          conditions=conditions, images=None, sources=None))
        offset += header["groups"]
    return concat_batches(slices), torch.cat(gathered[_ADVANTAGES])
