"""Backend-independent protocol: errors, stats, manifest, bucket planner, checks, channel.

A sync is a short conversation over one duplex pipe (all messages are small tuples):

    sender                                    receiver
    ("hello", seq, info)             ──▶      (first sync only)
                                     ◀──      ("layout", seq, layout)   opened once, counted
    ("begin", seq, v, mode, header, entries?) ──▶ manifest + state checked, nothing written yet
                                     ◀──      ("reject", seq, problems) | ("accept", seq)
    bucket writes straight into the receiver's weights (no messages)
    ("end", seq, v, report)          ──▶      verify (checksums), then commit version v
                                     ◀──      ("failed", seq, problems) | ("committed", seq, sum)
    ("abort", seq, reason)           ──▶      the sender failed after writing began

Every wait has a deadline and also watches the peer's pid, so a dead peer fails the sync in
well under the timeout. `seq` pairs replies with requests, so a late reply to an abandoned
sync is never taken for the answer to a retry.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

MODES = ("full", "adapter", "merge")
# NOTE: split points of a tensor bigger than a bucket fall on multiples of 4096 words, so every
# piece starts 16-byte aligned whatever the dtype (the kernel's vector loads rely on it).
SPLIT_ALIGN = 4096
SLOT_ALIGN = 256  # byte alignment of each tensor inside transport memory


class WeightSyncError(RuntimeError):
    """A sync that did not commit. `stage` is "pre-write" (the receiver's weights and version
    are untouched) or "post-write" (the receiver is dirty and refuses to serve until a sync of
    the same version succeeds). `problems` names every problem found."""

    def __init__(self, stage: str, problems: Sequence[str], version: int | None = None):
        self.stage = stage
        self.problems = list(problems)
        self.version = version
        head = f"weight sync{'' if version is None else f' of version {version}'} failed " \
               f"({stage})"
        super().__init__(head + ":\n  - " + "\n  - ".join(self.problems))


@dataclass
class SyncStats:
    """What one committed sync did (seconds are host wall time, full tensors ready ->
    version committed on the receiver, verification included)."""

    version: int
    mode: str
    tensors: int
    bytes: int                 # weight bytes written (in the receiver's dtypes)
    seconds: float
    buckets: int
    launches: int              # copy kernel launches (+ torch copies for odd dtypes)
    handle_opens: int          # IPC memory/event handles opened during this sync (0 after the 1st)
    checksum: str
    backend: str
    verify: str
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class LazyTensor:
    """A tensor produced only when its bucket is written: `produce()` must return a tensor of
    `shape` and `dtype`. DTensors are handled the same way (`full_tensor()` per bucket); use
    this for computed payloads such as merged LoRA weights."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Any

    def full_tensor(self) -> torch.Tensor:
        return self.produce()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Floating types cast among themselves on the wire; anything else must match exactly."""
    return src == dst or (src.is_floating_point and dst.is_floating_point)


def manifest_hash(entries: Sequence[tuple]) -> str:
    """SHA-256 of the ordered (name, shape, wire dtype) list."""
    h = hashlib.sha256()
    for name, shape, _src, wire in entries:
        h.update(f"{name}\x1f{','.join(map(str, shape))}\x1f{wire}\x1e".encode())
    return h.hexdigest()


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def manifest_nbytes(entries: Sequence[tuple]) -> int:
    return sum(numel(shape) * itemsize(parse_dtype(wire)) for _n, shape, _s, wire in entries)


def plan_buckets(numels: Sequence[int], itemsizes: Sequence[int], bucket_bytes: int
                 ) -> list[list[tuple[int, int, int]]]:
    """Tensors in order into buckets of at most `bucket_bytes` (counted in wire bytes).

    Each bucket is a list of pieces (tensor index, first element, element count). A tensor
    that does not fit in the current bucket starts a new one; a tensor bigger than a whole
    bucket is split into bucket-sized pieces (split points on multiples of SPLIT_ALIGN
    elements). Empty tensors are zero-length pieces, so they still travel in the manifest.
    """
    buckets: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = 0
    for k, (n, size) in enumerate(zip(numels, itemsizes)):
        nbytes = n * size
        if used + nbytes <= bucket_bytes:
            current.append((k, 0, n))
            used += nbytes
            continue
        if current:
            buckets.append(current)
        current, used = [], 0
        if nbytes <= bucket_bytes:
            current, used = [(k, 0, n)], nbytes
            continue
        cap = max(SPLIT_ALIGN, (bucket_bytes // size) // SPLIT_ALIGN * SPLIT_ALIGN)
        for first in range(0, n, cap):
            count = min(cap, n - first)
            if first + count < n:
                buckets.append([(k, first, count)])
            else:
                current, used = [(k, first, count)], count * size
    if current:
        buckets.append(current)
    return buckets


def check_manifest(header: dict, entries: Sequence[tuple], mode: str,
                   layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                   modes: dict[str, list[str]]) -> list[str]:
    """Every problem with a begin request's manifest, checked against the receiver's layout.
    Returns [] when the sync may start writing."""
    problems: list[str] = []
    if header.get("count") != len(entries):
        problems.append(f"manifest count {header.get('count')} but {len(entries)} entries listed")
    try:
        nbytes = manifest_nbytes(entries)
    except ValueError as exc:
        problems.append(f"manifest names an unknown dtype: {exc}")
        nbytes = None
    if nbytes is not None and header.get("nbytes") != nbytes:
        problems.append(f"manifest total {header.get('nbytes')} bytes but its entries add up "
                        f"to {nbytes}")
    if header.get("hash") != manifest_hash(entries):
        problems.append("manifest hash does not match its (name, shape, dtype) list")
    if mode not in modes:
        problems.append(f"unknown sync mode {mode!r} (the engine serves {sorted(modes)})")
        return problems
    allowed = set(modes[mode])
    seen: dict[str, int] = {}
    unknown, outside, shape_bad, dtype_bad = [], [], [], []
    for name, shape, src, wire in entries:
        seen[name] = seen.get(name, 0) + 1
        if name not in layout:
            unknown.append(name)
            continue
        if name not in allowed:
            outside.append(name)
        want_shape, want_dtype = layout[name]
        if tuple(shape) != tuple(want_shape):
            shape_bad.append(f"{name}: sent {tuple(shape)}, engine has {tuple(want_shape)}")
        try:
            src_dt, wire_dt = parse_dtype(src), parse_dtype(wire)
        except ValueError as exc:
            dtype_bad.append(f"{name}: {exc}")
            continue
        if wire_dt != want_dtype:
            dtype_bad.append(f"{name}: wire dtype {wire}, engine holds {dtype_name(want_dtype)}")
        elif not castable(src_dt, wire_dt):
            dtype_bad.append(f"{name}: cannot cast {src} to the engine's {wire}")
    dups = [f"{n} (x{c})" for n, c in seen.items() if c > 1]
    missing = [n for n in modes[mode] if n not in seen]
    for label, items in (("unknown tensors (the engine has no such weight)", unknown),
                         (f"tensors outside mode {mode!r}", outside),
                         ("duplicate tensors", dups),
                         (f"missing tensors required by mode {mode!r}", missing),
                         ("shape mismatch", shape_bad), ("dtype mismatch", dtype_bad)):
        if items:
            problems.append(f"{label} ({len(items)}): {', '.join(items)}")
    return problems


# ---------------------------------------------------------------------------------------
# Channel
# ---------------------------------------------------------------------------------------

def channel_pair():
    """(sender_end, receiver_end): a duplex pipe whose ends pickle into spawned processes.

    Pass receiver_end to the engine process at start, then close this process's copy of it,
    so that the receiver's death reads as end-of-file here (liveness is also watched by pid).
    """
    return mp.get_context("spawn").Pipe(duplex=True)


def pid_alive(pid: int | None) -> bool:
    """False once `pid` has exited (a zombie counts as exited)."""
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class PeerGone(Exception):
    """The peer exited or closed its end."""


class Timeout(Exception):
    """No message before the deadline."""


# NOTE: a pipe poll wakes as soon as data arrives; the slice only bounds how often the peer's
# pid is checked (a cheap check), so it costs no latency on the happy path.
_POLL_SLICE_S = 0.05


def recv_until(conn, deadline: float, peer_pid: int | None, *, seq: int | None = None,
               stop=None) -> tuple:
    """Next message (with a matching seq, if given) before `deadline` (perf_counter time)."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise Timeout()
        if stop is not None and stop.is_set():
            raise PeerGone("closing")
        try:
            ready = conn.poll(min(remaining, _POLL_SLICE_S))
        except (EOFError, OSError) as exc:
            raise PeerGone(str(exc)) from exc
        if not ready:
            if not pid_alive(peer_pid):
                raise PeerGone(f"process {peer_pid} exited")
            continue
        try:
            msg = conn.recv()
        except (EOFError, OSError) as exc:
            raise PeerGone(str(exc) or "end of file") from exc
        if seq is None or (len(msg) > 1 and msg[1] == seq):
            return msg
        # a late reply to an abandoned request: drop it


def send(conn, msg: tuple) -> None:
    try:
        conn.send(msg)
    except (EOFError, OSError, BrokenPipeError) as exc:
        raise PeerGone(str(exc) or "broken pipe") from exc
