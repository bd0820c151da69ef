"""Trainer side of the weight sync: `WeightSender`.

Design choices:
- The manifest needs every (name, shape, dtype) before the first byte moves, so `sync`
  reads the whole iterable first. To stream a model that does not fit twice on the trainer
  GPU, pass DTensors (or `ipc.LazyTensor`s) instead of full tensors: their shape and dtype
  are known without gathering, and `full_tensor()` is then called bucket by bucket, in the
  manifest's order (every rank must pass the same sequence: it is a collective). A plain
  generator of full tensors works too, but then all of them are alive at once.
- Manifest, bucket plan and chunk tables are cached while the (name, shape, dtype) list stays
  the same, which it does step after step; per sync only source addresses move to the GPU,
  and when the same tensor objects come back at the same addresses (parameters updated in
  place) the scan itself is reused and nothing moves (see `_Scan`). The begin message then
  carries only the manifest's key, hash, count and bytes (the receiver caches the entries).
- Failures: a reject or a local problem found before the begin message -> stage
  "pre-write"; anything after the receiver accepted (including no answer to begin) ->
  "post-write". The sender never advances anything itself: the caller keeps its version and
  retries the same number.
"""
from __future__ import annotations

import contextlib
import hashlib
import operator
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ipc import _kernels
from ipc._copyplan import CopyPlan, fold_lanes
from ipc.checksum import combine, digest_header
from ipc.protocol import (PeerGone, SyncStats, Timeout, WeightSyncError, dtype_name, itemsize,
                          manifest_hash, numel, parse_dtype, pid_alive, plan_buckets,
                          recv_until, send)
from ipc.transport import (CudaMemory, IpcEvent, ShmMemory, local_device_by_uuid,
                           wait_event_host)


@dataclass
class _Manifest:
    key: list
    names: list[str]
    shapes: list[tuple[int, ...]]
    src_dtypes: list[torch.dtype]
    entries: list[tuple]
    header: dict
    digest: tuple
    plan: CopyPlan | None = None
    release_after: list[list[int]] | None = None


class _WriteFailure(Exception):
    pass


class WeightSender:
    """Pushes full tensors into one `WeightReceiver`.

    Args:
        conn: the sender end of `ipc.channel_pair()`.
        backend: "auto" (whatever the receiver exports), "shm" or "cuda".
        bucket_bytes: wire bytes per bucket: the unit of kernel launches and of lazy
            gathering (at most one bucket of DTensor/LazyTensor values is alive at a time).
        timeout_s: bound on each wait for the receiver or the GPU within a sync.
        copy_impl: "auto" (Triton for CUDA, torch for CPU), "triton" or "torch".
    """

    def __init__(self, conn, *, backend: str = "auto", bucket_bytes: int = 512 << 20,
                 timeout_s: float = 60.0, copy_impl: str = "auto"):
        problems = []
        if backend not in ("auto", "shm", "cuda"):
            problems.append(f"backend must be 'auto', 'shm' or 'cuda', not {backend!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < (1 << 16):
            problems.append(f"bucket_bytes must be an int >= 65536, got {bucket_bytes!r}")
        if not timeout_s or timeout_s <= 0:
            problems.append(f"timeout_s must be > 0, got {timeout_s!r}")
        if copy_impl not in ("auto", "triton", "torch"):
            problems.append(f"copy_impl must be 'auto', 'triton' or 'torch', not {copy_impl!r}")
        if problems:
            raise ValueError("WeightSender: " + "; ".join(problems))
        self._conn = conn
        self._backend_arg = backend
        self._bucket_bytes = bucket_bytes
        self._timeout = float(timeout_s)
        self._copy_impl = copy_impl
        self._seq = 0
        self._layout: dict[str, tuple] | None = None
        self._verify = ""
        self.backend = ""
        self._peer_pid: int | None = None
        self._mem = None
        self._device = torch.device("cpu")
        self._free_event: IpcEvent | None = None
        self._written_event: IpcEvent | None = None
        self._event_exported = False
        self.handle_opens = 0
        self._manifest: _Manifest | None = None
        self._sent_keys: set[str] = set()
        self._last_scan: _Scan | None = None

    # ---------------------------------------------------------------- public
    @property
    def bucket_bytes(self) -> int:
        return self._bucket_bytes

    @bucket_bytes.setter
    def bucket_bytes(self, value: int) -> None:
        """Takes effect at the next sync (the cached plan is rebuilt)."""
        if not isinstance(value, int) or value < (1 << 16):
            raise ValueError(f"bucket_bytes must be an int >= 65536, got {value!r}")
        self._bucket_bytes = value
        self._manifest = None

    def sync(self, version: int, tensors, *, mode: str = "full") -> SyncStats:
        """Write `tensors` (dict or iterable of (name, tensor)) as weight version `version`.
        Returns SyncStats; raises WeightSyncError naming every problem on failure."""
        t0 = time.perf_counter()
        opens0 = self.handle_opens
        scan = _Scan(*_items(tensors), last=self._last_scan)
        self._last_scan = scan.memo()
        local = [] if isinstance(version, int) and version >= 0 else [
            f"version must be a non-negative int, got {version!r}"]
        local += scan.problems
        if local:
            raise WeightSyncError("pre-write", local, version)
        try:
            problems = self._connect(t0 + self._timeout)
        except (PeerGone, Timeout) as exc:
            problems = [f"receiver did not answer hello: {_why(exc)}"]
        if problems:
            raise WeightSyncError("pre-write", problems, version)
        m = self._get_manifest(scan)
        local = self._device_problems(scan)
        if local:
            raise WeightSyncError("pre-write", local, version)
        seq = self._next_seq()
        t_begin = time.perf_counter()
        reply = self._begin(seq, version, mode, m)
        if reply[0] == "reject":
            raise WeightSyncError("pre-write", reply[2], version)
        t_write = time.perf_counter()
        try:
            with _on_device(self._device), torch.no_grad():  # kernels use the current device
                lanes, launches = self._write(m, scan, t_write + self._timeout)
        except Exception as exc:  # anything after the accept leaves the receiver dirty
            why = str(exc) if isinstance(exc, _WriteFailure) else \
                f"writing failed: {type(exc).__name__}: {exc}"
            self._abort(seq, why)
            raise WeightSyncError("post-write", [why], version) from exc
        checksum = combine(m.digest, lanes)
        report = {"count": len(m.names), "nbytes": m.header["nbytes"],
                  "buckets": len(m.plan.buckets), "checksum": checksum,
                  "lanes": lanes.astype("<u4").tobytes()}
        t_end = time.perf_counter()
        self._commit(seq, version, report, t_end + self._timeout)
        t1 = time.perf_counter()
        return SyncStats(
            version=version, mode=mode, tensors=len(m.names), bytes=m.header["nbytes"],
            seconds=t1 - t0, buckets=len(m.plan.buckets), launches=launches,
            handle_opens=self.handle_opens - opens0, checksum=checksum, backend=self.backend,
            verify=self._verify,
            timings={"prepare": t_begin - t0, "begin": t_write - t_begin,
                     "write": t_end - t_write, "commit": t1 - t_end})

    def _commit(self, seq: int, version: int, report: dict, deadline: float) -> None:
        """Send the end of the version and wait for the receiver to commit the same checksum."""
        try:
            send(self._conn, ("end", seq, version, report))
            reply = recv_until(self._conn, deadline, self._peer_pid, seq=seq)
        except (PeerGone, Timeout) as exc:
            raise WeightSyncError("post-write", [f"no commit from the receiver: {_why(exc)}"],
                                  version) from None
        if reply[0] != "committed":
            raise WeightSyncError("post-write", list(reply[2]) if len(reply) > 2 else
                                  [f"unexpected reply {reply[0]!r}"], version)
        if reply[2] != report["checksum"]:
            raise WeightSyncError("post-write", [f"receiver committed checksum {reply[2]}, "
                                                 f"sender computed {report['checksum']}"], version)

    def close(self) -> None:
        """Say goodbye and close the opened handles (the receiver's weights stay valid)."""
        try:
            send(self._conn, ("bye", self._next_seq()))
        except PeerGone:
            pass
        if self._mem is not None and self.backend == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self._device))
            wait_event_host(done, time.perf_counter() + 5.0, lambda: True)
        for ev in (self._free_event, self._written_event):
            if ev is not None:
                ev.close()
        self._free_event = self._written_event = None
        self._mem = None  # the last reference closes the IPC memory handle
        self._layout = None

    # ---------------------------------------------------------------- connection
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _connect(self, deadline: float) -> list[str]:
        """First sync only: fetch the layout, open memory and events. Returns problems."""
        if self._layout is not None:
            return []
        seq = self._next_seq()
        send(self._conn, ("hello", seq, {"pid": os.getpid()}))
        layout = recv_until(self._conn, deadline, None, seq=seq)[2]
        problems = []
        backend = layout["backend"]
        if self._backend_arg not in ("auto", backend):
            problems.append(f"sender wants backend {self._backend_arg!r}, the receiver "
                            f"exports {backend!r}")
        export = layout["export"]
        if not problems and backend == "cuda":
            index = local_device_by_uuid(export["uuid"])
            if index is None:
                problems.append(f"the engine's GPU {export['uuid']} is not visible to the "
                                "sender (check CUDA_VISIBLE_DEVICES)")
            else:
                self._device = torch.device("cuda", index)
                self._mem = CudaMemory.open(export, index)
                self._free_event = IpcEvent.open(layout["free_event"], index)
                self._written_event = IpcEvent.create(index)
                self.handle_opens += 2
        elif not problems:
            try:
                self._mem = ShmMemory.open(export)
                self.handle_opens += 1
            except (OSError, RuntimeError) as exc:
                problems.append(f"cannot open the receiver's shared memory: {exc}")
        if problems:
            return problems
        self.backend = backend
        self._verify = layout["verify"]
        self._peer_pid = layout["pid"]
        self._layout = {n: (off, tuple(shape), parse_dtype(dt))
                        for n, off, shape, dt in layout["entries"]}
        return []

    def _begin(self, seq: int, version: int, mode: str, m: _Manifest) -> tuple:
        header = dict(m.header)
        if self.backend == "cuda" and not self._event_exported:
            header["written_event"] = self._written_event.handle
            header["uuid"] = self._mem.export()["uuid"]
        entries = None if m.header["key"] in self._sent_keys else m.entries
        deadline = time.perf_counter() + self._timeout
        try:
            for _ in range(2):
                send(self._conn, ("begin", seq, version, mode, header, entries))
                reply = recv_until(self._conn, deadline, self._peer_pid, seq=seq)
                if reply[0] == "reject" and len(reply) > 3 and reply[3] and entries is None:
                    entries = m.entries  # the receiver forgot this manifest: send it again
                    continue
                break
        except (PeerGone, Timeout) as exc:
            # The receiver may have accepted (and marked itself dirty) before we lost it.
            raise WeightSyncError("post-write", [f"no answer to begin: {_why(exc)}"],
                                  version) from None
        self._sent_keys.add(m.header["key"])
        if "written_event" in header and reply[0] == "accept":
            self._event_exported = True
        return reply

    def _abort(self, seq: int, reason: str) -> None:
        try:
            send(self._conn, ("abort", seq, reason))
            recv_until(self._conn, time.perf_counter() + min(self._timeout, 5.0),
                       self._peer_pid, seq=seq)
        except (PeerGone, Timeout):
            pass

    # ---------------------------------------------------------------- manifest
    def _get_manifest(self, scan: "_Scan") -> _Manifest:
        m = self._manifest
        if m is not None and (m.key is scan.key or m.key == scan.key):
            return m
        names = list(scan.names)
        shapes = [tuple(int(d) for d in s) for s in scan.shapes]
        src = list(scan.dtypes)
        wire = [self._layout[n][2] if n in self._layout else d for n, d in zip(names, src)]
        entries = [(n, s, dtype_name(a), dtype_name(b))
                   for n, s, a, b in zip(names, shapes, src, wire)]
        nbytes = sum(numel(s) * itemsize(w) for s, w in zip(shapes, wire))
        header = {"count": len(entries), "nbytes": nbytes, "hash": manifest_hash(entries),
                  # identifies the full entries (source dtypes too) for the receiver's cache
                  "key": hashlib.sha256(repr(entries).encode()).hexdigest()}
        self._manifest = _Manifest(scan.key, names, shapes, src, entries, header,
                                   digest_header(names, wire, shapes))
        return self._manifest

    def _plan(self, m: _Manifest) -> CopyPlan:
        if m.plan is None:
            offsets = [self._layout[n][0] for n in m.names]
            dst = [self._layout[n][2] for n in m.names]
            numels = [numel(s) for s in m.shapes]
            buckets = plan_buckets(numels, [itemsize(d) for d in dst], self._bucket_bytes)
            use_kernel = _kernels.triton_available() and (
                self._copy_impl == "triton" or (self._copy_impl == "auto"
                                                and self.backend == "cuda"))
            m.plan = CopyPlan(buckets, offsets, numels, m.src_dtypes, dst, self._device,
                              use_kernel)
            last = {}
            for b, bucket in enumerate(buckets):
                for k, _, _ in bucket:
                    last[k] = b
            m.release_after = [[] for _ in buckets]
            for k, b in last.items():
                m.release_after[b].append(k)
        return m.plan

    def _device_problems(self, scan: "_Scan") -> list[str]:
        if self.backend != "cuda":
            return []
        if scan.plain:
            bad = np.nonzero((scan.devs != -1) & (scan.devs != self._device.index))[0]
            return [f"{scan.names[k]!r} is on cuda:{scan.devs[k]}, the engine is on "
                    f"{self._device}" for k in bad]
        return [f"{n!r} is on {v.device}, the engine is on {self._device}"
                for n, v in zip(scan.names, scan.values) if isinstance(v, torch.Tensor)
                and not _is_lazy(v) and v.device.type == "cuda" and v.device != self._device]

    # ---------------------------------------------------------------- writing
    def _write(self, m: _Manifest, scan: "_Scan", deadline: float) -> tuple[np.ndarray, int]:
        plan = self._plan(m)
        cuda = self.backend == "cuda"
        stream = torch.cuda.current_stream(self._device) if cuda else None
        if cuda:
            self._free_event.wait(stream)  # GPU fence: the engine finished reading
        mem = self._mem.tensor
        sums = plan.new_sums()
        extra: list = []
        if scan.ready_on(self._device.index if cuda else -1):
            # the common case: full tensors already where the kernel can read them
            for b in range(len(plan.buckets)):
                plan.run_bucket(b, mem, scan.ptrs, scan.values, sums, extra, store=True)
        else:
            self._write_general(m, plan, scan, mem, sums, extra, stream)
        n = len(scan.names)
        if not cuda:
            return fold_lanes(sums.numpy(), [(k, t.tolist()) for k, t in extra], n), \
                plan.n_launches
        self._written_event.record(stream)
        host = torch.empty(sums.shape, dtype=torch.int32, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        extra_host = []
        for k, t in extra:
            h = torch.empty(2, dtype=torch.int64, pin_memory=True)
            h.copy_(t, non_blocking=True)
            extra_host.append((k, h))
        done = torch.cuda.Event()
        done.record(stream)
        if not wait_event_host(done, deadline, lambda: pid_alive(self._peer_pid)):
            gone = not pid_alive(self._peer_pid)
            raise _WriteFailure("the engine process exited while its fence was pending"
                                if gone else f"GPU copy not finished within "
                                f"{self._timeout:g} s (engine stuck or GPU hung)")
        return fold_lanes(host.numpy(), [(k, h.tolist()) for k, h in extra_host], n), \
            plan.n_launches

    def _write_general(self, m, plan, scan, mem, sums, extra, stream) -> None:
        """Sources gathered (lazy values) or fixed up (device, layout) bucket by bucket."""
        src_ptrs = np.zeros(len(scan.names), dtype=np.int64)
        sources: dict[int, torch.Tensor] = {}
        for b, bucket in enumerate(plan.buckets):
            for k, _, _ in bucket:
                if k not in sources:
                    sources[k] = self._source(m, k, scan.values[k])
                    src_ptrs[k] = sources[k].data_ptr()
            plan.run_bucket(b, mem, src_ptrs, sources, sums, extra, store=True)
            for k in m.release_after[b]:
                t = sources.pop(k)
                if stream is not None and t.device.type == "cuda":
                    t.record_stream(stream)  # freed before the copy ran: keep it safe

    def _source(self, m: _Manifest, k: int, value: Any) -> torch.Tensor:
        """Entry k's full tensor, on the right device, contiguous and 16-byte aligned."""
        t = value.full_tensor() if _is_lazy(value) else value
        if not isinstance(t, torch.Tensor):
            raise _WriteFailure(f"{m.names[k]!r}: full_tensor() returned {type(t).__name__}")
        if tuple(t.shape) != m.shapes[k] or t.dtype != m.src_dtypes[k]:
            raise _WriteFailure(f"{m.names[k]!r}: produced {tuple(t.shape)} {t.dtype}, "
                                f"declared {m.shapes[k]} {m.src_dtypes[k]}")
        t = t.detach()
        if t.device != self._device:
            t = t.to(self._device)
        if not t.is_contiguous() or t.data_ptr() % 16:
            t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
        return t


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_DATA_PTR = torch.Tensor.data_ptr
_SHAPE = operator.attrgetter("shape")
_DEREF = weakref.ref.__call__


class _Scan:
    """One pass over the payload. For plain tensors it also collects data pointers,
    contiguity and device in the same comprehension.

    Per-tensor Python cost is what bounds the adapter sync (1,440 tensors): attribute reads
    and `zip(*items)` cost milliseconds, identity and data-pointer compares a fraction of one
    (figures: bench/reports/2026-11-29_h200_code-choices.md). So when the same tensor objects come back at
    the same addresses with the same shapes (parameters updated in place, step after step),
    everything else is reused from `last`: dtype, contiguity and device of an object cannot
    change without its data pointer or shape changing, except by rebinding `.data` to a
    same-address, same-shape view of another dtype or layout, which nothing in training does.
    The previous payload is held through weak references (holding it strongly would keep
    a step's worth of temporary tensors alive)."""

    def __init__(self, names: tuple, values: tuple, last: "_Scan | None" = None):
        self.names, self.values = names, values
        self.problems: list[str] = []
        self._ready: dict[int, bool] = {}
        self.reused = False
        if last is not None and last.refs is not None and len(values) == len(last.refs) \
                and names == last.names and all(map(operator.is_, values,
                                                    map(_DEREF, last.refs))):
            ptr_tuple = tuple(map(_DATA_PTR, values))
            shapes = tuple(map(_SHAPE, values))
            if ptr_tuple == last.ptr_tuple and shapes == last.shapes:
                self.__dict__.update({k: v for k, v in last.__dict__.items()
                                      if k not in ("names", "values")})
                self.reused = True
                return
        self.plain = all(map(_PLAIN.__contains__, map(type, values)))
        self.ptrs = self.devs = self.contig = self.refs = self.ptr_tuple = None
        if self.plain and values:
            meta = [(v.shape, v.dtype, v.data_ptr(), v.is_contiguous(), v.get_device())
                    for v in values]
            self.shapes, self.dtypes, ptrs, contig, devs = zip(*meta)
            self.ptr_tuple = ptrs
            self.ptrs = np.array(ptrs, dtype=np.int64)
            self.contig = np.array(contig, dtype=bool)
            self.devs = np.array(devs, dtype=np.int64)
            self.refs = tuple(map(weakref.ref, values))
        else:
            self.problems = [f"{n!r}: not a tensor ({type(v).__name__})"
                             for n, v in zip(names, values) if not _is_tensorish(v)]
            self.shapes = tuple(getattr(v, "shape", ()) for v in values)
            self.dtypes = tuple(getattr(v, "dtype", None) for v in values)
        self.key = (self.names, self.shapes, self.dtypes)

    def memo(self) -> "_Scan":
        """This scan without its values (what the next sync compares against)."""
        out = object.__new__(_Scan)
        out.__dict__ = {**self.__dict__, "values": None}
        return out

    def ready_on(self, index: int) -> bool:
        """Every value a contiguous, 16-byte aligned tensor on CUDA device `index` (-1: CPU)."""
        hit = self._ready.get(index)
        if hit is None:
            hit = self._ready[index] = (
                self.ptrs is not None and bool(self.contig.all())
                and not (self.ptrs % 16).any() and bool((self.devs == index).all()))
        return hit


def _items(tensors) -> tuple[tuple, tuple]:
    """(names, values) of a dict or an iterable of (name, tensor) pairs."""
    if isinstance(tensors, dict):
        return tuple(tensors), tuple(tensors.values())
    items = list(tensors)
    bad = [repr(x)[:40] for x in items if not (isinstance(x, tuple) and len(x) == 2)]
    if bad:
        raise WeightSyncError("pre-write", [f"expected (name, tensor) pairs, got {', '.join(bad)}"])
    return tuple(map(operator.itemgetter(0), items)), tuple(map(operator.itemgetter(1), items))


def _on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _is_lazy(v) -> bool:
    return callable(getattr(v, "full_tensor", None))


def _is_tensorish(v) -> bool:
    return isinstance(v, torch.Tensor) or (
        _is_lazy(v) and hasattr(v, "shape") and hasattr(v, "dtype"))


def _why(exc: Exception) -> str:
    if isinstance(exc, Timeout):
        return "timed out"
    return f"the receiver went away ({exc})" if str(exc) else "the receiver went away"
