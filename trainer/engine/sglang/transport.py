"""Trainer side of our ipc/ transport into an SGLang server that runs the extension.

    transport = SGLangTransport.connect(url, device=torch.device("cuda", local_rank))
    stats = transport.sync(version, sync_payload(model, "full"))   # ipc.SyncStats
    transport.close()

``connect`` asks the server's ``GET /flowgrpo/weight_receivers`` (registered by the
extension) for its workers' receivers, picks the one on this trainer's GPU (by device UUID;
on a CPU server, its only worker), and connects an ``ipc.WeightSender`` to it over the
worker's Unix socket. A sync is then the embedded engine's: the manifest checked before any
byte moves, one copy per byte into the native DiT's parameters (CUDA IPC, or shared memory on
the CPU), a checksum computed by the copy and re-read by the receiver, commit or roll back
(``ipc.WeightSyncError`` with stage "pre-write": nothing written; "post-write": the worker
refuses to generate until a sync of the same version succeeds).

Names: the payload comes in our (diffusers) names; a parameter the server packs is sent as the
concatenation of its sections along dim 0, in section order, under the served name, and one it
renames (Wan's) under that name, from the name rules the worker read off its own module
(trainer/engine/sglang/receiver.py). The concatenation is lazy (``ipc.LazyTensor``): produced
when its bucket is written, so a sharded model is still gathered one bucket at a time.

LoRA adapter sync mode (``lora_scaling`` given): the payload's ``lora_A`` / ``lora_B`` pairs go
over a second channel to the worker's adapter receiver (trainer/engine/sglang/lora_receiver.py),
which stages them, checks them, and merges them into the served weights only when every
checksum matched; a failed adapter sync leaves the previous version serving. The channel is
opened with the adapter's layers and shapes, which the worker checks against its DiT before
anything is sent: a pair for a layer the server lacks is refused there (pre-write), also when it
comes with the base weights of a run's first sync, whose base is then not written either. That
first sync sends the base over the full channel (plain tensors), then the pairs.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from multiprocessing.connection import Client
from typing import Any, Iterable, Iterator

import torch

from ipc import LazyTensor, SyncStats, WeightSender, WeightSyncError
from trainer.engine.sglang.lora import lora_layer, lora_pairs
from trainer.engine.sglang.lora_receiver import staged_names
from trainer.engine.sglang.receiver import PROTOCOL, ROUTE, PackingTable


class TransportError(RuntimeError):
    """The server offers no receiver this trainer can use (the reason is in the message)."""


class ReceiversOff(TransportError):
    """The server's extension was told not to install receivers (``FLOWGRPO_WEIGHT_RECEIVER=0``)."""


def fetch_receivers(url: str, *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The workers' receiver descriptors the server's extension publishes; raises
    ReceiversOff when the server runs with ``FLOWGRPO_WEIGHT_RECEIVER=0``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + ROUTE, timeout=timeout_s) as reply:
            body = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise TransportError(f"{url} has no {ROUTE}: start the server with the flowgrpo "
                                 "extension (SGLANG_PLUGINS=flowgrpo) or use the stock "
                                 "sync") from None
        raise TransportError(f"{url}{ROUTE}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TransportError(f"{url}{ROUTE}: {exc}") from None
    if body.get("enabled") is False:
        raise ReceiversOff(f"{url} runs the flowgrpo extension with its weight receivers turned "
                           "off (FLOWGRPO_WEIGHT_RECEIVER=0)")
    return list(body["receivers"])


def pick_receiver(receivers: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """The receiver on ``device``: same GPU UUID for CUDA (peers match by UUID, not ordinal),
    the only CPU worker for a CPU trainer."""
    if device.type == "cuda":
        from ipc.transport import device_uuid

        index = device.index if device.index is not None else torch.cuda.current_device()
        mine = device_uuid(index)
        hits = [r for r in receivers if r.get("device_uuid") == mine]
        where = f"GPU {mine}"
    else:
        hits = [r for r in receivers if str(r.get("device", "")).startswith("cpu")]
        where = "the CPU"
    if len(hits) != 1:
        seen = ", ".join(f"rank {r.get('rank')} on {r.get('device_uuid') or r.get('device')}"
                         for r in receivers) or "none"
        raise TransportError(f"{len(hits)} SGLang receivers on {where} (one is needed; the "
                             f"server publishes: {seen})")
    return hits[0]


class Packing(PackingTable):
    """Where each sent tensor lands: (served name, section, sections), from a worker's rules
    (section and sections None for a tensor served whole, under its name or a renamed one)."""

    def payload(self, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The payload under the served names; a packed parameter becomes one lazy
        concatenation, yielded where its last section arrives. Raises ValueError naming every
        packed parameter whose sections do not all arrive (or arrive twice)."""
        pending: dict[str, dict[int, Any]] = {}
        counts: dict[str, int] = {}
        problems: list[str] = []
        for name, t in named:
            served, section, sections = self.place(name)
            if section is None:
                yield served, t
                continue
            parts = pending.setdefault(served, {})
            counts[served] = sections
            if section in parts:
                problems.append(f"{served}: section {section} ({name}) sent twice")
                continue
            parts[section] = t
            if len(parts) == sections:
                del pending[served]
                yield served, _concat([parts[k] for k in range(sections)])
        problems += [f"{served}: sections {sorted(parts)} of {counts[served]} sent"
                     for served, parts in sorted(pending.items())]
        if problems:
            raise ValueError("packed parameters not whole: " + "; ".join(problems))


def _concat(parts: list[Any]) -> LazyTensor:
    shapes = [tuple(p.shape) for p in parts]
    if len({s[1:] for s in shapes}) != 1 or len({p.dtype for p in parts}) != 1:
        raise ValueError(f"sections of unequal trailing shapes or dtypes: {shapes}")
    shape = (sum(s[0] for s in shapes),) + shapes[0][1:]

    def produce() -> torch.Tensor:
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in parts]
        return torch.cat(full, dim=0)

    return LazyTensor(shape, parts[0].dtype, produce)


def open_channel(descriptor: dict[str, Any], request: tuple, timeout_s: float):
    """A connection to the worker's listener with ``request`` (its first message) answered:
    (connection, None) when ready, (None, problems) when the worker refused it."""
    conn = Client(descriptor["address"], family="AF_UNIX",
                  authkey=bytes.fromhex(descriptor["authkey"]))
    try:
        conn.send(request)
        if not conn.poll(timeout_s):
            raise TransportError(f"the SGLang worker (rank {descriptor.get('rank')}) did not "
                                 f"answer a {request[0]!r} channel request within {timeout_s:g} s")
        reply = conn.recv()
    except (EOFError, OSError) as exc:
        conn.close()
        raise TransportError(f"the SGLang worker (rank {descriptor.get('rank')}) closed the "
                             f"{request[0]!r} channel request: {exc or 'end of file'}") from None
    except BaseException:
        conn.close()
        raise
    if reply[0] == "ready":
        return conn, None
    conn.close()
    return None, list(reply[1])


def split_payload(payload: Iterable[tuple[str, Any]]
                  ) -> tuple[list[tuple[str, Any]], dict[str, tuple[Any, Any]]]:
    """(plain tensors, LoRA layer -> (A, B)); raises ValueError for a layer without its pair."""
    plain, lora = [], []
    for name, t in payload:
        (lora if lora_layer(name) is not None else plain).append((name, t))
    return plain, (lora_pairs(lora) if lora else {})


def adapter_spec(pairs: dict[str, tuple[Any, Any]], scaling: float) -> dict[str, Any]:
    """What the worker checks before a pair is sent (lora_receiver.plan_adapter): per layer its
    rank, in and out features, read off the shapes (nothing gathered); raises ValueError for a
    pair whose shapes are no rank-r pair."""
    layers, bad = [], []
    for layer, (a, b) in pairs.items():
        sa, sb = tuple(a.shape), tuple(b.shape)
        if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[1]:
            bad.append(f"{layer}: lora_A {sa}, lora_B {sb}")
            continue
        layers.append([layer, int(sa[0]), int(sa[1]), int(sb[0])])
    if bad:
        raise ValueError(f"LoRA pairs that are no rank-r pair (A [r, in], B [out, r]): "
                         f"{', '.join(bad)}")
    return {"scaling": float(scaling), "layers": layers}


def _combined(parts: list[SyncStats], seconds: float) -> SyncStats:
    """One sync's stats from its channels' (the full channel's first)."""
    if len(parts) == 1:
        return parts[0]
    timings: dict[str, float] = {}
    for p in parts:
        for k, v in p.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    last = parts[-1]
    return SyncStats(version=last.version, mode=parts[0].mode,
                     tensors=sum(p.tensors for p in parts), bytes=sum(p.bytes for p in parts),
                     seconds=seconds, buckets=sum(p.buckets for p in parts),
                     launches=sum(p.launches for p in parts),
                     handle_opens=sum(p.handle_opens for p in parts), checksum=last.checksum,
                     backend=last.backend, verify=last.verify, timings=timings)


class SGLangTransport:
    """An ``ipc.WeightSender`` connected to one SGLang worker's receiver. Drop-in beside the
    stock ``SGLangWeightSync``: ``sync(version, payload, mode=)`` returns stats with the same
    seconds / bytes / tensors / checksum / timings fields, and verifies every sync itself.
    ``client``: the server's ``SGLangEngineClient``, whose ``committed_version`` (echoed as
    each rollout's policy version) advances only after a committed sync. ``lora_scaling``:
    the adapter's ``alpha / rank`` in LoRA adapter sync mode (payloads with LoRA pairs); None
    refuses such payloads."""

    self_verifying = True  # the receiver compares checksums before it commits

    def __init__(self, descriptor: dict[str, Any], *, bucket_bytes: int = 512 << 20,
                 timeout_s: float = 60.0, client: Any = None,
                 lora_scaling: float | None = None) -> None:
        if descriptor.get("protocol") != PROTOCOL:
            raise TransportError(f"the SGLang worker speaks receiver protocol "
                                 f"{descriptor.get('protocol', 1)}, this trainer {PROTOCOL}: "
                                 "install the trainer's version of the package next to SGLang "
                                 "and restart the server")
        self.descriptor, self.client = descriptor, client
        self.lora_scaling = lora_scaling
        self._bucket_bytes, self._timeout = bucket_bytes, timeout_s
        # the receiver refuses versions below its committed one and outlives trainer runs: this
        # connection's version v goes to it as base + v, above whatever an earlier run committed
        committed = descriptor.get("committed_version")
        self.version_base = 0 if committed is None else int(committed) + 1
        self.packing = Packing(descriptor["packing"], descriptor["names"])
        self._conn, problems = open_channel(descriptor, ("weights", {}), timeout_s)
        if problems:
            raise TransportError(f"the SGLang worker refused the weight channel: {problems}")
        self.sender = WeightSender(self._conn, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        self._adapter: tuple[dict, Any, WeightSender] | None = None  # (spec, conn, sender)

    @classmethod
    def connect(cls, url: str, device: torch.device | str, **kwargs: Any) -> "SGLangTransport":
        return cls(pick_receiver(fetch_receivers(url), torch.device(device)), **kwargs)

    def sync(self, version: int, payload: Iterable[tuple[str, Any]], *, mode: str = "full"
             ) -> SyncStats:
        """Send ``payload`` ((name, tensor) in our names) as weight version ``version`` (the
        receiver records ``version_base + version``): plain tensors over the full channel,
        LoRA pairs over the adapter channel (module docstring). Raises ipc.WeightSyncError
        (a packing or adapter problem is a pre-write one: nothing sent)."""
        start = time.perf_counter()
        try:
            plain, pairs = split_payload(payload)
            named = list(self.packing.payload(plain))
            spec = adapter_spec(pairs, self.lora_scaling or 0.0) if pairs else None
        except ValueError as exc:
            raise WeightSyncError("pre-write", [str(exc)], version) from None
        problems = []
        if pairs and self.lora_scaling is None:
            problems.append("the payload holds LoRA pairs, but this transport was connected "
                            "without lora_scaling (LoRA adapter sync mode)")
        if mode == "adapter" and (plain or not pairs):
            problems.append(f"an adapter-mode sync carries LoRA pairs only ({len(plain)} plain "
                            f"tensors, {len(pairs)} pairs)")
        if problems:
            raise WeightSyncError("pre-write", problems, version)
        adapter_sender = self._adapter_sender(version, spec) if pairs else None
        parts = []
        if named or not pairs:
            parts.append(self.sender.sync(self.version_base + version, named, mode=mode))
        if pairs:
            parts.append(adapter_sender.sync(self.version_base + version,
                                             _pair_payload(pairs), mode="adapter"))
        if self.client is not None:
            self.client.committed_version = int(version)
        return _combined(parts, time.perf_counter() - start)

    def _adapter_sender(self, version: int, spec: dict) -> WeightSender:
        """The adapter channel for ``spec``: the open one, or a new one the worker checked."""
        if self._adapter is not None and self._adapter[0] == spec:
            return self._adapter[2]
        self._close_adapter()
        try:
            conn, problems = open_channel(self.descriptor, ("adapter", spec), self._timeout)
        except (TransportError, OSError) as exc:  # nothing sent yet: a retry may succeed
            raise WeightSyncError("pre-write", [f"cannot open the LoRA adapter channel: {exc}"],
                                  version) from None
        if problems:
            raise WeightSyncError("pre-write", [f"the SGLang worker refused the LoRA adapter: "
                                                f"{p}" for p in problems], version)
        sender = WeightSender(conn, bucket_bytes=self._bucket_bytes, timeout_s=self._timeout)
        self._adapter = (spec, conn, sender)
        return sender

    def _close_adapter(self) -> None:
        if self._adapter is not None:
            _, conn, sender = self._adapter
            self._adapter = None
            sender.close()
            conn.close()

    def close(self) -> None:
        self._close_adapter()
        self.sender.close()
        self._conn.close()


def _pair_payload(pairs: dict[str, tuple[Any, Any]]) -> list[tuple[str, Any]]:
    """The pairs under the names the worker stages them by."""
    out = []
    for layer, (a, b) in pairs.items():
        name_a, name_b = staged_names(layer)
        out += [(name_a, a), (name_b, b)]
    return out
