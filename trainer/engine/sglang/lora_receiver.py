"""LoRA adapter syncs into an SGLang worker's native DiT, through our ipc transport.

The extension's worker (trainer/engine/sglang/receiver.py) serves two channels: the full
weights (its ``ipc.WeightReceiver`` on the DiT's parameters) and, for a trainer in LoRA adapter
sync mode, the adapter's pairs (this module). One sync of the adapter:

    trainer (transport.py)                     worker (LoraReceiver)
    ("adapter", spec) ─────────────────────▶   spec checked against the DiT: every layer held,
                                               shapes, a packed layer's sections whole
                      ◀── ("refused", problems): nothing changed | ("ready", {})
    ipc sync of every (A, B), mode "adapter" ─▶ written into staging memory (fp32), each
                                               tensor's checksum compared; then (ipc's
                                               before_commit) every layer merged from its base
                                               snapshot into the served weight; a failure puts
                                               the previous version's weights back and fails
                      ◀── committed | failed    the sync

What travels is the pairs, not merged weights: rank * (in + out) numbers a layer instead of
in * out, and the merge is exact where it runs: the pairs are staged in fp32 (a bf16 or fp32
factor converts without loss), and the merge is the actor's own function
(``trainer.models.lora.merged_lora_weight``) applied to the base bytes the server holds, so the
served weight is the bytes the actor's merge gives (the same fp32 GEMM: the same device kind,
TF32 matmuls off as both torch and SGLang leave them). A packed parameter (Qwen-Image's
``to_added_qkv``) is merged section by section at its rows, the sections' places taken from the
worker's own packing table (receiver.py), so it equals the actor's per-projection merges
concatenated as the server packs them.

Atomicity: the pairs land in staging memory, never in the served weights; the served weights
change only in ``before_commit``, after every checksum matched, and the version commits only
when every layer is written. Each sync carries the whole adapter and merges from the base, so
a sync replaces the previous adapter (a layer the new adapter leaves out goes back to its
base); the previous version's pairs are kept (small) to rewrite the layers already written if
a merge fails. Should that rewrite fail too, the worker refuses to denoise until a sync
succeeds.

Base snapshot: a host copy of each LoRA layer's weight (where SGLang's own LoRA layers keep
theirs: no GPU memory), taken the first time the layer is merged after its base was written;
a full sync's commit drops every snapshot (the served weights are then the new base). The first
sync of an adapter run writes the base through the full channel, then the adapter here; in
between the worker refuses to denoise (a base without its adapter is no policy version).

Not covered: an adapter on only some sections of a packed parameter (refused: the sections'
rows are placed from their own sizes), and what the full channel does not cover either (tensor
parallelism, layerwise offload: receiver.py).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

import torch

from ipc import WeightReceiver, WeightSyncError
from ipc.transport import wait_event_host
from trainer.models.lora import merged_lora_weight

#: (served name, section index or None, sections or None) of a tensor sent under our name.
Place = Callable[[str], tuple[str, "int | None", "int | None"]]


class AdapterSpecError(ValueError):
    """The adapter a trainer announced does not fit the served DiT; ``problems`` lists all."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def staged_names(layer: str) -> tuple[str, str]:
    """The names a layer's A and B travel under (the trainer's layer name, as it sends it)."""
    return f"{layer}.lora_A.weight", f"{layer}.lora_B.weight"


@dataclass(frozen=True)
class Section:
    """One sent LoRA layer inside a served weight: rows ``row0:row0 + rows`` (all of them for
    an unpacked layer), A [rank, cols] and B [rows, rank]."""

    layer: str
    row0: int
    rows: int
    rank: int
    cols: int


def _entry(entry: Any) -> tuple[str, int, int, int] | None:
    """(layer, rank, in features, out features) of one spec entry, None when malformed."""
    if not isinstance(entry, (list, tuple)) or len(entry) != 4 or not isinstance(entry[0], str):
        return None
    sizes = entry[1:]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        return None
    return entry[0], int(sizes[0]), int(sizes[1]), int(sizes[2])


def plan_adapter(spec: Any, weights: Mapping[str, torch.Tensor], place: Place
                 ) -> tuple[dict[str, list[Section]], float]:
    """(served weight name -> its sections in row order, scaling) of an announced adapter
    ``{"scaling": s, "layers": [[layer, rank, in, out], ...]}``; raises AdapterSpecError naming
    every problem (nothing is staged or written before this passes)."""
    if not isinstance(spec, dict):
        raise AdapterSpecError([f"the adapter spec must be a table, got {type(spec).__name__}"])
    problems: list[str] = []
    scaling = spec.get("scaling")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) \
            or not math.isfinite(scaling):
        problems.append(f"scaling must be a finite number, got {scaling!r}")
    layers = spec.get("layers")
    if not isinstance(layers, list) or not layers:
        raise AdapterSpecError(problems + ["the adapter names no LoRA layer"])
    malformed, unknown, shapes, dups = [], [], [], []
    packed: dict[str, dict[int, tuple[str, int, int, int]]] = {}
    counts: dict[str, int] = {}
    plan: dict[str, list[Section]] = {}
    seen: set[str] = set()
    for raw in layers:
        entry = _entry(raw)
        if entry is None:
            malformed.append(repr(raw)[:80])
            continue
        layer, rank, cols, rows = entry
        if layer in seen:
            dups.append(layer)
            continue
        seen.add(layer)
        served, index, sections = place(f"{layer}.weight")
        weight = weights.get(served)
        if weight is None or weight.dim() != 2 or not weight.is_floating_point():
            unknown.append(layer)
            continue
        if weight.shape[1] != cols:
            shapes.append(f"{layer}: A is [{rank}, {cols}], {served} takes {weight.shape[1]} "
                          "inputs")
        elif index is None and weight.shape[0] != rows:
            shapes.append(f"{layer}: B is [{rows}, {rank}], {served} has {weight.shape[0]} rows")
        elif index is None:
            plan[served] = [Section(layer, 0, rows, rank, cols)]
        else:
            packed.setdefault(served, {})[index] = entry
            counts[served] = int(sections)
    plan.update(_packed_plan(packed, counts, weights, shapes))
    for label, items in (("malformed layer entries", malformed),
                         ("LoRA layers the server holds no linear weight for", unknown),
                         ("LoRA layers named twice", dups), ("shape mismatch", shapes)):
        if items:
            problems.append(f"{label} ({len(items)}): {', '.join(items)}")
    if problems:
        raise AdapterSpecError(problems)
    return plan, float(scaling)


def _packed_plan(packed: dict[str, dict[int, tuple[str, int, int, int]]],
                 counts: dict[str, int], weights: Mapping[str, torch.Tensor],
                 problems: list[str]) -> dict[str, list[Section]]:
    """Packed weights' sections in index order, each at the rows the ones before it leave
    (the packed weight is its sections concatenated along dim 0); appends to ``problems``."""
    plan = {}
    for served, members in sorted(packed.items()):
        if sorted(members) != list(range(counts[served])):
            problems.append(f"{served}: LoRA on sections {sorted(members)} of {counts[served]} "
                            "(the server packs them into one weight: adapt all of them or none)")
            continue
        row0, sections = 0, []
        for index in range(counts[served]):
            layer, rank, cols, rows = members[index]
            sections.append(Section(layer, row0, rows, rank, cols))
            row0 += rows
        if row0 != weights[served].shape[0]:
            problems.append(f"{served}: its sections' B have {row0} rows in all, the weight "
                            f"{weights[served].shape[0]}")
            continue
        plan[served] = sections
    return plan


@dataclass
class _Adapter:
    """One announced adapter: its plan, scaling and staging receiver (tensors by sent name)."""

    plan: dict[str, list[Section]]
    scaling: float
    staged: dict[str, torch.Tensor]
    receiver: WeightReceiver | None = None

    def pairs(self, served: str) -> list[tuple[Section, torch.Tensor, torch.Tensor]]:
        out = []
        for s in self.plan[served]:
            a, b = staged_names(s.layer)
            out.append((s, self.staged[a], self.staged[b]))
        return out


class LoraReceiver:
    """A worker's adapter channel (module docstring) over the live weights ``weights`` (the
    full channel's parameters, by served name). ``place`` maps a sent name to its served
    parameter (receiver.py's packing table); ``on_commit(version)`` runs after an adapter
    commits. backend / timeout_s / verify: as the full channel's ``ipc.WeightReceiver``."""

    def __init__(self, weights: Mapping[str, torch.Tensor], place: Place, *, backend: str,
                 timeout_s: float, verify: str,
                 on_commit: Callable[[int], None] | None = None) -> None:
        self._weights = dict(weights)
        self._place = place
        self._backend, self._timeout, self._verify = backend, float(timeout_s), verify
        self._on_commit = on_commit
        self._device = next(iter(self._weights.values())).device
        self._lock = threading.RLock()
        self._adapter: _Adapter | None = None
        self._base: dict[str, torch.Tensor] = {}       # served weight -> host copy of its base
        self._applied: dict[str, list[tuple[Section, torch.Tensor, torch.Tensor]]] = {}
        self._applied_scaling = 1.0
        self._expect_adapter = False  # the connected trainer syncs its base with an adapter
        self._unservable = ""         # why the served weights are no policy version ("": fine)

    # ---- channel ------------------------------------------------------------------------------
    def trainer_connected(self) -> None:
        """A trainer opened the full channel: until it opens an adapter channel, its full syncs
        are whole policies."""
        with self._lock:
            self._expect_adapter = False

    def open(self, spec: Any) -> WeightReceiver:
        """A staging receiver for the announced adapter (the previous one is closed); raises
        AdapterSpecError before anything is allocated or changed."""
        plan, scaling = plan_adapter(spec, self._weights, self._place)
        staged = {}
        for sections in plan.values():
            for s in sections:
                a, b = staged_names(s.layer)
                staged[a] = torch.zeros(s.rank, s.cols, dtype=torch.float32, device=self._device)
                staged[b] = torch.zeros(s.rows, s.rank, dtype=torch.float32, device=self._device)
        adapter = _Adapter(plan, scaling, staged)
        adapter.receiver = WeightReceiver(
            None, staged, modes={"adapter": list(staged)}, backend=self._backend,
            timeout_s=self._timeout, verify=self._verify,
            before_commit=partial(self._apply, adapter), on_commit=self._committed)
        with self._lock:
            previous, self._adapter = self._adapter, adapter
            self._expect_adapter = True
        if previous is not None and previous.receiver is not None:
            previous.receiver.close()
        return adapter.receiver

    def base_written(self, version: int) -> None:
        """The full channel committed ``version``: every served weight is now a base."""
        with self._lock:
            self._base.clear()
            self._applied.clear()
            self._unservable = (f"the base weights of version {version} are written but not "
                                "their LoRA adapter yet" if self._expect_adapter else "")

    def assert_servable(self) -> None:
        """Raise WeightSyncError while the served weights are no policy version."""
        with self._lock:
            reason = self._unservable
        if reason:
            raise WeightSyncError("post-write", [f"{reason}: a sync must succeed before "
                                                 "generating"])

    def close(self) -> None:
        with self._lock:
            adapter, self._adapter = self._adapter, None
        if adapter is not None and adapter.receiver is not None:
            adapter.receiver.close()

    def _committed(self, version: int, mode: str) -> None:
        if self._on_commit is not None:
            self._on_commit(version)

    # ---- the merge ----------------------------------------------------------------------------
    @torch.no_grad()
    def _apply(self, adapter: _Adapter, version: int, mode: str) -> None:
        """ipc's before_commit of a staged adapter: every layer written, or none changed."""
        with self._lock:
            for served in adapter.plan:  # a layer without a snapshot holds its base
                if served not in self._base:
                    self._base[served] = self._host_copy(self._weights[served])
            layers = list(adapter.plan) + [n for n in self._base if n not in adapter.plan]
            written: list[str] = []
            try:
                for served in layers:
                    pairs = adapter.pairs(served) if served in adapter.plan else None
                    self._weights[served].copy_(self._merged(served, pairs, adapter.scaling))
                    written.append(served)
                self._fence()
            except Exception as exc:
                self._roll_back(written, version, exc)
                raise
            self._applied = {n: [(s, a.clone(), b.clone()) for s, a, b in adapter.pairs(n)]
                             for n in adapter.plan}
            self._applied_scaling = adapter.scaling
            self._unservable = ""

    def _merged(self, served: str, pairs, scaling: float) -> torch.Tensor:
        """The served weight: its base, with each section's pair merged at its rows."""
        base = self._base[served].to(self._device)
        if pairs is None:
            return base
        parts = [merged_lora_weight(base[s.row0:s.row0 + s.rows], a, b, scaling)
                 for s, a, b in pairs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _roll_back(self, written: list[str], version: int, exc: Exception) -> None:
        """The previous version's weights back on the layers already written."""
        try:
            for served in written:
                self._weights[served].copy_(self._merged(served, self._applied.get(served),
                                                         self._applied_scaling))
            self._fence()
        except Exception as again:
            self._unservable = (f"the LoRA adapter of version {version} failed to apply "
                                f"({type(exc).__name__}: {exc}) and restoring the previous "
                                f"one failed ({type(again).__name__}: {again})")

    def _host_copy(self, weight: torch.Tensor) -> torch.Tensor:
        pinned = weight.device.type == "cuda"
        return torch.empty(weight.shape, dtype=weight.dtype, pin_memory=pinned).copy_(weight)

    def _fence(self) -> None:
        """The writes done on the device before the commit is answered (a deadline, no hang)."""
        if self._device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._device))
        if not wait_event_host(done, time.perf_counter() + self._timeout, lambda: True):
            raise TimeoutError(f"the merged weights were not written within {self._timeout:g} s")
