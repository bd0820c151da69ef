"""Weight sync into a stock SGLang diffusion server, in SGLang's own payload format.

Facts of the released API (sglang 0.5.23) this module is written against:

- ``POST /update_weights_from_tensor`` takes JSON ``{"serialized_named_tensors": [one payload
  per TP worker], "payload_gpu_uuids": [GPU UUID each payload was exported from] | null,
  "load_format": "flattened_bucket" | null, "target_modules": ["transformer"],
  "weight_update_mode": "lora_merge" | null, "lora_alpha", "lora_rank"}``. A payload is the
  base64 of a ``ForkingPickler`` pickle (torch's multiprocessing reductions: CUDA IPC handles
  with the device given by GPU UUID; shared memory for CPU tensors), read back by a restricted
  unpickler (torch rebuild functions, builtins, ``types.SimpleNamespace``...). A
  ``flattened_bucket`` payload is ``{"flattened_tensor": uint8 [bytes], "metadata": [entries
  with name, shape, dtype, start_idx, end_idx, numel]}``, keyed by module name
  (``{"transformer": bucket}``: a bare dict would be read as a module -> payload map).
- ``POST /update_weights_from_tensor_checker`` with ``{"target_module", "expected_named_tensors_
  sha256": {name: hex}}`` compares SHA-256 of ``str(dtype)``, ``repr(tuple(shape))`` and the raw
  bytes of each live tensor; 200 only when every one matches.
- ``POST /update_weights_from_disk`` ``{"model_path", "target_modules"}`` reloads
  ``<model_path>/<module>/*.safetensors``.
- There is no weight version on the server: the trainer keeps it (``client.committed_version``
  is set only after a verified sync).

We send our (diffusers) names; SGLang's updater maps them into the native DiT's packed
parameters. The checker looks names up on the live module, so the manifest names what the
server holds: a packed parameter's digest is that of its sections concatenated, from SGLang's
own packing table (trainer/engine/sglang/packing.py). ``lora_merge`` updates (adapter sync
mode) are checked too: the merged weights' SHA-256 are computed as SGLang merges
(trainer/engine/sglang/lora.py), packed layers' sections stacked as SGLang stacks them.
"""
from __future__ import annotations

import base64
import copyreg
import hashlib
import io
import time
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions)
from safetensors.torch import save_file
from torch.multiprocessing import reductions

from trainer.config.sections import lora_sync_mode
from trainer.engine.embedded.client import EngineError
from trainer.engine.sglang.client import SGLangEngineClient
from trainer.engine.sglang.lora import LoraBases, lora_layer, lora_pairs, pair_buckets
from trainer.engine.sglang.packing import ServedLayout, packed_lora_groups
from trainer.engine.sglang.rollout import family_tables, sglang_families, stock_problems
from trainer.engine.sglang.verify import SyncCheck, VerifyPolicy

TARGET_MODULE = "transformer"
_PEFT_PREFIX = "base_model.model."


class SGLangSyncError(EngineError):
    """A weight sync into SGLang failed or could not be verified; the served weights are stale."""


@dataclass
class SGLangSyncStats:
    """What one sync moved (the fields the loop's metrics read)."""

    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    checksum: str | None = None
    hashed_bytes: int = 0        # bytes SHA-256'd per side for the checker (the policy's pick)
    timings: dict[str, float] = field(default_factory=dict)


def tensor_sha256(t: torch.Tensor) -> str:
    """The digest SGLang's tensor-update checker computes for one tensor."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256()
    h.update(str(t.dtype).encode("utf-8"))
    h.update(repr(tuple(t.shape)).encode("utf-8"))
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID SGLang matches payloads by (None for a CPU tensor: an unlabeled payload)."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def _reduce_tensor_by_uuid(t: torch.Tensor):
    """torch's reduction, with a CUDA tensor's device index replaced by its GPU UUID: SGLang's
    receiver maps the UUID back to its own device index (process-local indices differ)."""
    # a process that also hosts SGLang's receiver (in-process tests) has torch's reducer
    # replaced by SGLang's patch, which assumes CUDA tensors: reduce with the original
    reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)
    rebuild, args = reduce(t)
    if t.is_cuda:
        args = (*args[:6], gpu_uuid(t.device), *args[7:])  # arg 6 is the device index
    return rebuild, args


def serialize_payload(obj: Any) -> str:
    """base64(ForkingPickler pickle) of ``obj``, as SGLang's MultiprocessingSerializer reads it."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table = copyreg.dispatch_table.copy()
    pickler.dispatch_table.update(ForkingPickler._extra_reducers)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor_by_uuid
    pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor_by_uuid
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's ``flattened_bucket`` payload: every tensor's bytes in one uint8 tensor."""
    metadata, parts, offset = [], [], 0
    for name, t in named:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(SimpleNamespace(name=name, shape=list(t.shape), dtype=str(t.dtype),
                                        start_idx=offset, end_idx=offset + flat.numel(),
                                        numel=flat.numel()))
        parts.append(flat)
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def _materialize(t: Any) -> torch.Tensor:
    """A plain tensor from a tensor, a DTensor or an ``ipc.LazyTensor``."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach()


def _split_lora(payload: Iterable[tuple[str, Any]]
                ) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """(plain, LoRA) tensors under the served module's names: the peft prefix and
    ``.base_layer`` dropped from plain names. Tensors stay unmaterialized (lazy/sharded)."""
    plain, lora = [], []
    for name, t in payload:
        name = name.removeprefix(_PEFT_PREFIX)
        if lora_layer(name) is not None:
            lora.append((name, t))
        else:
            plain.append((name.replace(".base_layer.", "."), t))
    return plain, lora


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _buckets(named: Iterable[tuple[str, Any]], bucket_bytes: int, dtype: torch.dtype | None):
    bucket, size = [], 0
    for name, t in named:
        t = _cast(_materialize(t), dtype)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class SGLangWeightSync:
    """Pushes the actor's weights into one SGLang server and verifies them there.

    ``transport``: "tensor" (``/update_weights_from_tensor``, flattened buckets of at most
    ``bucket_bytes``) or "disk" (write ``<disk_dir>/transformer/model.safetensors`` and call
    ``/update_weights_from_disk``). ``dtype``: floating tensors are sent in the server's
    dtype (the checker hashes dtype and bytes as the server holds them). ``lora``:
    ``(alpha, rank)`` for payloads with LoRA tensors (the adapter sync mode, and the first,
    full sync of a peft model): those go as ``lora_merge`` updates, a layer's A and B (and a
    packed layer's sections) always in one request. ``served_dit``: the native DiT class the
    server runs (the adapter's ``sglang_dit``), whose packing table names the served
    parameters; None keeps the sent names. Every update is checked with
    ``/update_weights_from_tensor_checker`` (plain tensors by their bytes, a ``lora_merge`` by
    the merged weights it must leave, computed from the base weights this sender sent); only
    then does ``client.committed_version`` advance, so a rollout from unverified weights fails
    the driver's check. ``verify``: which served tensors each sync hashes for the checker
    (trainer/engine/sglang/verify.py: all of them at the first sync and after
    ``request_full()``, a rotating window of the model's bytes otherwise).
    """

    self_verifying = True  # the loop need not compare checksums itself

    def __init__(self, client: Any, *, transport: str = "tensor", bucket_bytes: int = 512 << 20,
                 disk_dir: str | Path | None = None, lora: tuple[float, int] | None = None,
                 target_module: str = TARGET_MODULE, dtype: torch.dtype | None = None,
                 served_dit: str | None = None, verify: VerifyPolicy | None = None) -> None:
        problems = []
        if transport not in ("tensor", "disk"):
            problems.append(f"transport must be 'tensor' or 'disk', got {transport!r}")
        if transport == "disk" and disk_dir is None:
            problems.append("the 'disk' transport needs disk_dir (a directory the server can read)")
        if transport == "disk" and lora is not None:
            problems.append("the 'disk' transport writes full weights: use sync mode full or merge")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            problems.append(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        if problems:
            raise ValueError("SGLangWeightSync: " + "; ".join(problems))
        self.client, self.transport, self.bucket_bytes = client, transport, bucket_bytes
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        self.lora, self.target_module, self.dtype = lora, target_module, dtype
        self.lora_bases = LoraBases()
        self.layout = ServedLayout(served_dit)
        self.verify = verify or VerifyPolicy()

    def request_full(self) -> None:
        """The next sync hashes every tensor (the loop calls it when it saves a checkpoint)."""
        self.verify.request_full()

    def close(self) -> None:
        """Drop the kept LoRA base weights (the sender holds no other resource)."""
        self.lora_bases.weights.clear()

    # ---- one sync ---------------------------------------------------------------------------
    def sync(self, version: int, payload: Iterable[tuple[str, Any]], *, mode: str = "full"
             ) -> SGLangSyncStats:
        """Send ``payload`` ((name, tensor) in the engine's names) as weight version ``version``."""
        start = time.perf_counter()
        plain, lora = _split_lora(payload)
        if lora and self.lora is None:
            raise SGLangSyncError("the payload holds LoRA tensors but no lora=(alpha, rank)")
        if mode == "adapter" and not lora:
            raise SGLangSyncError(f"weight version {version}: an adapter-mode sync without LoRA "
                                  "tensors")
        if not plain and not lora:
            raise SGLangSyncError(f"weight version {version}: the payload holds no tensors")
        stats = SGLangSyncStats()
        lora_layers = {lora_layer(n)[0] for n, _ in lora}
        check = self.verify.start(version)  # one choice of hashed tensors for the whole sync
        if plain:
            self._sync_plain(version, plain, lora_layers, stats, check)
        stats.timings["write"] = time.perf_counter() - start
        if lora:
            self._sync_lora(version, lora, stats, check)
        stats.timings["verify"] = time.perf_counter() - start - stats.timings["write"]
        check.finish()
        stats.hashed_bytes = check.hashed_bytes
        self.client.committed_version = int(version)
        stats.seconds = time.perf_counter() - start
        return stats

    def _sync_plain(self, version: int, named: list[tuple[str, Any]], lora_layers: set[str],
                    stats: SGLangSyncStats, check: SyncCheck) -> None:
        """A plain update, checked under the served names; the base weights of
        ``lora_layers`` are kept as the server holds them (it merges every later adapter
        into exactly these bytes)."""
        if self.transport == "disk":
            tensors = {n: t.contiguous() for bucket in _buckets(named, 1 << 62, self.dtype)
                       for n, t in bucket}
            self._write_and_reload(tensors)
            buckets: Iterable[list[tuple[str, torch.Tensor]]] = [list(tensors.items())]
        else:
            buckets = _buckets(named, self.bucket_bytes, self.dtype)
        served_lora = {layer for layer, _ in
                       packed_lora_groups(self.layout, lora_layers).items()}
        digests, packer = {}, self.layout.packer()
        for bucket in buckets:
            if self.transport == "tensor":
                self._post_bucket(bucket, False)
            for n, t in bucket:
                for served, tensor in packer.add(n, t):
                    if check.wants(served, tensor.numel() * tensor.element_size()):
                        digests[served] = tensor_sha256(tensor)
                    if served.endswith(".weight") and served[:-len(".weight")] in served_lora:
                        self.lora_bases.keep(served[:-len(".weight")], tensor)
            stats.tensors += len(bucket)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if packer.missing():
            raise SGLangSyncError(f"weight version {version}: the server packs sections the "
                                  f"payload lacks: {packer.missing()[:5]}")
        try:
            self._check(digests, version)
        except SGLangSyncError as exc:
            if not lora_layers:
                raise
            raise SGLangSyncError(f"{exc} (a server that merged an adapter before keeps its "
                                  "linear weights under '.base_layer.' and merges into the base "
                                  "it first saw: restart the SGLang server before the full sync "
                                  "of a new or resumed adapter run)") from None

    def _lora_groups(self, version: int, named: list[tuple[str, Any]]):
        """The LoRA pairs grouped by served layer (a packed layer: every section, in order)."""
        try:
            pairs = lora_pairs((n, _cast(_materialize(t), self.dtype)) for n, t in named)
        except ValueError as exc:
            raise SGLangSyncError(f"weight version {version}: {exc}") from None
        groups, problems = [], []
        for served, members in packed_lora_groups(self.layout, pairs).items():
            sections = [(index, layer, pairs[layer]) for index, layer in members]
            if members[0][0] is not None:
                _, _, count = self.layout.place(f"{members[0][1]}.weight")
                shapes = {(tuple(a.shape), tuple(b.shape)) for _, _, (a, b) in sections}
                if [m[0] for m in members] != list(range(count)):
                    problems.append(f"{served}: LoRA on sections {[m[0] for m in members]} of "
                                    f"{count} (the server merges a packed layer's sections "
                                    "together: train all of them or none)")
                elif len(shapes) != 1:
                    problems.append(f"{served}: LoRA sections of unequal shapes {sorted(shapes)}")
            groups.append((served, sections))
        if problems:
            raise SGLangSyncError(f"weight version {version}: " + "; ".join(problems))
        return groups

    def _sync_lora(self, version: int, named: list[tuple[str, Any]],
                   stats: SGLangSyncStats, check: SyncCheck) -> None:
        """``lora_merge`` updates, a layer's pair never split, then the merged weights checked."""
        alpha = self.lora[0]
        digests: dict[str, str] = {}
        for bucket in pair_buckets(self._lora_groups(version, named), self.bucket_bytes):
            try:
                expected = self.lora_bases.manifest(bucket, alpha, tensor_sha256,
                                                    wants=check.wants)
            except KeyError as exc:
                raise SGLangSyncError(f"weight version {version}: {exc.args[0]} (the first sync "
                                      "of an adapter run sends the full model)") from None
            named_bucket = [(f"{layer}.lora_{k}.weight", t) for _, sections in bucket
                            for _, layer, ab in sections for k, t in zip("AB", ab)]
            self._post_bucket(named_bucket, True)
            digests.update(expected)
            stats.tensors += len(named_bucket)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in named_bucket)
        self._check(digests, version)

    def _post_bucket(self, bucket: list[tuple[str, torch.Tensor]], lora_merge: bool) -> None:
        flat = flattened_bucket(bucket)
        body: dict[str, Any] = {
            # a dict payload maps module name -> that module's payload
            "serialized_named_tensors": [serialize_payload({self.target_module: flat})],
            "payload_gpu_uuids": None,
            "load_format": "flattened_bucket",
            "target_modules": [self.target_module],
        }
        uuid = gpu_uuid(flat["flattened_tensor"].device)
        if uuid is not None:
            body["payload_gpu_uuids"] = [uuid]
        if lora_merge:
            alpha, rank = self.lora
            body.update(weight_update_mode="lora_merge", lora_alpha=alpha, lora_rank=rank)
        self._post("/update_weights_from_tensor", body)
        # the handles in the payload point at flat's memory: it must outlive the call (it does:
        # the call is synchronous and SGLang copies into its own parameters)
        del flat

    def _write_and_reload(self, tensors: dict[str, torch.Tensor]) -> None:
        module_dir = self.disk_dir / self.target_module
        module_dir.mkdir(parents=True, exist_ok=True)
        tmp = module_dir / "model.safetensors.tmp"
        save_file({n: t.cpu() for n, t in tensors.items()}, str(tmp))
        tmp.replace(module_dir / "model.safetensors")
        self._post("/update_weights_from_disk", {"model_path": str(self.disk_dir),
                                                 "target_modules": [self.target_module]})

    def _check(self, digests: dict[str, str], version: int) -> None:
        if not digests:  # a sampled sync whose window no tensor of this payload meets
            return
        try:
            self._post("/update_weights_from_tensor_checker",
                       {"target_module": self.target_module,
                        "expected_named_tensors_sha256": digests})
        except SGLangSyncError as exc:
            raise SGLangSyncError(f"weight version {version} is not what the server holds: "
                                  f"{exc}") from None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = self.client._call("POST", path, body)
        except EngineError as exc:
            raise SGLangSyncError(f"{path}: {exc}") from None
        except ValueError as exc:  # EngineRequestError: SGLang answered 4xx with its message
            raise SGLangSyncError(f"{path}: {exc}") from None
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise SGLangSyncError(f"{path} answered {reply!r}")
        return reply


# ---- the trainer's hooks ---------------------------------------------------------------------
def _family_problems(adapter_path: str, extension: bool) -> list[str]:
    """The model family must be one whose adapter says where SGLang keeps its conditions
    (``sglang_conditions``) and which native DiT serves it (``sglang_dit``). A shipped family
    that SGLang cannot roll out says why in its adapter's ``sglang_refusal``, and that reason
    is the refusal; one that rolls out only with the extension (``extension``) says why stock
    SGLang cannot in ``sglang_stock_refusal``; a family with none of these (a user's own
    adapter) gets the generic one."""
    from trainer.models import adapter_class

    try:
        cls = adapter_class(adapter_path)
    except ValueError:
        return []  # the adapter path's own problem is reported by preflight's model checks
    family = getattr(cls, "family", None)
    stock_reason = getattr(cls, "sglang_stock_refusal", None)
    if family_tables(family) is not None and getattr(cls, "sglang_dit", None):
        if stock_reason and not extension:
            return [f"model family {family!r} cannot roll out on stock SGLang: {stock_reason} "
                    "(set rollout.sglang_extension=true with the extension loaded in the "
                    "server, see trainer/engine/README.md, or use rollout.engine='embedded')"]
        return []
    reason = getattr(cls, "sglang_refusal", None)
    if reason:
        return [f"model family {family!r} cannot roll out on rollout.engine='sglang': {reason} "
                "(use rollout.engine='embedded'; trainer/engine/README.md says per family what "
                "SGLang serves)"]
    return [f"model family {family!r}: the SGLang client maps the denoising env of "
            f"{sglang_families()} only: its adapter names no SGLang rollout mapping "
            "(sglang_conditions, sglang_dit); trainer/engine/README.md says per family what "
            "SGLang serves"]


#: Reference sizes (width, height) preflight probes SGLang's sizing with: square, landscape,
#: portrait, wide, and a small picture (rounding decides its size).
PROBE_SIZES = ((1024, 1024), (1200, 900), (900, 1200), (1920, 1080), (40, 24))


def _sglang_reference_sizes(config_path: str, method: str) -> dict[tuple[int, int], tuple[int, int]] | None:
    """What SGLang's pipeline config sizes each probe reference at for the VAE; None when
    SGLang does not import here (a trainer environment without it)."""
    import importlib

    module, _, name = config_path.rpartition(".")
    try:
        config_cls = getattr(importlib.import_module(module), name)
    except ImportError:
        return None
    sizing = getattr(config_cls(), method)
    return {probe: tuple(int(v) for v in sizing(None, *probe)) for probe in PROBE_SIZES}


def _reference_area_problems(model: Any) -> list[str]:
    """A family whose SGLang pipeline sizes references itself (``sglang_reference_sizing``:
    Qwen-Image-Edit, Edit-Plus) rolls out on SGLang only when the adapter's
    ``reference_area`` sizes every reference as SGLang does, else the replay would feed the
    transformer another reference grid than SGLang's DiT saw. SGLang's sizing is read from its
    own config code (so a server patched to another area is what this sees); where SGLang does
    not import, from the area SGLang 0.5.23 hard-codes."""
    from trainer.models import adapter_class

    try:
        cls = adapter_class(model.adapter_path)
    except ValueError:
        return []  # the adapter path's own problem is reported by preflight's model checks
    sizing = getattr(cls, "sglang_reference_sizing", None)
    if sizing is None:
        return []
    from trainer.models.qwen_image_edit import SGLANG_REFERENCE_AREA, reference_dimensions

    ours = (model.adapter_options or {}).get("reference_area")
    served = _sglang_reference_sizes(*sizing)
    if served is None:
        served = {probe: reference_dimensions(SGLANG_REFERENCE_AREA, *probe) for probe in PROBE_SIZES}
    square = served[PROBE_SIZES[0]]
    area = square[0] * square[1]
    if ours is not None and all(reference_dimensions(ours, *probe) == size
                                for probe, size in served.items()):
        return []
    setting = ("unset (each reference at the output geometry)" if ours is None
               else f"{ours} pixels")
    return [f"model family {cls.family!r} on SGLang: SGLang sizes each reference at about {area} "
            f"pixels at its aspect ratio (a square one at {square[0]}x{square[1]}: "
            f"{sizing[0].rpartition('.')[2]}.{sizing[1]}), but model.adapter_options.reference_area "
            f"is {setting}, so the replay would not see the reference grid SGLang's DiT saw: set "
            f"model.adapter_options.reference_area={area}"]


def sglang_config_problems(model: Any, rollout: Any, lora: Any) -> list[str]:
    """Preflight: why a run with these ``[model]``, ``[rollout]`` and ``[lora]`` sections
    cannot train on its SGLang servers ([] when it can)."""
    r, sync_mode = rollout, lora_sync_mode(lora)
    problems = [f"rollout.sampling: {p}" for p in
                stock_problems(r.sampling.to_dict(), extension=bool(r.sglang_extension))]
    problems += _family_problems(model.adapter_path, bool(r.sglang_extension))
    problems += _reference_area_problems(model)
    if r.sglang_weight_sync not in ("tensor", "disk"):
        problems.append(f"rollout.sglang_weight_sync must be 'tensor' or 'disk', "
                        f"got {r.sglang_weight_sync!r}")
    elif r.sglang_weight_sync == "disk" and sync_mode == "adapter":
        problems.append("rollout.sglang_weight_sync='disk' reloads full weights: LoRA adapter "
                        "sync mode needs 'tensor' (SGLang's lora_merge), or drop adapter_mode")
    alpha = lora.alpha or lora.rank
    if sync_mode == "adapter" and float(alpha) != int(alpha):
        problems.append(f"lora.alpha={lora.alpha!r}: SGLang's lora_merge takes an integer "
                        "lora_alpha")
    conc = r.sglang_concurrency
    if isinstance(conc, bool) or not isinstance(conc, int) or conc < 1:
        problems.append(f"rollout.sglang_concurrency must be a positive integer, got {conc!r}")
    return problems


def connect_sglang(model: Any, rollout: Any, lora: Any, weight_sync: Any, rank: int,
                   run_dir: str | Path, adapter: Any) -> tuple[Any, Any]:
    """(client, sender) for this rank's SGLang server: an SGLang run always has a sender, so
    the server can never keep serving the base weights while the actor trains. The loop's
    first sync (at construction) fails, and with it the run, if the server cannot take one.

    The sender is our transport (``SGLangTransport``) when ``rollout.sglang_extension`` is on
    and the server publishes weight receivers, else the stock ``SGLangWeightSync``. With the
    extension on, a server without the route, or whose receivers are on but none is usable
    here, is an error (``TransportError``, naming why): a silent fallback would hide a broken
    server setup behind a slower, sampled verification. A server started with
    ``FLOWGRPO_WEIGHT_RECEIVER=0`` (receivers deliberately off) gets the stock path, with a
    warning."""
    r, sync_mode = rollout, lora_sync_mode(lora)
    problems = sglang_config_problems(model, rollout, lora)
    if problems:
        raise ValueError("engine 'sglang':\n  - " + "\n  - ".join(problems))
    url = r.sglang_urls[rank]
    client = SGLangEngineClient(url, embedded=False, concurrency=r.sglang_concurrency,
                                extension=bool(r.sglang_extension))
    if r.sglang_extension:
        transport = _extension_transport(sync_mode, lora, weight_sync, client, url)
        if transport is not None:
            return client, transport
    lora_scale = None  # (alpha, rank) for SGLang's lora_merge
    if sync_mode == "adapter":
        lora_scale = (lora.alpha or lora.rank, lora.rank)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(r.engine_dtype)
    sender = SGLangWeightSync(client, transport=r.sglang_weight_sync, dtype=dtype,
                              bucket_bytes=weight_sync.bucket_size_mb << 20,
                              disk_dir=Path(run_dir) / "sglang_weights" / f"rank{rank}",
                              lora=lora_scale,
                              served_dit=getattr(adapter, "sglang_dit", None))
    return client, sender


def _trainer_device() -> torch.device:
    """The device this rank trains on (the loop set it before building the engine): the
    receiver to use is the one on it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _extension_transport(sync_mode: str, lora: Any, weight_sync: Any,
                         client: SGLangEngineClient, url: str) -> Any:
    """``SGLangTransport`` to this rank's receiver (LoRA adapter mode: with the adapter's
    scaling, as the loop merges it); None when the server's receivers are turned off
    (connect_sglang's docstring says why that, and only that, falls back)."""
    import logging

    from trainer.engine.sglang.transport import (ReceiversOff, SGLangTransport, fetch_receivers,
                                                 pick_receiver)
    from trainer.models.lora import lora_scaling

    try:
        receivers = fetch_receivers(url)
    except ReceiversOff as exc:
        logging.getLogger(__name__).warning(
            "%s: syncing through the stock path (update_weights_from_tensor + sampled "
            "checker) instead of the extension's transport", exc)
        return None
    scaling = None
    if sync_mode == "adapter":
        scaling = lora_scaling(lora.rank, lora.alpha)
    return SGLangTransport(pick_receiver(receivers, _trainer_device()), client=client,
                           bucket_bytes=weight_sync.bucket_size_mb << 20,
                           timeout_s=weight_sync.timeout_s, lora_scaling=scaling)
