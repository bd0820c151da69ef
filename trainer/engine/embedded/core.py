"""``EngineCore``: the embedded engine's state and operations, independent of any transport.

It holds the adapter's frozen parts (VAE, text encoders), a copy of the transformer (with the
trainer's peft LoRA layers in adapter mode) and the ipc ``WeightReceiver`` that writes synced
weights straight into that transformer's parameters. The pipe transport (``process.py``), the
HTTP mode (``http_server.py``) and the in-process client all call the methods below.

Design choices:
- The latent state is fp32 whatever the engine dtype; the adapter casts to the transformer's
  dtype inside ``velocity``. The recorded trajectory is therefore exactly what the actor replays.
- Prompts repeated in a request (a group's candidates) are encoded once and gathered.
- Weight names given to the receiver are ``adapter.weight_name_map`` of this transformer's own
  names. The transformer is built like the trainer's (same diffusers class, same
  ``peft.get_peft_model`` config), so the trainer reaches the same names by applying the same
  map: full mode covers every tensor, adapter mode the ``lora_`` tensors, merge mode the rest.
- ``release()`` drops the device storage of the frozen parts (kept as a pinned host copy taken
  once: they never change), moves a receiver-less transformer to the host and empties the
  allocator cache; with a receiver the transformer's weights live in transport memory that the
  trainer writes into, so they stay resident. ``generate`` refuses to run while released (the
  trainer wakes the engine with ``resume()`` first).
"""
from __future__ import annotations

import gc
import io
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
from torch import nn

from ipc import WeightReceiver, weights_checksum
from trainer.utils.dtypes import RUN_DTYPES, TORCH_DTYPES
from trainer.engine.embedded.lora_merge import LoraMerger
from trainer.engine.embedded.request import GenerateSpec, parse_generate_request
from trainer.engine.embedded.sampler import denoise
from flowgrpo_kernels.ode_solvers import engine_flash_tail, solve_tail
from trainer.engine.embedded.trunk import plan_trunk, run_trunk, select_rows
from trainer.models.base import GenerativeModelAdapter
from trainer.media import ImageRef
from trainer.models.geometry import Geometry
from trainer.models.compile import compile_blocks, compile_events, compile_wanted
from trainer.models.guidance import guided_velocity, with_negative
from trainer.models.lora import apply_lora
from trainer.profiling import ComputeMeter, nvtx_range
from trainer.utils.values import import_dotpath

LORA_KEYS = ("rank", "alpha", "target_modules", "dropout", "merge")


class EngineStateError(RuntimeError):
    """The engine cannot serve this call in its current state (released, closed); HTTP 409."""


def check_launch_args(*, adapter_path: Any, model_path: Any, device: Any, dtype: Any,
                      lora: Any) -> None:
    """One ValueError naming every bad launch argument (cheap: nothing is loaded)."""
    problems = []
    if not isinstance(adapter_path, str) or "." not in adapter_path:
        problems.append(f"adapter_path must be a dotted path to an adapter class, got {adapter_path!r}")
    if not isinstance(model_path, (str, os.PathLike)) or not Path(model_path).is_dir():
        problems.append(f"model_path {model_path!r} is not a directory")
    if dtype not in RUN_DTYPES:
        problems.append(f"dtype must be one of {sorted(RUN_DTYPES)}, got {dtype!r}")
    try:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            problems.append(f"device {device!r} requested but CUDA is not available")
    except (RuntimeError, TypeError):
        problems.append(f"device {device!r} is not a torch device")
    if lora is not None:
        if not isinstance(lora, dict):
            problems.append(f"lora must be a dict (rank, alpha, target_modules) or None, got {lora!r}")
        else:
            unknown = sorted(set(lora) - set(LORA_KEYS))
            if unknown:
                problems.append(f"lora has unknown keys {unknown} (known: {list(LORA_KEYS)})")
            rank = lora.get("rank")
            if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
                problems.append(f"lora.rank must be a positive integer, got {rank!r}")
            alpha = lora.get("alpha", rank)
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
                problems.append(f"lora.alpha must be a positive number, got {alpha!r}")
            targets = lora.get("target_modules")
            if targets is not None and (not isinstance(targets, (list, tuple)) or not targets
                                        or not all(isinstance(t, str) for t in targets)):
                problems.append(f"lora.target_modules must be a non-empty list of names, got {targets!r}")
            if not isinstance(lora.get("merge", True), bool):
                problems.append(f"lora.merge must be a boolean, got {lora.get('merge')!r}")
            if lora.get("dropout", 0.0) != 0.0:
                problems.append("lora.dropout must be 0 (a stochastic forward breaks ratio == 1)")
    if problems:
        raise ValueError("cannot launch the embedded engine:\n  - " + "\n  - ".join(problems))


def _modules_in(frozen: dict[str, Any]) -> dict[str, nn.Module]:
    return {k: v for k, v in frozen.items() if isinstance(v, nn.Module)}


def _warm_up_images(adapter: GenerativeModelAdapter, geometry: Geometry,
                    batch: int) -> list[tuple[ImageRef, ...]] | None:
    """For a family with conditioning media, one grey reference at the output geometry per
    candidate (its sequence then has the length a rollout's will); None for text-to-image."""
    if adapter.max_condition_images == 0:
        return None
    buffer = io.BytesIO()
    Image.fromarray(np.full((geometry.height, geometry.width, 3), 128, dtype=np.uint8)).save(
        buffer, format="PNG")
    return [(ImageRef.from_bytes(buffer.getvalue()),)] * batch


class EngineCore:
    """One engine: ``generate``, ``checksum``, ``get_version``, ``release``, ``resume``,
    ``health``, ``update_weights_from_disk``, ``close``. Thread-safe (one operation at a time)."""

    def __init__(self, adapter: GenerativeModelAdapter, transformer: nn.Module,
                 frozen: dict[str, Any], *, device: str | torch.device,
                 receiver_factory: Callable[..., Any] | None = None, lora: bool = False,
                 merge_lora: bool = False, share_trunk: bool = False,
                 flash_ratio: float | None = None) -> None:
        self.adapter = adapter
        self.share_trunk = share_trunk  # trainer.engine.embedded.trunk
        self.flash_ratio = flash_ratio  # MixGRPO-Flash's tail compression; None: Euler
        self.transformer = transformer.eval().requires_grad_(False)
        self.frozen = frozen
        self.device = torch.device(device)
        self.lora = lora
        raw = dict(self.transformer.named_parameters())
        self.name_map = adapter.weight_name_map(list(raw))
        self.params = {self.name_map[n]: p for n, p in raw.items()}
        names = list(self.params)
        lora_names = [n for n in names if "lora_" in n]
        self.modes = {"full": names, "merge": [n for n in names if "lora_" not in n]}
        if lora:
            self.modes["adapter"] = lora_names
        # adapter served merged into the base weights (trainer.engine.embedded.lora_merge)
        self.merger = LoraMerger(self.transformer) if lora and merge_lora else None
        self._base_stale = False     # a sync rewrote the base weights the merger keeps
        self._merge_pending = self.merger is not None
        self.warmup_s: float | None = None  # seconds of warm_up() (compiles), when it ran
        self.receiver = receiver_factory(self.params, self.modes, self._on_commit) \
            if receiver_factory else None
        self.released = False
        self.closed = False
        self.generate_calls = 0
        self._host_copies: dict[str, torch.Tensor] = {}
        self._lock = threading.RLock()
        self.meter = ComputeMeter()

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def load(cls, *, adapter_path: str, model_path: str, adapter_options: dict | None,
             device: str, dtype: str, lora: dict | None, weight_sync_conn: Any = None,
             receiver_backend: str = "auto", compile: str = "none",
             warmup: dict | None = None, share_trunk: bool = False,
             flash_ratio: float | None = None) -> "EngineCore":
        check_launch_args(adapter_path=adapter_path, model_path=model_path, device=device,
                          dtype=dtype, lora=lora)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            # the VAE decoder's convolutions run at one geometry per run: let cuDNN time its
            # algorithms once per shape and keep the fastest (this process serves nothing else)
            torch.backends.cudnn.benchmark = True
        adapter = import_dotpath(adapter_path)(str(model_path), **(adapter_options or {}))
        torch_dtype = TORCH_DTYPES[dtype]
        transformer = adapter.load_train_model(dtype=torch_dtype, device=dev)
        if lora:
            transformer = apply_lora(
                transformer, rank=int(lora["rank"]), alpha=lora.get("alpha", lora["rank"]),
                target_modules=list(lora.get("target_modules") or adapter.lora_target_modules()))
        frozen = adapter.load_frozen(device=dev, dtype=torch_dtype)
        factory = None
        if weight_sync_conn is not None:
            def factory(params, modes, on_commit):
                receiver = WeightReceiver(weight_sync_conn, params, modes=modes,
                                          backend=receiver_backend, on_commit=on_commit)
                receiver.start()
                return receiver
        if compile_wanted(compile, dev):
            compile_blocks(adapter.transformer_blocks(transformer), adapter.block_dynamic_dims)
            adapter.compile_frozen(frozen)
        core = cls(adapter, transformer, frozen, device=dev, receiver_factory=factory,
                   lora=bool(lora), merge_lora=bool(lora) and bool(lora.get("merge", True)),
                   share_trunk=share_trunk, flash_ratio=flash_ratio)
        if warmup:
            core.warm_up(**warmup)
        return core

    # ---- served weights: the merged adapter ---------------------------------------------------
    def _on_commit(self, version: int, mode: str) -> None:
        """Receiver thread, after a sync committed: what is served must be re-derived."""
        if self.merger is not None:
            self._base_stale = self._base_stale or mode != "adapter"
            self._merge_pending = True

    def _capture_if_stale(self) -> bool:
        """Keep the merger's base current: a sync that rewrote every base tensor is captured as
        it is. True when it was (the weights then hold the unmerged base)."""
        if self._base_stale or not self.merger.base:
            self.merger.capture_base()  # the sync wrote every base tensor: it IS the base
            self._base_stale = False
            return True
        return False

    def _restore_base(self) -> None:
        """Weights back to the unmerged base, exactly."""
        if not self._capture_if_stale() and self.merger.merged:
            self.merger.unmerge()

    def _serve_merged(self) -> None:
        if self.merger is None or not self._merge_pending:
            return
        with nvtx_range("rollout/lora_merge"):
            # no unmerge first: merge() writes base + delta over a merged weight
            self._capture_if_stale()
            self.merger.merge()
        self._merge_pending = False

    def warm_up(self, *, height: int, width: int, batch: int, frames: int = 1) -> dict[str, Any]:
        """Run the transformer at the configured geometry before the first request, so the
        first rollout does not pay the compile. Two prompt lengths: where the adapter marks
        the text dimension dynamic the second compiles nothing; where it marks nothing, torch
        turns the dimension dynamic here rather than at a later rollout."""
        with self._lock, torch.no_grad():
            self._serve_merged()
            t0, before = time.perf_counter(), compile_events()
            geometry = Geometry(height, width, frames)
            shape = tuple(self.adapter.latent_shape(geometry))
            images = _warm_up_images(self.adapter, geometry, batch)
            for prompt in ("warm-up", "a warm-up prompt with rather more words than the first"):
                cond = self._conditions([prompt] * batch, images, geometry)
                x = torch.randn((batch, *shape), device=self.device)
                sigma = torch.full((batch,), 0.5, device=self.device)
                self.adapter.velocity(self.transformer, x, sigma, cond, geometry)
            self.adapter.decode(self.frozen, x, geometry)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.warmup_s = time.perf_counter() - t0
        return {"seconds": self.warmup_s, "compiles": compile_events() - before}

    # ---- generate -------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self.closed:
            raise EngineStateError(f"engine is closed ({what})")
        if self.released:
            raise EngineStateError(f"engine memory is released; call resume() before {what}")

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _conditions(self, prompts: list[str], images: list[tuple] | None,
                    geometry: Geometry) -> dict[str, torch.Tensor]:
        """The adapter's conditions of every candidate; a (prompt, reference images) pair
        repeated in the request (a group's candidates) is encoded once and gathered."""
        keys = list(zip(prompts, images if images is not None else [()] * len(prompts)))
        unique = list(dict.fromkeys(keys))
        unique_images = None if images is None else [refs for _, refs in unique]
        with nvtx_range("rollout/encode_prompts"), self.meter.region("text_encoder", self.device):
            encoded = self.adapter.encode_conditions(self.frozen, [p for p, _ in unique],
                                                     unique_images, geometry)
        if unique == keys:
            return dict(encoded)
        pos = {k: i for i, k in enumerate(unique)}
        out = {}
        for key, value in encoded.items():
            idx = torch.tensor([pos[k] for k in keys], dtype=torch.long, device=value.device)
            out[key] = value.index_select(0, idx)
        return out

    def _negative_conditions(self, positive: dict[str, torch.Tensor], images: list[tuple] | None,
                             geometry: Geometry) -> dict[str, torch.Tensor]:
        """CFG's negative: the empty prompt, with the same reference images (an edit's
        negative), its image part taken from ``positive`` where the adapter can."""
        with nvtx_range("rollout/encode_prompts"), self.meter.region("text_encoder", self.device):
            negative = self.adapter.negative_conditions(self.frozen, positive, geometry)
        if negative is not None:
            return negative
        return self._conditions([""] * next(iter(positive.values())).shape[0], images, geometry)

    def _noise(self, spec: GenerateSpec):
        """x_T [B, *latent] fp32 on the device, and the step-noise function of the sampler."""
        adapter, geometry, ids = self.adapter, spec.geometry, spec.sample_ids
        latent_shape = tuple(adapter.latent_shape(geometry))
        if spec.driver_xt:  # the driver's recipe: a pure function of (seed, sample id, stream)
            x_t = self._to_device(adapter.initial_latents(spec.initial_noise_ids or ids, geometry,
                                                          seed=spec.noise_seed,
                                                          dtype=torch.float32, device="cpu"))

            def noise_fn(step: int) -> torch.Tensor:
                return self._to_device(adapter.step_noise(ids, step, latent_shape, seed=spec.noise_seed,
                                                          dtype=torch.float32, device="cpu"))
            return x_t, noise_fn
        # Without driver_xt the engine draws from its own generator seeded with `seed`, in a
        # fixed order (x_T, then the SDE steps in schedule order): reproducible per request.
        gen = torch.Generator(device=self.device).manual_seed(spec.seed)
        draw = torch.randn((len(ids), *adapter.init_noise_shape(geometry)), generator=gen,
                           device=self.device, dtype=torch.float32)
        x_t = adapter.noise_to_latents(draw, geometry).to(torch.float32)

        def own_noise(step: int) -> torch.Tensor:
            return torch.randn((len(ids), *latent_shape), generator=gen, device=self.device,
                               dtype=torch.float32)
        return x_t, own_noise

    def _flash_tail(self, x: torch.Tensor, velocity, sigmas: list[float],
                    first: int) -> torch.Tensor:
        """MixGRPO-Flash's ODE tail from ``sigmas[first]`` (flowgrpo_kernels.ode_solvers)."""
        tail = engine_flash_tail([float(v) for v in sigmas], first, self.flash_ratio)
        rows = x.shape[0]
        x, _ = solve_tail(x, lambda z, sigma: velocity(
            z, torch.full((rows,), sigma, dtype=torch.float32, device=z.device)), tail)
        return x

    def _velocity_rows(self, x: torch.Tensor, sigma: torch.Tensor,
                       conditions: dict[str, torch.Tensor], spec: GenerateSpec) -> torch.Tensor:
        with self.meter.region("transformer", self.device):
            return guided_velocity(self.adapter, self.transformer, x, sigma, conditions,
                                   spec.geometry, spec.guidance_scale)

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serve one rollout request (``trainer.models.wire``); tensors stay on the device."""
        with self._lock:
            self._check_open("generate")
            spec = parse_generate_request(self.adapter, request)
            self.meter = ComputeMeter()  # this request's regions only (a failed one leaves none)
            if self.receiver is not None:
                self.receiver.assert_servable()
            t0, compiles_before = time.perf_counter(), compile_events()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self._serve_merged()
            geometry, images = spec.geometry, spec.condition_images
            with torch.no_grad(), nvtx_range("rollout/generate"):
                positive = self._conditions(spec.prompts, images, geometry)
                negative = (self._negative_conditions(positive, images, geometry)
                            if spec.guidance_scale != 1.0 else {})
                conditions = with_negative(positive, negative, spec.guidance_scale)
                x_t, noise_fn = self._noise(spec)

                def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
                    with self.meter.region("transformer", self.device):
                        return guided_velocity(self.adapter, self.transformer, x, sigma, conditions,
                                               geometry, spec.guidance_scale)

                # a group sharing x_T and its ODE trunk computes the trunk once (trunk.py)
                plan = plan_trunk(spec.initial_noise_ids, spec.prompts, spec.sde_indices) \
                    if self.share_trunk else None
                k, x_start, step_noise = 0, x_t, noise_fn
                if plan is not None:
                    trunk_conditions = select_rows(conditions, plan.unique)
                    x_start = run_trunk(plan, lambda x, s: self._velocity_rows(
                        x, s, trunk_conditions, spec), x_t, spec.sigmas)
                    k = plan.branch_step
                    step_noise = lambda i: noise_fn(i + k)  # noqa: E731 (the schedule's own index)
                # MixGRPO-Flash: after the last SDE step, DPM-Solver++(2M) on a compressed tail
                stop = len(spec.sigmas) if self.flash_ratio is None or not spec.sde_indices \
                    else max(spec.sde_indices) + 2
                out = denoise(velocity, x_start, spec.sigmas[k:stop],
                              [i - k for i in spec.sde_indices],
                              eta=spec.eta, sde_type=spec.sde_type, noise_fn=step_noise,
                              record=spec.return_trajectory, sde_options=spec.sde_options())
                if stop < len(spec.sigmas):
                    out.final = self._flash_tail(out.final, velocity, spec.sigmas, stop - 1)
                with nvtx_range("rollout/vae_decode"), self.meter.region("vae", self.device):
                    decoded = self.adapter.decode(self.frozen, out.final, geometry)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # NOTE: host sync, once per request (timing)
            self.generate_calls += 1
            response: dict[str, Any] = {
                "request_id": spec.request_id,
                "prompt": spec.prompts,
                "seed": spec.seed,
                "sample_ids": spec.sample_ids,
                **geometry.request_fields(),
                "sde_indices": list(spec.sde_indices),
                "rollout_log_probs": out.log_probs,
                "images": decoded,
                "policy_version": self.get_version(),
                "inference_time_s": time.perf_counter() - t0,
                # model compute inside this request, seconds per part (perf/compute/engine_*)
                "compute_s": self.meter.pop(),
                # torch.compile compilations this request caused (0 once warmed up)
                "compiles": compile_events() - compiles_before,
                # what the colocated actor must leave free (trainer.actor.colocate)
                "memory_allocated_bytes": self._allocated(),
                "memory_peak_bytes": int(torch.cuda.max_memory_allocated(self.device))
                if self.device.type == "cuda" else 0,
            }
            if spec.return_trajectory:
                sig = torch.tensor(spec.sigmas, dtype=torch.float32)
                response["dit_trajectory"] = {
                    "latents": out.trajectory,
                    "timesteps": self.adapter.timesteps_from_sigmas(sig),
                    "sigmas": sig,
                    "final": out.final,  # x_0 (DiffusionNFT trains on it)
                }
            if spec.return_env:
                response["denoising_env"] = conditions
            return response

    # ---- weights --------------------------------------------------------------------------
    def get_version(self) -> int:
        return int(self.receiver.version) if self.receiver is not None else 0

    def checksum(self) -> str:
        """Of the weights as synced: a merged adapter is unmerged first (re-merged lazily)."""
        with self._lock:
            if self.merger is not None:
                self._restore_base()
                self._merge_pending = True
            if self.receiver is not None:
                return self.receiver.checksum()
            return weights_checksum(self.params)

    def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        """Load the transformer's safetensors (``<model_path>/transformer/`` or ``<model_path>``)
        into the live parameters, in place, by engine name. Every base tensor must be present
        with its shape; LoRA tensors may be absent (a plain diffusers checkpoint), in which case
        they keep their values. The committed weight version does not change."""
        with self._lock:
            self._check_open("update_weights_from_disk")
            root = Path(model_path)
            folder = root / "transformer" if (root / "transformer").is_dir() else root
            files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
            if not files:
                raise ValueError(f"no *.safetensors under {folder} (expected a diffusers transformer "
                                 "directory or a model directory with transformer/)")
            state: dict[str, torch.Tensor] = {}
            for f in files:
                state.update(load_file(str(f)))
            problems = []
            unexpected = sorted(set(state) - set(self.params))
            missing = sorted(n for n in self.params if n not in state and "lora_" not in n)
            if unexpected:
                problems.append(f"{len(unexpected)} tensors unknown to the engine, e.g. {unexpected[:3]}")
            if missing:
                problems.append(f"{len(missing)} engine tensors missing, e.g. {missing[:3]}")
            shapes = [f"{n}: {tuple(t.shape)} vs engine {tuple(self.params[n].shape)}"
                      for n, t in state.items() if n in self.params and t.shape != self.params[n].shape]
            if shapes:
                problems.append(f"{len(shapes)} shape mismatches, e.g. {shapes[:3]}")
            if problems:
                raise ValueError(f"cannot load weights from {folder}:\n  - " + "\n  - ".join(problems))
            if self.merger is not None:
                self._restore_base()
            with torch.no_grad():
                for name, tensor in state.items():
                    self.params[name].copy_(tensor)
            if self.merger is not None:  # every base tensor was rewritten (missing ones refused)
                self._base_stale, self._merge_pending = True, True
            return {"success": True, "message": f"loaded {len(state)} tensors from {folder}",
                    "tensors": len(state)}

    # ---- memory ----------------------------------------------------------------------------
    def _frozen_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter and buffer of the frozen modules, once each."""
        out, seen = [], set()
        for mname, module in _modules_in(self.frozen).items():
            for tname, t in [*module.named_parameters(), *module.named_buffers()]:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append((f"{mname}.{tname}", t))
        return out

    def _offload(self) -> list[str]:
        """Drop the device storage of the frozen parts (their pinned host copy is taken once:
        frozen weights never change, so a release costs no copy and a resume one pinned H2D
        copy, instead of a pageable round trip per step), and move a receiver-less
        transformer to the host (its weights can change, so it is really copied)."""
        for key, t in self._frozen_tensors():
            if key not in self._host_copies:
                self._host_copies[key] = t.detach().to("cpu").pin_memory()
            t.data = t.data.new_empty(0)
        moved = list(_modules_in(self.frozen))
        if self.receiver is None:
            self.transformer.to("cpu")
            moved.append("transformer")
        return moved

    def _onload(self) -> list[str]:
        for key, t in self._frozen_tensors():
            t.data = self._host_copies[key].to(self.device, non_blocking=True)
        moved = list(_modules_in(self.frozen))
        if self.receiver is None:
            self.transformer.to(self.device)
            moved.append("transformer")
        return moved

    def release(self) -> dict[str, Any]:
        """Free device memory for the colocated actor. Raises on failure (fatal: docs/design.md#engine)."""
        with self._lock:
            if self.closed:
                raise EngineStateError("engine is closed (release)")
            if self.released:
                return {"success": True, "message": "already released", "moved": []}
            with nvtx_range("offload"):
                # no gc.collect(): the dropped storages have no reference cycles, and a full
                # collection over a heap of compiled graphs costs more than the release itself
                moved = self._offload() if self.device.type == "cuda" else []
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self.released = True
            kept = ["transformer (ipc transport memory)"] if self.receiver is not None else []
            return {"success": True, "moved": moved, "kept_resident": kept,
                    "memory_allocated_bytes": self._allocated()}

    def resume(self) -> dict[str, Any]:
        """Bring released parts back to the device. Raises on failure (fatal: docs/design.md#engine)."""
        with self._lock:
            if self.closed:
                raise EngineStateError("engine is closed (resume)")
            if not self.released:
                return {"success": True, "message": "not released", "moved": []}
            with nvtx_range("onload"):
                moved = self._onload() if self.device.type == "cuda" else []
            self.released = False
            return {"success": True, "moved": moved, "memory_allocated_bytes": self._allocated()}

    def _allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0

    # ---- status -----------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        dirty = bool(getattr(self.receiver, "dirty", False)) if self.receiver is not None else False
        status = "closed" if self.closed else "released" if self.released else "dirty" if dirty else "ok"
        return {
            "status": status, "engine": "flowgrpo-embedded", "family": self.adapter.family,
            "device": str(self.device), "dtype": str(next(iter(self.params.values())).dtype),
            "version": self.get_version(), "released": self.released, "dirty": dirty,
            "lora": self.lora, "lora_merged": self.merger is not None,
            "weight_sync": self.receiver is not None, "pid": os.getpid(),
            "compiles": compile_events(), "warmup_s": self.warmup_s,
            "generate_calls": self.generate_calls, "num_params": len(self.params),
            "memory_allocated_bytes": self._allocated(),
        }

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.receiver is not None:
                self.receiver.close()
            self.frozen.clear()
            self.transformer = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
