"""Engine side of the weight sync: `WeightReceiver`.

Design choices:
- The engine's tensors are re-homed, once, into one transport allocation (each tensor
  256-byte aligned, in the order given), and rebound in place (`t.data = view`), so the module
  keeps using them and the sender writes each byte exactly once, straight into the weights.
  Pass the module's parameter/buffer objects (named_parameters()/named_buffers()), not
  state_dict() values: rebinding a state_dict alias would leave the module on old storage.
  A tensor whose `.data` is rebound later (e.g. an offload that moves it) is caught at the
  next begin and rejected before writing.
- `modes` lists the names each mode must cover; a mode it omits covers every name.
- verify="full" (default): after the writes the receiver recomputes every synced tensor's
  checksum from its own memory and compares it, per tensor, with what the sender's fused
  copy computed; that costs one extra read of the synced bytes. verify="fused" trusts the
  fused checksum (sender side) plus the manifest's counts: no second pass.
  "full" stays the default on both backends although it costs one read of the synced bytes
  (bench/reports/2026-11-29_h200_code-choices.md). With
  "fused" nobody reads the receiver's memory: the sender checksums the registers it stores,
  the receiver echoes those lanes, so a write that lands wrong (bad offset, a peer
  scribbling, a fault injected after the copy, as the tests do) commits undetected. Choose
  "fused" where that risk is accepted for speed.
- dirty: set when a sync is accepted (before any write) and cleared by its commit; a failure
  after acceptance leaves it set with the reason. While dirty, only a retry of the same
  version that covers every dirty tensor is accepted.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from ipc import _kernels
from ipc._copyplan import CopyPlan, fold_lanes
from ipc.checksum import combine, digest_header
from ipc.protocol import (MODES, SLOT_ALIGN, PeerGone, Timeout, WeightSyncError,
                          check_manifest, dtype_name, recv_until, send)
from ipc.transport import CudaMemory, IpcEvent, ShmMemory, cupy_runtime, wait_event_host

log = logging.getLogger(__name__)
_MANIFEST_CACHE = 64


@dataclass
class _Checked:
    problems: list[str]
    idx: np.ndarray | None       # layout index of each manifest entry
    nbytes: int
    digest: tuple | None         # digest_header of the entries


class WeightReceiver:
    """Serves weight syncs into `params` (the engine's live tensors, by engine name).

    Args:
        conn: the receiver end of `ipc.channel_pair()`, or any connection with the same
            send/recv/poll methods (`multiprocessing.connection.Client/Listener`); None to
            re-home the weights now and take the sender's connection later (`serve`).
        params: name -> tensor; all on one device (CPU: "shm" backend, CUDA: "cuda").
        modes: mode ("full", "adapter", "merge") -> exact names a sync of that mode covers.
        backend: "auto", "shm" or "cuda".
        timeout_s: bound on every wait for the sender within a sync.
        verify: "full" or "fused" (see the module docstring).
        version: the version of the weights as loaded.
        on_commit: called as ``on_commit(version, mode)`` on the receiver's thread after a
            sync commits and before the sender hears of it (an engine re-derives what it
            serves from the new weights there: the sender's next request sees the result).
        before_commit: called as ``before_commit(version, mode)`` on the receiver's thread once
            every checksum matched and before the version commits. An exception fails the
            sync like a checksum mismatch (post-write: the synced tensors stay dirty, only a
            retry of the same version is accepted) and its message reaches the sender. For an
            engine that serves something built from the synced tensors (a staged adapter it
            merges): the build happens here, so a build that fails never commits.
    """

    def __init__(self, conn, params: Mapping[str, torch.Tensor], *,
                 modes: Mapping[str, list[str]] | None = None, backend: str = "auto",
                 timeout_s: float = 60.0, verify: str = "full", version: int = 0,
                 on_commit=None, before_commit=None):
        names, tensors, backend, device = _validate(params, modes, backend, timeout_s, verify,
                                                    version)
        self._conn = conn
        self._on_commit = on_commit
        self._before_commit = before_commit
        self._timeout = float(timeout_s)
        self._verify = verify
        self.backend = backend
        self._device = device
        self._names = names
        self._tensors = tensors
        self._shapes = [tuple(t.shape) for t in tensors]
        self._dtypes = [t.dtype for t in tensors]
        self._numels = [t.numel() for t in tensors]
        self._offsets, total = [], 0
        for t in tensors:
            total = -(-total // SLOT_ALIGN) * SLOT_ALIGN
            self._offsets.append(total)
            total += t.numel() * t.element_size()
        total = -(-total // SLOT_ALIGN) * SLOT_ALIGN
        if backend == "cuda":
            self._mem = CudaMemory.allocate(total, device.index)
        else:
            self._mem = ShmMemory.create(total)
        mem = self._mem.tensor
        with torch.no_grad():
            for t, off in zip(tensors, self._offsets):
                view = mem[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                view.copy_(t.detach())
                t.data = view
        if backend == "cuda":
            torch.cuda.synchronize(device)  # NOTE: host sync, once at construction
        self._expected_ptrs = [t.data_ptr() for t in tensors]
        self._index = {n: k for k, n in enumerate(names)}
        modes = dict(modes or {})
        self._modes = {m: list(modes.get(m, names)) for m in MODES}
        self._layout_map = {n: (s, d) for n, s, d in zip(names, self._shapes, self._dtypes)}
        self._version = int(version)
        self._dirty = np.zeros(len(names), dtype=bool)  # tensors possibly half-written
        self._n_dirty = 0
        self._dirty_version: int | None = None
        self._dirty_reason = ""
        self._state_lock = threading.Lock()
        self._busy = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sender_pid: int | None = None
        self._manifests: OrderedDict[str, list] = OrderedDict()
        self._checked: dict[tuple, _Checked] = {}
        self._readers: dict[tuple, CopyPlan] = {}
        self._watched: dict[int, tuple] = {}
        self.handle_opens = 0
        self._free_event = IpcEvent.create(device.index) if backend == "cuda" else None
        self._written_event: IpcEvent | None = None
        self._all_digest = digest_header(names, self._dtypes, self._shapes)

    # ---------------------------------------------------------------- public state
    @property
    def version(self) -> int:
        with self._state_lock:
            return self._version

    @property
    def dirty(self) -> bool:
        with self._state_lock:
            return self._n_dirty > 0

    def assert_servable(self) -> None:
        """Raise WeightSyncError if the weights may be partly written (call before generate)."""
        with self._state_lock:
            if not self._n_dirty:
                return
            v, reason, n = self._dirty_version, self._dirty_reason, self._n_dirty
        raise WeightSyncError("post-write", [
            f"engine weights are dirty ({n} tensors): {reason}; a sync of version {v} must "
            f"succeed before generating"], version=v)

    def checksum(self) -> str:
        """Checksum over the current weights (equal to `ipc.weights_checksum` of them)."""
        with self._busy:
            idx = np.arange(len(self._names))
            return combine(self._all_digest, self._lanes(("all",), idx))

    def start(self) -> "WeightReceiver":
        """Serve syncs on a background thread."""
        if self._conn is None:
            raise ValueError("WeightReceiver.start: no connection yet (call serve(conn))")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="weight-receiver",
                                            daemon=True)
            self._thread.start()
        return self

    def serve(self, conn) -> "WeightReceiver":
        """Serve syncs from a new sender connection (a trainer that connected, or reconnected
        after a restart), on a fresh thread. The previous connection's thread is stopped
        first; version, weights and dirty state carry over, so a dirty engine still takes only
        a retry of its dirty version."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=self._timeout)
            if self._thread.is_alive():
                raise TimeoutError("WeightReceiver.serve: the previous connection's sync did "
                                   f"not end within {self._timeout:g} s")
        with self._busy:
            self._conn, self._sender_pid, self._thread = conn, None, None
            self._stop = threading.Event()
        return self.start()

    def close(self) -> None:
        """Stop serving. The weights stay valid (the module keeps its tensors)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self._written_event is not None:
            self._written_event.close()
            self._written_event = None
        if isinstance(self._mem, ShmMemory):
            self._mem.close()

    # ---------------------------------------------------------------- serving
    def _serve(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while not self._stop.is_set():
            try:
                msg = recv_until(self._conn, time.perf_counter() + 3600.0, None,
                                 stop=self._stop)
            except Timeout:
                continue
            except PeerGone:
                break
            try:
                self._dispatch(msg)
            except PeerGone:
                break
            except Exception:  # a bug or a device error: keep serving, never die silently
                log.exception("weight receiver: error while handling %r", msg[0])
                with self._state_lock:
                    if self._n_dirty and self._dirty_reason == "sync in progress":
                        self._dirty_reason = "receiver error during the sync (see log)"

    def _dispatch(self, msg: tuple) -> None:
        tag, seq = msg[0], msg[1]
        if tag == "hello":
            self._sender_pid = msg[2].get("pid")
            send(self._conn, ("layout", seq, self._layout()))
        elif tag == "begin":
            with self._busy:
                self._sync(seq, *msg[2:])
        elif tag in ("end", "abort"):
            send(self._conn, ("failed", seq, ["no sync in progress: the receiver abandoned it "
                                              f"({self._dirty_reason or 'unknown'})"]))

    def _layout(self) -> dict:
        return {
            "backend": self.backend, "pid": _pid(), "verify": self._verify,
            "export": self._mem.export(),
            "free_event": self._free_event.handle if self._free_event else None,
            "entries": [(n, o, s, dtype_name(d)) for n, o, s, d in
                        zip(self._names, self._offsets, self._shapes, self._dtypes)],
        }

    def _sync(self, seq: int, version: int, mode: str, header: dict, entries) -> None:
        key = header.get("key")
        if entries is not None:
            self._manifests[key] = entries
            self._manifests.move_to_end(key)
            while len(self._manifests) > _MANIFEST_CACHE:
                self._manifests.popitem(last=False)
        entries = self._manifests.get(key)
        if entries is None:
            send(self._conn, ("reject", seq, ["manifest unknown to the receiver"], True))
            return
        checked = self._check(header, entries, mode)
        problems = list(checked.problems)
        if self.backend == "cuda":
            problems += self._cuda_problems(header)
        problems += self._state_problems(version, checked.idx)
        if problems:
            send(self._conn, ("reject", seq, problems, False))
            return
        if isinstance(self._mem, ShmMemory):
            self._mem.unlink()  # the sender has it open; no name left behind after a crash
        idx = checked.idx
        with self._state_lock:
            self._dirty[idx] = True
            self._n_dirty = int(self._dirty.sum())
            self._dirty_version, self._dirty_reason = version, "sync in progress"
        if self._free_event is not None:  # GPU fence: pending reads of the weights first
            self._free_event.record(torch.cuda.current_stream(self._device))
        send(self._conn, ("accept", seq))
        try:
            msg = recv_until(self._conn, time.perf_counter() + self._timeout,
                             self._sender_pid, seq=seq, stop=self._stop)
        except Timeout:
            self._fail(f"timed out after {self._timeout:g} s waiting for the sender to finish "
                       f"writing version {version}")
            return
        except PeerGone as exc:
            self._fail(f"the sender went away while writing version {version} ({exc})")
            raise
        if msg[0] == "abort":
            self._fail(f"the sender aborted version {version} after writing began: {msg[2]}")
            send(self._conn, ("aborted", seq))
            return
        if msg[0] != "end":
            problem = f"expected the end of version {version}, got {msg[0]!r}"
            self._fail(problem)
            send(self._conn, ("failed", seq, [problem]))
            return
        try:
            self._finish(seq, version, mode, header, checked, msg[3])
        except PeerGone:
            raise
        except Exception as exc:  # e.g. a device error while verifying: answer, stay dirty
            problem = f"receiver failed to verify: {type(exc).__name__}: {exc}"
            self._fail(problem)
            send(self._conn, ("failed", seq, [problem]))

    def _cuda_problems(self, header: dict) -> list[str]:
        """The sender writes from this engine's GPU and has exported its 'written' event (a
        new one is opened here)."""
        problems = []
        if header.get("uuid") is not None and header["uuid"] != self._mem.export()["uuid"]:
            problems.append(f"sender writes from GPU {header['uuid']}, the engine is on "
                            f"{self._mem.export()['uuid']}")
        if header.get("written_event") is not None:
            if self._written_event is not None:
                self._written_event.close()
            self._written_event = IpcEvent.open(header["written_event"], self._device.index)
            self.handle_opens += 1
        if self._written_event is None:
            problems.append("the sender has not exported its 'written' event")
        return problems

    def _finish(self, seq, version, mode, header, checked: _Checked, report: dict) -> None:
        idx = checked.idx
        problems = []
        if report.get("count") != len(idx):
            problems.append(f"sender wrote {report.get('count')} tensors, manifest lists "
                            f"{len(idx)}")
        if report.get("nbytes") != checked.nbytes:
            problems.append(f"sender wrote {report.get('nbytes')} bytes, manifest says "
                            f"{checked.nbytes}")
        theirs = np.frombuffer(report.get("lanes", b""), dtype="<u4")
        if theirs.size != 2 * len(idx):
            problems.append("sender's checksum report has the wrong length")
            theirs = np.zeros((len(idx), 2), dtype=np.uint32)
        theirs = theirs.reshape(-1, 2).astype(np.uint32)
        if self._written_event is not None:
            self._written_event.wait(torch.cuda.current_stream(self._device))
        mine = self._lanes((header["key"], mode), idx) if self._verify == "full" else theirs
        bad = np.nonzero((mine != theirs).any(axis=1))[0]
        if len(bad):
            names = ", ".join(self._names[idx[k]] for k in bad)
            problems.append(f"checksum mismatch in {len(bad)} tensors: {names}")
        checksum = combine(checked.digest, mine)
        if report.get("checksum") != checksum:
            problems.append(f"sender's checksum {report.get('checksum')} differs from the "
                            f"receiver's {checksum}")
        if not problems and self._before_commit is not None:
            try:
                self._before_commit(version, mode)
            except Exception as exc:  # the engine cannot serve this version: it must not commit
                problems.append(f"the engine did not take version {version}: "
                                f"{type(exc).__name__}: {exc}")
        if problems:
            self._fail("; ".join(problems))
            send(self._conn, ("failed", seq, problems))
            return
        with self._state_lock:
            self._version = version
            self._dirty[idx] = False
            self._n_dirty = int(self._dirty.sum())
            if not self._n_dirty:
                self._dirty_version, self._dirty_reason = None, ""
        if self._on_commit is not None:
            self._on_commit(version, mode)
        send(self._conn, ("committed", seq, checksum))

    def _fail(self, reason: str) -> None:
        with self._state_lock:
            self._dirty_reason = reason
        log.error("weight sync failed after writing began: %s", reason)

    # ---------------------------------------------------------------- checks
    def _check(self, header: dict, entries: list, mode: str) -> _Checked:
        key = (header.get("key"), header.get("hash"), header.get("count"),
               header.get("nbytes"), mode)
        hit = self._checked.get(key)
        if hit is not None:
            return hit
        problems = check_manifest(header, entries, mode, self._layout_map, self._modes)
        if problems:
            out = _Checked(problems, None, 0, None)
        else:
            idx = np.array([self._index[e[0]] for e in entries], dtype=np.int64)
            nbytes = sum(self._numels[k] * self._tensors[k].element_size() for k in idx)
            digest = digest_header([self._names[k] for k in idx],
                                   [self._dtypes[k] for k in idx],
                                   [self._shapes[k] for k in idx])
            out = _Checked([], idx, nbytes, digest)
        if len(self._checked) > _MANIFEST_CACHE:
            self._checked.clear()
        self._checked[key] = out
        return out

    def _state_problems(self, version, idx) -> list[str]:
        problems = []
        if not isinstance(version, int) or version < 0:
            return [f"version must be a non-negative int, got {version!r}"]
        with self._state_lock:
            current, dirty = self._version, self._dirty.copy()
            n_dirty, dirty_version = self._n_dirty, self._dirty_version
        if version < current:
            problems.append(f"version {version} is older than the committed version {current}")
        if n_dirty and version != dirty_version:
            problems.append(f"the engine is dirty from version {dirty_version}; only a retry "
                            f"of version {dirty_version} is accepted, got {version}")
        if n_dirty and idx is not None:
            dirty[idx] = False
            left = np.nonzero(dirty)[0]
            if len(left):
                problems.append(f"this sync leaves {len(left)} dirty tensors unwritten: "
                                + ", ".join(self._names[k] for k in left))
        if idx is not None:
            tensors, expected = self._watch(idx)
            if [t.data_ptr() for t in tensors] != expected:
                moved = [self._names[k] for k in idx.tolist()
                         if self._tensors[k].data_ptr() != self._expected_ptrs[k]]
                problems.append(f"{len(moved)} tensors no longer live in transport memory "
                                f"(their .data was rebound): {', '.join(moved)}")
        return problems

    def _watch(self, idx: np.ndarray) -> tuple[list, list]:
        """(tensor objects, expected data pointers) of a manifest, cached per manifest.
        NOTE: one data_ptr() per tensor and sync, cached because it adds up over an adapter's
        tensors (`map(Tensor.data_ptr, ...)` is no faster; figures:
        bench/reports/2026-12-04_cpu-h200_comment-figures.md)."""
        key = id(idx)
        hit = self._watched.get(key)
        if hit is None or hit[0] is not idx:
            ks = idx.tolist()
            hit = (idx, [self._tensors[k] for k in ks], [self._expected_ptrs[k] for k in ks])
            if len(self._watched) > _MANIFEST_CACHE:
                self._watched.clear()
            self._watched[key] = hit
        return hit[1], hit[2]

    # ---------------------------------------------------------------- checksums
    def _lanes(self, key: tuple, idx: np.ndarray) -> np.ndarray:
        """Lanes of tensors `idx`, read from transport memory (not through the params)."""
        if self.backend != "cuda":
            return self._read_lanes(key, idx)
        with torch.cuda.device(self._device):  # callers may sit on another current device
            return self._read_lanes(key, idx)

    def _read_lanes(self, key: tuple, idx: np.ndarray) -> np.ndarray:
        plan = self._readers.get(key)
        if plan is None:
            ks = idx.tolist()
            plan = CopyPlan([[(j, 0, self._numels[k]) for j, k in enumerate(ks)]],
                            [self._offsets[k] for k in ks], [self._numels[k] for k in ks],
                            [self._dtypes[k] for k in ks], [self._dtypes[k] for k in ks],
                            self._device, use_kernel=self.backend == "cuda"
                            and _kernels.triton_available())
            plan.src_ptrs = np.array(plan.dst_offsets, dtype=np.int64) + \
                self._mem.tensor.data_ptr()
            if len(self._readers) > _MANIFEST_CACHE:
                self._readers.clear()
            self._readers[key] = plan
        mem = self._mem.tensor
        sums = plan.new_sums()
        extra: list = []
        plan.run_bucket(0, mem, plan.src_ptrs, {}, sums, extra, store=False)
        if self.backend != "cuda":
            return fold_lanes(None, [(k, t.tolist()) for k, t in extra], len(idx))
        stream = torch.cuda.current_stream(self._device)
        host = torch.empty(sums.shape, dtype=torch.int32, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        extra_host = [(k, torch.empty(2, dtype=torch.int64, pin_memory=True)) for k, _ in extra]
        for (_, h), (_, d) in zip(extra_host, extra):
            h.copy_(d, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        if not wait_event_host(done, time.perf_counter() + self._timeout, lambda: True):
            raise TimeoutError(f"checksum read did not finish within {self._timeout:g} s")
        return fold_lanes(host.numpy(), [(k, h.tolist()) for k, h in extra_host], len(idx))


def _pid() -> int:
    return os.getpid()


def _validate(params, modes, backend, timeout_s, verify, version):
    problems = []
    if not isinstance(params, Mapping) or not params:
        raise ValueError("WeightReceiver: params must be a non-empty dict of name -> tensor")
    names = list(params)
    tensors = list(params.values())
    bad = [str(n) for n, t in params.items() if not isinstance(n, str)
           or not isinstance(t, torch.Tensor)]
    if bad:
        problems.append(f"not (str name, tensor) pairs: {', '.join(bad)}")
        raise ValueError("WeightReceiver: " + "; ".join(problems))
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        problems.append(f"params span several devices ({', '.join(devices)}); one engine "
                        "process serves one device")
    device = tensors[0].device
    if backend not in ("auto", "shm", "cuda"):
        problems.append(f"backend must be 'auto', 'shm' or 'cuda', not {backend!r}")
    elif backend == "auto":
        backend = "cuda" if device.type == "cuda" else "shm"
    if backend == "shm" and device.type != "cpu":
        problems.append(f"backend 'shm' needs CPU tensors, params are on {device}")
    if backend == "cuda":
        if device.type != "cuda":
            problems.append(f"backend 'cuda' needs CUDA tensors, params are on {device}")
        elif cupy_runtime() is None:
            problems.append("backend 'cuda' needs cupy (pip install cupy-cuda12x or "
                            "cupy-cuda13x)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n)
                   for n, t in zip(names, tensors) if t.numel())
    shared = [f"{a[2]} / {b[2]}" for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    if shared:
        problems.append(f"tensors share storage (pass each storage once): {', '.join(shared)}")
    if modes is not None:
        unknown_modes = [m for m in modes if m not in MODES]
        if unknown_modes:
            problems.append(f"unknown modes {unknown_modes} (known: {list(MODES)})")
        for m, ns in modes.items():
            missing = [n for n in ns if n not in params]
            if missing:
                problems.append(f"mode {m!r} names tensors not in params: {', '.join(missing)}")
            if len(set(ns)) != len(list(ns)):
                problems.append(f"mode {m!r} lists a name twice")
    if verify not in ("full", "fused"):
        problems.append(f"verify must be 'full' or 'fused', not {verify!r}")
    if not timeout_s or timeout_s <= 0:
        problems.append(f"timeout_s must be > 0, got {timeout_s!r}")
    if not isinstance(version, int) or version < 0:
        problems.append(f"version must be a non-negative int, got {version!r}")
    if problems:
        raise ValueError("WeightReceiver: " + "; ".join(problems))
    return names, tensors, backend, device
