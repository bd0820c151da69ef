"""Our ipc/ weight receiver inside an SGLang worker: the native DiT's parameters, served over
the same bucketed transport as the embedded engine (manifest, checksum, commit / rollback).

Runs in SGLang's processes, installed by the extension (trainer/engine/sglang/extension.py):

    worker (build_pipeline hook)                     HTTP process (create_app hook)
      WeightReceiver(conn=None, native DiT params)     GET /flowgrpo/weight_receivers
      LoraReceiver (lora_receiver.py)                  reads every worker's descriptor file
      Listener(AF_UNIX socket, random authkey)  ──▶    and returns them (the trainer's client
      descriptor file: socket, authkey, pid, device,   connects to the one on its GPU)
      backend, tensors, packing rules, protocol
      accept loop: a trainer connection's first message opens a channel, then it is served:
        ("weights", {})  -> "ready"; the DiT's WeightReceiver serves it (full weights)
        ("adapter", spec) -> "ready" | "refused"; a staging WeightReceiver for the LoRA
                            pairs serves it (merged into the DiT at commit)

Design choices:
- The receiver holds the native module's parameters under the native names, packed ones
  included (Qwen-Image's ``attn.to_added_qkv``). The trainer sends a packed parameter as the
  concatenation of its sections, so the manifest, the checksum and the bit-exact check are
  about the bytes the server computes with. The packing is read from the live module's own
  ``param_names_mapping`` (the rules whose replacement is ``(target, section, sections)``) and
  published with the descriptor; the trainer applies it (trainer/engine/sglang/transport.py).
- Versions: the receiver accepts only versions >= its committed one, and a server outlives
  trainer runs. The descriptor therefore carries the last committed version (rewritten at each
  commit), and the trainer numbers its syncs above it (transport.py); the trainer's own policy
  version is kept apart, on its client.
- Every parameter is in every mode's manifest ("full" covers all of them): a sync that misses
  one is refused before a byte moves. Buffers (RoPE tables) are the server's own, not synced,
  and so are the parameters the family's adapter names ``sglang_fixed_parameters``: tables the
  native DiT holds as parameters where the trainer's diffusers model holds buffers (SD3's
  sin-cos position table), never trained, so never sent.
- LoRA adapter sync mode has a channel of its own (the pairs staged, checked, then merged into
  these parameters at commit: lora_receiver.py); its packed layers are placed by the same
  table. A connection says which channel it wants in its first message, and the descriptor
  names the protocol, so a trainer of another version is stopped with that reason.
- The trainer reaches the worker through a Unix socket (multiprocessing's Listener, with an
  authkey only the descriptor file, mode 0600, and the HTTP route carry). The data itself
  moves through the transport memory (CUDA IPC or /dev/shm), never through the socket.
- Rendezvous: descriptors are files in ``$FLOWGRPO_RECEIVER_DIR`` (default
  ``<tmp>/flowgrpo-sglang-<server port>``), one per worker rank; SGLang's HTTP process and its
  workers share no channel a plugin can add to, and the trainer must be on the same host anyway.
- SGLang's memory release skips this DiT (extension.py: its weights stay resident in
  transport memory). What the receiver cannot follow: SGLang's layerwise offload moves the
  DiT's storage (``.data`` rebound); the receiver then refuses the next sync before writing
  (its manifest check sees the tensors left transport memory). Tensor parallelism > 1 gives
  each worker a shard whose shapes the trainer's full tensors do not match: refused the same way.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import tempfile
import threading
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any, Iterable

from torch import nn

from ipc import WeightReceiver
from trainer.engine.sglang.lora_receiver import AdapterSpecError, LoraReceiver
from trainer.models import ADAPTERS, adapter_class

log = logging.getLogger(__name__)
DIR_ENV = "FLOWGRPO_RECEIVER_DIR"
ENABLE_ENV = "FLOWGRPO_WEIGHT_RECEIVER"  # "0" leaves the DiT as SGLang loaded it
DESCRIPTOR_SUFFIX = ".receiver.json"
ROUTE = "/flowgrpo/weight_receivers"
#: What a trainer connection says first and how it is answered (module docstring); published
#: in the descriptor, so a trainer finds a server whose extension speaks another one at once.
PROTOCOL = 2
OPEN_TIMEOUT_S = 30.0  # for a new connection's first message


def receiver_dir(port: int | str) -> Path:
    """Where the workers of the server on ``port`` publish their descriptors."""
    given = os.environ.get(DIR_ENV)
    return Path(given) if given else Path(tempfile.gettempdir()) / f"flowgrpo-sglang-{port}"


def packing_rules(module: nn.Module) -> list[list[Any]]:
    """[pattern, replacement, section, sections] of the module's name rules, in the order
    SGLang's updater applies them (its ``lora_param_names_mapping``, then its
    ``param_names_mapping``): a packing rule's (target, section, sections) tuple, or a rename
    (Wan's ``attn1.to_q`` -> ``to_q``) with section and sections None. As SGLang's loader does,
    the trainer applies one only to a name the module lacks, where the target is held."""
    rules = []
    for table in (getattr(module, "lora_param_names_mapping", None),
                  getattr(module, "param_names_mapping", None)):
        for pattern, rule in dict(table or {}).items():
            if isinstance(rule, tuple) and len(rule) == 3:
                rules.append([pattern, rule[0], int(rule[1]), int(rule[2])])
            elif isinstance(rule, str) and rule:
                rules.append([pattern, rule, None, None])
    return rules


class PackingTable:
    """Where a tensor sent under our name lands in the native DiT: (served name, section,
    sections) from the module's name rules (``packing_rules``), (renamed, None, None) for a
    rename, or (name, None, None)."""

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


def fixed_parameters(module: nn.Module) -> tuple[str, ...]:
    """The parameters of ``module`` no sync carries: ``sglang_fixed_parameters`` of the shipped
    adapter whose ``sglang_dit`` is the module's class (none for another class)."""
    served = f"{type(module).__module__}.{type(module).__name__}"
    for family in ADAPTERS:
        cls = adapter_class(family)
        if getattr(cls, "sglang_dit", None) == served:
            return tuple(getattr(cls, "sglang_fixed_parameters", ()))
    return ()


def synced_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a sync writes: all of the module's but its fixed ones."""
    fixed = set(fixed_parameters(module))
    return {n: p for n, p in module.named_parameters() if n not in fixed}


class WorkerReceiver:
    """One worker's receiver, its listener and its descriptor file."""

    def __init__(self, module: nn.Module, *, rank: int, port: int | str,
                 backend: str = "auto", timeout_s: float = 60.0, verify: str = "full") -> None:
        params = synced_parameters(module)
        self.module = module
        self.packing = packing_rules(module)
        self.committed: int | None = None  # the last committed version (None: never synced)
        self.receiver = WeightReceiver(None, params, backend=backend, timeout_s=timeout_s,
                                       verify=verify, on_commit=self._committed)
        self.lora = LoraReceiver(params, PackingTable(self.packing, params).place,
                                 backend=self.receiver.backend, timeout_s=timeout_s,
                                 verify=verify, on_commit=self._publish)
        self._lock = threading.Lock()
        self.rank = int(rank)
        self.dir = receiver_dir(port)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.address = str(self.dir / f"rank{self.rank}-{os.getpid()}.sock")
        self._authkey = secrets.token_bytes(32)
        Path(self.address).unlink(missing_ok=True)  # a killed worker's, same pid reused
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self._authkey)
        self.descriptor_path = self.dir / f"rank{self.rank}{DESCRIPTOR_SUFFIX}"
        self._write_descriptor(module)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="flowgrpo-receiver-accept",
                                        daemon=True)
        self._thread.start()

    def descriptor(self, module: nn.Module) -> dict[str, Any]:
        device = next(module.parameters()).device
        uuid = None
        if device.type == "cuda":
            from ipc.transport import device_uuid

            uuid = device_uuid(device.index if device.index is not None else 0)
        return {"rank": self.rank, "pid": os.getpid(), "address": self.address,
                "authkey": self._authkey.hex(), "backend": self.receiver.backend,
                "device": str(device), "device_uuid": uuid, "packing": self.packing,
                "names": list(synced_parameters(module)),
                "committed_version": self.committed, "protocol": PROTOCOL}

    def assert_servable(self) -> None:
        """Raise ipc.WeightSyncError while the served weights are no policy version: a failed
        full sync left them dirty, or an adapter run's base is written without its adapter."""
        self.receiver.assert_servable()
        self.lora.assert_servable()

    def _committed(self, version: int, mode: str) -> None:
        self.lora.base_written(version)
        self._publish(version)

    def _publish(self, version: int) -> None:
        # republished so that a trainer that connects later numbers its syncs above it (both
        # channels commit the trainer's numbers)
        with self._lock:
            self.committed = max(int(version), -1 if self.committed is None else self.committed)
            self._write_descriptor(self.module)

    def _write_descriptor(self, module: nn.Module) -> None:
        tmp = self.descriptor_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.descriptor(module), f)
        os.replace(tmp, self.descriptor_path)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:  # listener closed, or a client that failed the authkey
                if self._closed:
                    return
                log.warning("flowgrpo weight receiver: a connection failed its handshake")
                continue
            try:
                self._open(conn)
            except Exception:
                log.exception("flowgrpo weight receiver: cannot serve the new connection")
                conn.close()

    def _open(self, conn) -> None:
        """The channel a new connection asks for in its first message (module docstring)."""
        if not conn.poll(OPEN_TIMEOUT_S):
            raise TimeoutError(f"no channel request within {OPEN_TIMEOUT_S:g} s")
        msg = conn.recv()
        kind = msg[0] if isinstance(msg, tuple) and len(msg) == 2 else None
        if kind == "weights":
            self.lora.trainer_connected()
            conn.send(("ready", {}))
            self.receiver.serve(conn)
        elif kind == "adapter":
            try:
                staging = self.lora.open(msg[1])
            except AdapterSpecError as exc:
                conn.send(("refused", exc.problems))
                conn.close()
                return
            conn.send(("ready", {}))
            staging.serve(conn)
        else:
            conn.send(("refused", [f"unknown channel request {str(msg)[:80]} (this worker "
                                   f"speaks receiver protocol {PROTOCOL})"]))
            conn.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.receiver.close()
        self.lora.close()
        for path in (self.descriptor_path, Path(self.address)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass


def read_descriptors(port: int | str) -> list[dict[str, Any]]:
    """Every live worker's descriptor for the server on ``port`` (what the HTTP route returns);
    a descriptor whose process has exited is left out."""
    from ipc.protocol import pid_alive

    out = []
    base = receiver_dir(port)
    for path in sorted(base.glob(f"*{DESCRIPTOR_SUFFIX}")) if base.is_dir() else []:
        try:
            desc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if pid_alive(desc.get("pid")):
            out.append(desc)
    return out
