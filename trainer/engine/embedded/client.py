"""``EngineClient``: the trainer-side handle of one embedded engine (in-process or spawned).

Both transports expose the same calls. The spawned engine answers over a ``multiprocessing``
pipe; tensors in a reply travel through torch's multiprocessing reductions (shared memory on
CPU, CUDA IPC on GPU), so a rollout's trajectories and images reach the trainer without a
disk round trip and without serialisation. CUDA tensors received that way still live in the
engine's memory; ``generate`` clones them into the trainer's own allocation (a few MB,
device-to-device) and drops the IPC references at once, so the engine can release its memory
while the actor trains on the rollout (otherwise the engine's blocks stay pinned until the
batch dies, and each rebuilt handle costs time to release:
bench/reports/2026-12-04_cpu-h200_comment-figures.md).

Deadlines: a spawned engine's calls may carry a deadline of ``floor_s + per_image_s x
images requested`` (``launch_embedded_engine``'s ``call_timeout_*``; the trainer sets them
from ``rollout.engine_timeout_*``). A missed deadline, a dead process or a closed pipe raises
``EngineUnavailableError`` naming the call, the stage it serves and the process state (a
stopped process says so); the transport is then unusable (a late answer would be taken for
the next call's), and ``kill()`` ends the process, SIGKILL included, since a stopped process
ignores SIGTERM. ``trainer.engine.recovery`` restarts it.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from typing import Any

import torch

# What each call serves, for the messages of a missed deadline or a dead engine.
STAGES = {"generate": "rollout", "checksum": "weight sync (checksum check)",
          "get_version": "weight sync (version check)", "release": "offload (release)",
          "resume": "rollout (resume)", "health": "health check", "close": "shutdown",
          "update_weights_from_disk": "weight update from disk"}


_LINE_MAX = 1000


class EngineError(RuntimeError):
    """The engine process failed or died; the message carries its traceback."""


class EngineUnavailableError(EngineError):
    """The engine did not answer in time, died, or closed its pipe: a restart can help."""


def process_state(pid: int) -> str:
    """``running``, ``stopped (SIGSTOP?)``, ``zombie`` ... from /proc (Linux), or ``unknown``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    return {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O",
            "T": "stopped (SIGSTOP?)", "t": "stopped by a tracer", "Z": "zombie"}.get(state, state)


def request_images(method: str, args: tuple) -> int:
    """Images a call asks for (the size its deadline scales with, as --help says): one per
    entry of a batched generate's ``prompt`` list (one entry per candidate), or SGLang's
    single-prompt form's ``num_outputs_per_prompt`` (else its sample ids, else 1)."""
    if method == "generate" and args and isinstance(args[0], dict):
        request = args[0]
        prompts = request.get("prompt")
        if isinstance(prompts, list):
            return len(prompts)
        n = request.get("num_outputs_per_prompt")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
        ids = (request.get("extra_sampling_params") or {}).get("sample_ids")
        return len(ids) if isinstance(ids, list) and ids else 1
    return 0


def localize(obj: Any) -> Any:
    """Clone CUDA tensors received over IPC into this process's own memory (recursively)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.is_cuda else obj
    if isinstance(obj, dict):
        return {k: localize(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [localize(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(localize(v) for v in obj)
    return obj


def pack_exception(exc: BaseException) -> tuple[Any, str]:
    """(picklable exception or None, formatted traceback) for sending across the pipe."""
    import pickle

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    # the exception's own message is in the traceback again: cut long lines (a 40k-token
    # prompt quoted in a message would otherwise reach the log twice, whole)
    text = "\n".join(line if len(line) <= _LINE_MAX else
                     f"{line[:_LINE_MAX]}... ({len(line)} characters)"
                     for line in text.split("\n"))
    try:
        pickle.loads(pickle.dumps(exc))
        return exc, text
    except Exception:
        return None, text


def raise_remote(packed: tuple[Any, str]) -> None:
    exc, text = packed
    if exc is None:
        raise EngineError(f"engine raised an unpicklable exception:\n{text}")
    raise exc from EngineError(f"engine-side traceback:\n{text}")


class _LocalTransport:
    """Calls an ``EngineCore`` living in this process."""

    def __init__(self, core: Any, also_close: tuple[Any, ...] = ()) -> None:
        self.core = core
        self.also_close = also_close  # e.g. the HTTP server serving the same core

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.core, method)(*args, **kwargs)

    def close(self) -> None:
        for obj in self.also_close:
            obj.close()
        self.core.close()


class _PipeTransport:
    """Calls an ``EngineCore`` in a spawned process; one request in flight at a time."""

    def __init__(self, conn: Any, process: Any, *, poll_s: float = 0.5,
                 floor_s: float | None = None, per_image_s: float = 0.0) -> None:
        self.conn = conn
        self.process = process
        self.poll_s = poll_s
        self.floor_s = floor_s
        self.per_image_s = per_image_s
        self._lock = threading.Lock()
        self._closed = False
        self.broken: str | None = None  # why the transport may no longer be used

    def deadline_s(self, method: str, args: tuple) -> float | None:
        if self.floor_s is None:
            return None
        return self.floor_s + self.per_image_s * request_images(method, args)

    def _recv(self, what: str, timeout_s: float | None) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        where = f"{what} (stage: {STAGES.get(what, what)})"
        pid = self.process.pid
        while not self.conn.poll(min(self.poll_s, timeout_s or self.poll_s)):
            if not self.process.is_alive():
                raise EngineUnavailableError(f"engine process {pid} died during {where}, exit "
                                             f"code {self.process.exitcode}")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineUnavailableError(
                    f"engine process {pid} did not answer {where} within its {timeout_s:.1f} s "
                    f"deadline; the process is {process_state(pid)}")
        try:
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            self.process.join(2.0)  # the pipe closes as the process dies: collect its end
            what = "died" if not self.process.is_alive() else "closed its pipe"
            raise EngineUnavailableError(f"engine process {pid} {what} during {where}, exit "
                                         f"code {self.process.exitcode}") from exc

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._closed:
                raise EngineError(f"engine client is closed (called {method})")
            if self.broken is not None:
                raise EngineUnavailableError(f"engine unusable since: {self.broken} (called "
                                             f"{method})")
            try:
                self.conn.send((method, args, kwargs))
                status, payload = self._recv(method, self.deadline_s(method, args))
            except (EngineUnavailableError, OSError) as exc:
                self.broken = str(exc)
                if isinstance(exc, EngineUnavailableError):
                    raise
                raise EngineUnavailableError(f"engine pipe failed during {method}: {exc}") \
                    from exc
        if status == "error":
            raise_remote(payload)
        return localize(payload)

    def kill(self) -> None:
        """End the engine process now (SIGKILL: a stopped process ignores SIGTERM)."""
        with self._lock:
            self._closed = True
            self.conn.close()
        if self.process.is_alive():
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.join(10.0)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.broken is not None:
            self.kill()  # a hung engine never answers close
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.process.is_alive():
                    self.conn.send(("close", (), {}))
                    self._recv("close", timeout_s)
            except (EngineError, OSError, BrokenPipeError):
                pass
            finally:
                self.conn.close()
        self.process.join(timeout_s)
        if self.process.is_alive():  # the engine ignored close: end it (our own child only)
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():  # stopped processes keep SIGTERM pending
            self.kill()


class EngineClient:
    """Handle of one embedded engine.

    Methods: ``generate(request) -> response`` (the adapters' response schema, tensors
    batch-first), ``checksum() -> str`` (over the engine's transformer weights, equal to
    ``ipc.weights_checksum`` of the same bytes), ``version`` (last committed weight version),
    ``release()`` / ``resume()`` (free / restore device memory; failures raise: a half-released engine cannot be trusted),
    ``health() -> dict``, ``update_weights_from_disk(model_path)``, ``down()`` (why the
    process cannot answer, or None), ``close()``.
    ``http_url`` is the loopback URL of the engine's HTTP mode, or None.
    """

    def __init__(self, transport: Any, *, http_url: str | None = None,
                 pid: int | None = None) -> None:
        self._transport = transport
        self.http_url = http_url
        self.pid = pid

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._transport.call("generate", request)

    def checksum(self) -> str:
        return self._transport.call("checksum")

    @property
    def version(self) -> int:
        return int(self._transport.call("get_version"))

    def release(self) -> dict[str, Any]:
        return self._transport.call("release")

    def resume(self) -> dict[str, Any]:
        return self._transport.call("resume")

    def health(self) -> dict[str, Any]:
        return self._transport.call("health")

    def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        return self._transport.call("update_weights_from_disk", model_path)

    def close(self) -> None:
        self._transport.close()

    def down(self) -> str | None:
        """Why a spawned engine cannot answer (its process dead, or stopped), or None (it may
        be working, or it lives in this process)."""
        process = getattr(self._transport, "process", None)
        if process is None:
            return None
        if not process.is_alive():
            return f"dead (exit code {process.exitcode})"
        state = process_state(process.pid)
        return state if state.startswith("stopped") else None

    def kill(self) -> None:
        """End a spawned engine at once (in-process engines are closed)."""
        if hasattr(self._transport, "kill"):
            self._transport.kill()
        else:
            self._transport.close()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
