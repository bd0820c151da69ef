"""``launch_embedded_engine``: one engine process (spawn) per trainer rank, or one in-process.

The spawned process builds an ``EngineCore`` (adapter, frozen parts, transformer copy, ipc
receiver), optionally starts the HTTP mode on loopback, reports ``ready`` and then serves calls
from its pipe until ``close`` or until the pipe closes (the trainer died). It is a daemon
process, so it cannot outlive the rank that spawned it.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch.multiprocessing as mp  # registers torch's reductions: tensors cross the pipe shared

from trainer.engine.embedded.client import (EngineClient, EngineError, _LocalTransport, _PipeTransport,
                                   pack_exception, raise_remote)
from trainer.engine.embedded.core import EngineCore, check_launch_args

DEFAULT_STARTUP_TIMEOUT_S = 1800.0  # a 20B transformer + text encoder load from a cold disk


def _engine_main(conn: Any, spec: dict[str, Any], weight_sync_conn: Any, http_port: int | None) -> None:
    """Entry point of the engine process."""
    core = server = None
    try:
        core = EngineCore.load(**spec, weight_sync_conn=weight_sync_conn)
        if http_port is not None:
            from trainer.engine.embedded.http_server import start_http_server

            server = start_http_server(core, port=http_port)
        conn.send(("ready", {"pid": os.getpid(), "http_url": server.url if server else None}))
    except BaseException as exc:  # report the load failure to the launcher, then exit
        conn.send(("error", pack_exception(exc)))
        conn.close()
        return
    try:
        while True:
            try:
                method, args, kwargs = conn.recv()
            except (EOFError, OSError):
                break  # the trainer is gone
            if method == "close":
                conn.send(("ok", None))
                break
            try:
                result = getattr(core, method)(*args, **kwargs)
                conn.send(("ok", result))
            except Exception as exc:  # answered to the caller, the engine keeps serving
                conn.send(("error", pack_exception(exc)))
    finally:
        if server is not None:
            server.close()
        core.close()
        conn.close()


def launch_embedded_engine(*, adapter_path: str, model_path: str, adapter_options: dict | None,
                           device: str, dtype: str, lora: dict | None,
                           weight_sync_conn: Any = None, http_port: int | None = None,
                           in_process: bool = False,
                           startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                           compile: str = "none", warmup: dict | None = None,
                           call_timeout_floor_s: float | None = None,
                           call_timeout_per_image_s: float = 0.0,
                           share_trunk: bool = False,
                           flash_ratio: float | None = None) -> EngineClient:
    """Start one embedded engine and return its client.

    ``device``: "cpu" or "cuda:<j>" (the rank's own GPU; the spawned process sees the same
    CUDA_VISIBLE_DEVICES). ``dtype``: "bf16" or "fp32" (transformer, VAE, text encoders).
    ``lora``: {"rank", "alpha", "target_modules"} builds the trainer's peft LoRA layers (adapter
    mode); None for full and merge modes. ``weight_sync_conn``: the receiver end of
    ``ipc.channel_pair()``. ``http_port``: also serve HTTP on 127.0.0.1 (0 picks a free port;
    the client's ``http_url`` says which). ``in_process``: build the engine in this process (tests,
    CPU runs) instead of spawning one. ``call_timeout_floor_s`` / ``call_timeout_per_image_s``:
    the deadline of every call of a spawned engine, floor + per image requested (None: none).
    ``compile``: the transformer's ``model.compile`` setting; ``warmup``: {"height", "width",
    "batch"[, "frames"]} to run (and compile) before the first request. ``share_trunk``: a group sharing x_T
    runs its ODE steps before the first SDE step once (trainer.engine.embedded.trunk; the
    Fast / MixGRPO algorithms turn it on). ``flash_ratio``: MixGRPO-Flash, the steps after a
    request's last SDE step taken by DPM-Solver++(2M) on a schedule compressed by this ratio
    (flowgrpo_kernels.ode_solvers). Bad arguments raise one ValueError
    before anything loads; a failed load raises with the engine's traceback.
    """
    check_launch_args(adapter_path=adapter_path, model_path=model_path, device=device,
                      dtype=dtype, lora=lora)
    if http_port is not None and (isinstance(http_port, bool) or not isinstance(http_port, int)
                                  or not 0 <= http_port < 65536):
        raise ValueError(f"http_port must be an integer in [0, 65536) or None, got {http_port!r}")
    spec = {"adapter_path": adapter_path, "model_path": str(model_path),
            "adapter_options": dict(adapter_options or {}), "device": str(device),
            "dtype": dtype, "lora": dict(lora) if lora else None, "compile": compile,
            "warmup": dict(warmup) if warmup else None, "share_trunk": bool(share_trunk),
            "flash_ratio": None if flash_ratio is None else float(flash_ratio)}
    if in_process:
        core = EngineCore.load(**spec, weight_sync_conn=weight_sync_conn)
        servers: tuple[Any, ...] = ()
        if http_port is not None:
            from trainer.engine.embedded.http_server import start_http_server

            servers = (start_http_server(core, port=http_port),)
        return EngineClient(_LocalTransport(core, also_close=servers),
                            http_url=servers[0].url if servers else None, pid=os.getpid())

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_main, args=(child, spec, weight_sync_conn, http_port),
                       name=f"flowgrpo-engine-{device}", daemon=True)
    proc.start()
    child.close()
    deadline = time.monotonic() + startup_timeout_s
    while not parent.poll(0.5):
        if not proc.is_alive():
            raise EngineError(f"engine process exited during startup (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            proc.terminate()
            raise EngineError(f"engine did not become ready within {startup_timeout_s:.0f} s")
    try:
        status, payload = parent.recv()
    except EOFError:
        proc.join(30)
        raise EngineError(f"engine process exited during startup (exit code {proc.exitcode}); "
                          "see its stderr") from None
    if status != "ready":
        proc.join(30)
        raise_remote(payload)
    transport = _PipeTransport(parent, proc, floor_s=call_timeout_floor_s,
                               per_image_s=call_timeout_per_image_s)
    return EngineClient(transport, http_url=payload["http_url"], pid=payload["pid"])
