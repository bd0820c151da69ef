"""Transport memory and ordering primitives of the two backends.

- "shm": a file in /dev/shm mapped by both processes with `torch.from_file(shared=True)`.
  CPU copies are synchronous, so the pipe messages alone order the writes.
- "cuda": one `cudaMalloc` allocation per receiver (cupy's runtime binding: outside torch's
  caching allocator, so `expandable_segments` cannot break the legacy IPC handle), exported
  once with `cudaIpcGetMemHandle` and opened once per sender lifetime. Ordering uses two
  interprocess events (DisableTiming | Interprocess): the receiver records "free" after any
  pending work that reads its weights, the sender's stream waits on it before writing; the
  sender records "written" after its last copy and the receiver's stream waits on it before
  verifying. Each wait is issued only after a pipe message says the record was enqueued (an
  IPC event wait sees only records enqueued before it). Peers are matched by device UUID.

Both sides see the memory as one uint8 torch tensor (zero copy, via
`__cuda_array_interface__` for CUDA), so everything above this module is plain torch.
"""
from __future__ import annotations

import os
import secrets
import tempfile
import time
import weakref

import torch

_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
_CUDA_SUCCESS = 0
_CUDA_NOT_READY = 600


def cupy_runtime():
    """cupy's CUDA runtime binding, or None when cupy is not installed."""
    try:
        from cupy.cuda import runtime
    except ImportError:
        return None
    return runtime


def device_uuid(index: int) -> str:
    rt = cupy_runtime()
    if rt is not None:
        return rt.getDeviceProperties(index)["uuid"].hex()
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_by_uuid(uuid: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


# ---------------------------------------------------------------------------------------
# shared memory (CPU)
# ---------------------------------------------------------------------------------------

def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmMemory:
    """Receiver side: create; sender side: open. `.tensor` is the uint8 view of the bytes.

    On Linux the file is unlinked as soon as it is mapped and the sender opens it through
    /proc/<receiver pid>/fd/<fd>, so no name is left in /dev/shm whatever way the engine
    exits (a killed process runs no cleanup). Elsewhere the name lives until the first begin
    (the sender has opened it by then) or close().
    """

    def __init__(self, tensor: torch.Tensor, path: str, fd: int | None, owner: bool):
        self.tensor = tensor
        self.path = path
        self._fd = fd
        self._owner = owner
        if owner:
            self._finalizer = weakref.finalize(self, _release, path, fd)

    @classmethod
    def create(cls, size: int) -> "ShmMemory":
        path = os.path.join(_shm_dir(), f"flowgrpo-ipc-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            t = torch.from_file(path, shared=True, size=max(size, 1), dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            _unlink_quiet(path)
            raise
        proc = f"/proc/{os.getpid()}/fd/{fd}"
        if os.path.exists(proc):
            _unlink_quiet(path)
            path = proc
        return cls(t, path, fd, owner=True)

    @classmethod
    def open(cls, export: dict) -> "ShmMemory":
        t = torch.from_file(export["path"], shared=True, size=max(export["size"], 1),
                            dtype=torch.uint8)
        return cls(t, export["path"], None, owner=False)

    def export(self) -> dict:
        return {"kind": "shm", "path": self.path, "size": self.tensor.numel()}

    def unlink(self) -> None:
        """Drop the name (and our fd); the mappings (the engine's weights) stay valid."""
        if self._owner and not self.path.startswith("/proc/"):
            _unlink_quiet(self.path)

    def close(self) -> None:
        if self._owner:
            self._finalizer()


def _release(path: str, fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    if not path.startswith("/proc/"):
        _unlink_quiet(path)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------------
# CUDA IPC (cupy)
# ---------------------------------------------------------------------------------------

class _DeviceBytes:
    """Owner of a device range, presented to torch through __cuda_array_interface__.
    torch keeps this object alive as long as any tensor viewing it; `release` runs when the
    last one dies (cudaFree for our allocation, cudaIpcCloseMemHandle for an opened one)."""

    def __init__(self, ptr: int, size: int, device: int, release):
        self.ptr, self.size, self.device = ptr, size, device
        self._release = release
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None}

    def __del__(self):
        try:
            with torch.cuda.device(self.device):
                self._release(self.ptr)
        except Exception:  # interpreter shutdown: the driver reclaims everything anyway
            pass


class CudaMemory:
    """One exported allocation. Receiver: `allocate`; sender: `open` (counts as one open)."""

    def __init__(self, tensor: torch.Tensor, device: int, handle: bytes | None):
        self.tensor = tensor
        self.device = device
        self.handle = handle
        self.uuid = device_uuid(device)  # NOTE: cudaGetDeviceProperties is slow: ask once

    @classmethod
    def allocate(cls, size: int, device: int) -> "CudaMemory":
        rt = cupy_runtime()
        size = max(size, 256)
        with torch.cuda.device(device):
            ptr = rt.malloc(size)
            owner = _DeviceBytes(ptr, size, device, rt.free)
            handle = rt.ipcGetMemHandle(ptr)
            t = torch.as_tensor(owner, device=f"cuda:{device}")
        return cls(t, device, handle)

    @classmethod
    def open(cls, export: dict, device: int) -> "CudaMemory":
        rt = cupy_runtime()
        with torch.cuda.device(device):
            ptr = rt.ipcOpenMemHandle(export["handle"])
            owner = _DeviceBytes(ptr, export["size"], device, rt.ipcCloseMemHandle)
            t = torch.as_tensor(owner, device=f"cuda:{device}")
        return cls(t, device, None)

    def export(self) -> dict:
        return {"kind": "cuda", "handle": self.handle, "size": self.tensor.numel(),
                "uuid": self.uuid}


class IpcEvent:
    """An interprocess CUDA event: created here (`create`, exportable) or opened from a
    peer's handle (`open`, one handle open). record/wait go on torch streams."""

    def __init__(self, ptr: int, device: int, handle: bytes | None, owned: bool):
        self.ptr, self.device, self.handle, self._owned = ptr, device, handle, owned

    @classmethod
    def create(cls, device: int) -> "IpcEvent":
        rt = cupy_runtime()
        with torch.cuda.device(device):
            ptr = rt.eventCreateWithFlags(_EVENT_FLAGS)
            return cls(ptr, device, rt.ipcGetEventHandle(ptr), owned=True)

    @classmethod
    def open(cls, handle: bytes, device: int) -> "IpcEvent":
        rt = cupy_runtime()
        with torch.cuda.device(device):
            return cls(rt.ipcOpenEventHandle(handle), device, None, owned=False)

    def record(self, stream: torch.cuda.Stream) -> None:
        cupy_runtime().eventRecord(self.ptr, stream.cuda_stream)

    def wait(self, stream: torch.cuda.Stream) -> None:
        """GPU-side wait: `stream` runs nothing further until the last enqueued record."""
        cupy_runtime().streamWaitEvent(stream.cuda_stream, self.ptr, 0)

    def close(self) -> None:
        if self.ptr:
            try:
                with torch.cuda.device(self.device):
                    cupy_runtime().eventDestroy(self.ptr)
            finally:
                self.ptr = 0


# A short time.sleep oversleeps on Linux (timer slack), which the end of every wait would pay
# (bench/reports/2026-11-29_h200_code-choices.md). Waits spin (yielding the GIL) for this long
# before they start sleeping: it covers a sync's waits.
_SPIN_S = 0.02


def wait_event_host(event: torch.cuda.Event, deadline: float, alive) -> bool:
    """Poll a local event until it completes (True), the deadline passes or `alive()` turns
    False (False). Polling the event, never the data: a peer that died with our stream
    waiting on its event must not hang this process in a blocking synchronize."""
    spins = 0
    spin_until = time.perf_counter() + _SPIN_S
    while not event.query():
        now = time.perf_counter()
        if now > deadline or (spins % 2048 == 2047 and not alive()):
            return False
        spins += 1
        time.sleep(0 if now < spin_until else 20e-6)
    return True
