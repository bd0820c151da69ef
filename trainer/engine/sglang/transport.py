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
"""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from multiprocessing.connection import Client
from typing import Any, Iterable, Iterator

import torch

from ipc import LazyTensor, SyncStats, WeightSender
from trainer.engine.sglang.receiver import ROUTE


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


class Packing:
    """Where each sent tensor lands: (served name, section, sections), from a worker's rules
    (section and sections None for a tensor served whole, under its name or a renamed one)."""

    def __init__(self, rules: Iterable[list[Any]], served_names: Iterable[str]) -> None:
        self.rules = [(re.compile(p), target, None if k is None else int(k),
                       None if n is None else int(n)) for p, target, k, n in rules]
        self.served = set(served_names)

    def place(self, name: str) -> tuple[str, int | None, int | None]:
        if name in self.served:  # SGLang maps only a name its module lacks
            return name, None, None
        for pattern, target, section, sections in self.rules:
            if pattern.match(name) is None:
                continue
            served = pattern.sub(target, name)
            if served in self.served:  # SGLang packs only into a parameter it holds
                return served, section, sections
        return name, None, None

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


class SGLangTransport:
    """An ``ipc.WeightSender`` connected to one SGLang worker's receiver. Drop-in beside the
    stock ``SGLangWeightSync``: ``sync(version, payload, mode=)`` returns stats with the same
    seconds / bytes / tensors / checksum / timings fields, and verifies every sync itself.
    ``client``: the server's ``SGLangEngineClient``, whose ``committed_version`` (echoed as
    each rollout's policy version) advances only after a committed sync."""

    self_verifying = True  # the receiver compares checksums before it commits

    def __init__(self, descriptor: dict[str, Any], *, bucket_bytes: int = 512 << 20,
                 timeout_s: float = 60.0, client: Any = None) -> None:
        self.descriptor, self.client = descriptor, client
        # the receiver refuses versions below its committed one and outlives trainer runs: this
        # connection's version v goes to it as base + v, above whatever an earlier run committed
        committed = descriptor.get("committed_version")
        self.version_base = 0 if committed is None else int(committed) + 1
        self.packing = Packing(descriptor["packing"], descriptor["names"])
        self._conn = Client(descriptor["address"], family="AF_UNIX",
                            authkey=bytes.fromhex(descriptor["authkey"]))
        self.sender = WeightSender(self._conn, bucket_bytes=bucket_bytes, timeout_s=timeout_s)

    @classmethod
    def connect(cls, url: str, device: torch.device | str, **kwargs: Any) -> "SGLangTransport":
        return cls(pick_receiver(fetch_receivers(url), torch.device(device)), **kwargs)

    def sync(self, version: int, payload: Iterable[tuple[str, Any]], *, mode: str = "full"
             ) -> SyncStats:
        """Send ``payload`` ((name, tensor) in our names) as weight version ``version`` (the
        receiver records ``version_base + version``).
        Raises ipc.WeightSyncError (a packing problem is a pre-write one: nothing sent)."""
        from ipc import WeightSyncError

        try:
            named = list(self.packing.payload(payload))
        except ValueError as exc:
            raise WeightSyncError("pre-write", [str(exc)], version) from None
        stats = self.sender.sync(self.version_base + version, named, mode=mode)
        if self.client is not None:
            self.client.committed_version = int(version)
        return stats

    def close(self) -> None:
        self.sender.close()
        self._conn.close()
