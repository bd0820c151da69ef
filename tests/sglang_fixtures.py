"""SGLang's own diffusion server (sglang==0.5.23) on loopback, over a tiny Qwen-Image, SD3,
FLUX.1, Wan 2.1 / 2.2 or Wan 2.1 / 2.2 image-to-video (the family's native SGLang pipeline:
``NATIVE_PIPELINES``; a Wan checkpoint is served as ``served_model`` says, at the end of this
module), on CPU.

    with serve_sglang(model_dir) as server:   # server.url, server.adapter, server.served_tensors()
        ...

The server is split as SGLang splits it: the HTTP process (here: the test process, SGLang's
FastAPI routers in a uvicorn thread) and a worker process that holds the pipeline (here: one
spawned child, ``_worker_main``). What runs is SGLang's code:

- HTTP side: ``rollout_api`` and ``weights_api`` routers (request parsing, ``SamplingParams``
  validation against the Qwen-Image pipeline config, ``prepare_request``, per-output slicing of
  the rollout answer, msgpack + tensor tags, weight-route request objects).
- worker side: ``QwenImagePipeline`` built by SGLang from the model directory with its own
  component loaders: SGLang's native ``QwenImageTransformer2DModel`` (packed ``to_added_qkv``),
  its native ``AutoencoderKLQwenImage``, its scheduler and tokenizer; its stage list
  (input validation, text encoding with Qwen-Image's template and drop index, latent
  preparation, timestep preparation with ``prepare_mu``, the denoising stage with the rollout
  hooks and ``FlowRolloutController``, decoding), run by the pipeline's own executor; the
  scheduler/worker post-training mixins (payload selection, ``MultiprocessingSerializer``,
  ``WeightsUpdater`` with the native model's name mapping into packed parameters, ``lora_merge``,
  ``TensorUpdateChecker``, ``get_weights_checksum``).

What stands in, and why (nothing else does):

1. SGLang's CPU kernels: on a CPU, SGLang's ``CustomOp`` layers dispatch to ``forward_cpu`` and
   ``fuse_scale_shift_kernel`` to ``_fuse_scale_shift_kernel_cpu``, which call
   ``torch.ops.sgl_kernel.*_cpu`` from sgl-kernel's CPU build. That build is not published as a
   wheel (PyPI's ``sgl-kernel`` is the CUDA build), so every ``CustomOp`` runs its own
   ``forward_native`` and ``fuse_scale_shift_kernel`` is SGLang's own torch fallback
   (``fallback_torch.fuse_scale_shift_kernel_native``, what SGLang selects on MPS/MUSA).
2. SGLang's scheduler process and its ZMQ sockets: ``async_scheduler_client.forward`` sends
   each request to the worker over a pipe, one at a time, and the worker calls what SGLang's
   GPU worker calls (``pipeline.forward`` for a ``Req``, the mixin's handler for a weight
   request). Process groups (world size 1) use gloo on CPU instead of NCCL.
3. The worker's GPU UUID (SGLang picks the payload exported from its own GPU by it): a CPU has
   none, so ``server.set_device_uuid(uuid)`` answers ``current_platform.get_device_uuid`` in
   the worker for the test of that selection.
4. With ``extension=True``, the two functions the extension hooks at server start are the
   fixture's own: the worker's pipeline is built as above (not by ``build_pipeline``, whose
   checkpoint loading this fixture does step by step), and the HTTP app by ``build_app`` (not
   ``create_app``). The extension's hook functions are applied to them as SGLang's hook
   registry applies them: ``install_weight_receiver`` puts our ipc receiver on the native DiT,
   ``add_receiver_route`` adds ``GET /flowgrpo/weight_receivers``; both see the HTTP port as
   ``server_args.port`` (their rendezvous, trainer/engine/sglang/receiver.py).
5. SGLang's native Qwen2.5-VL text encoder does not import against the installed transformers
   (``Qwen2_5_VLCausalLMOutputWithPast`` is gone): SGLang's own loader then falls back to
   transformers' ``Qwen2_5_VLModel``, and that is what encodes (SGLang's behaviour, untouched).
6. SGLang's SD3 VAE config holds the spatial compression ratio as a constant (8, the real
   SD3 VAE's four blocks) and its latent preparation divides the image size by it, while the
   decoder upsamples by what the checkpoint's ``block_out_channels`` give. A real checkpoint
   agrees with the constant; the tiny one (two blocks, ratio 2) does not, so the fixture sets
   the ratio from SGLang's own ``get_vae_scale_factor`` of the checkpoint's config, as a real
   SD3 server's config ends up.

7. With ``reference_area`` (Qwen-Image-Edit / Edit-Plus), the one number SGLang's Edit pipeline
   configs size a reference at: they pass 1024 * 1024 to their module's ``_calculate_dimensions``
   (Edit's condition size and image grid, Plus's ``VAE_IMAGE_SIZE``), and a megapixel reference
   on this CPU costs minutes per candidate, a stand-in for GPU speed.
   ``shrink_edit_reference_area`` passes the given area instead of that number only, in both
   processes (so preflight, which reads SGLang's sizing, sees it too); every other area (Plus's
   384 * 384 for the vision-language encoder) and everything else is SGLang's.

Precision: fp32 everywhere (``dit_precision``, ``vae_precision``, ``text_encoder_precisions``),
so the engine-vs-replay gap measured against the trainer's diffusers transformer is the gap
between the two implementations, not a dtype's rounding.

The worker keeps torch.distributed and SGLang's monkey patches (torch reductions, kernels) out
of the test process, where the trainer runs single-process.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import pickle
import socket
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: seconds any one call to the worker may take (a rollout of the tiny model takes a few)
WORKER_TIMEOUT_S = 300.0

_SG = "sglang.multimodal_gen."
#: Per family SGLang serves natively: its pipeline class and config class (as ``sglang serve``
#: resolves them from a model id, which a tiny local directory does not carry).
NATIVE_PIPELINES = {
    "qwen_image": (_SG + "runtime.pipelines.qwen_image.QwenImagePipeline",
                   _SG + "configs.pipeline_configs.qwen_image.QwenImagePipelineConfig"),
    "sd3": (_SG + "runtime.pipelines.stable_diffusion_3.StableDiffusion3Pipeline",
            _SG + "configs.pipeline_configs.stablediffusion3.StableDiffusion3PipelineConfig"),
    "flux": (_SG + "runtime.pipelines.flux.FluxPipeline",
             _SG + "configs.pipeline_configs.flux.FluxPipelineConfig"),
}

#: Families whose SGLang VAE config keeps the real checkpoint's spatial compression ratio as a
#: constant instead of reading it from the checkpoint (item 6 of the module docstring).
RATIO_FROM_CHECKPOINT = ("sd3",)


def _attr(dotpath: str):
    import importlib

    module, _, name = dotpath.rpartition(".")
    return getattr(importlib.import_module(module), name)


def family_of(model_dir) -> str:
    """The family of a tiny model directory (tests/tiny_models.py names it after the family,
    tests/wan_i2v_models.py after the Wan image-to-video variant: ``WAN_I2V_DIRS``)."""
    name = Path(model_dir).name
    return WAN_I2V_DIRS.get(name, name)


@contextlib.contextmanager
def _process_state_kept():
    """Importing SGLang sets cache-directory environment variables and warning filters: put
    both back, so the rest of the suite runs as it would without SGLang installed."""
    environ = dict(os.environ)
    try:
        with warnings.catch_warnings():
            yield
    finally:
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)


def require_sglang() -> None:
    """Skip the calling test module unless SGLang imports (under CI=true the skip fails the
    run: tests/ci_skips.py). The message keeps the real ImportError: a dependency SGLang
    imports and the requirements file lacks shows up by name."""
    import pytest

    with _process_state_kept():
        try:
            import sglang.multimodal_gen  # noqa: F401
        except ImportError as exc:
            pytest.skip(f"could not import 'sglang.multimodal_gen': {exc} (install "
                        "tests/requirements-sglang.txt, then sglang==0.5.23 with --no-deps: "
                        "the README's test command)", allow_module_level=True)


def _http_modules():
    """What the HTTP process imports from SGLang."""
    with _process_state_kept():
        from sglang.multimodal_gen.runtime.entrypoints.post_training import (rollout_api,
                                                                              weights_api)
        # the trainer reads the native DiT's packing table (trainer/engine/sglang/packing.py):
        # imported here first, so its import-time side effects are undone as well
        from sglang.multimodal_gen.runtime.loader import utils  # noqa: F401
        from sglang.multimodal_gen.runtime.models.dits import (flux, qwen_image,  # noqa: F401
                                                              stablediffusion3)
        from sglang.multimodal_gen.runtime.scheduler_client import async_scheduler_client
        from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args
    return locals()


def restore_torch_reductions() -> None:
    """Undo SGLang's ``monkey_patch_torch_reductions`` in this process (a test that runs
    SGLang's deserializer here applies it): the patched reducer assumes CUDA tensors and
    breaks pickling CPU tensors, which the rest of the suite does through
    torch.multiprocessing."""
    from torch.multiprocessing import reductions

    if hasattr(reductions, "_reduce_tensor_original"):
        reductions.reduce_tensor = reductions._reduce_tensor_original
        reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
        del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
        reductions.init_reductions()


def server_args(model_dir, modules: dict | None = None):
    """SGLang's ``ServerArgs`` for a tiny model: the family's native pipeline class and config
    (``NATIVE_PIPELINES``), fp32 components (module docstring)."""
    s = modules or _http_modules()
    pipeline, config = NATIVE_PIPELINES[family_of(model_dir)]
    model_id, config, flags = served_model(model_dir, config)  # Wan: the end of this module
    config_cls = _attr(config)
    args = s["ServerArgs"](model_path=str(model_dir),
                           pipeline_class_name=pipeline.rpartition(".")[2], model_id=model_id)
    encoders = len(config_cls().text_encoder_precisions)
    args.pipeline_config = config_cls(dit_precision="fp32", vae_precision="fp32",
                                      text_encoder_precisions=("fp32",) * encoders, **flags)
    vae = args.pipeline_config.vae_config
    vae.update_model_arch(json.loads((Path(model_dir) / "vae" / "config.json").read_text()))
    vae.post_init()
    if family_of(model_dir) in RATIO_FROM_CHECKPOINT:  # item 6 of the module docstring
        vae.arch_config.spatial_compression_ratio = vae.get_vae_scale_factor()
    return args


# ---- the worker process ------------------------------------------------------------------------
def _cpu_kernels() -> None:
    """Replacement 1 of the module docstring."""
    from sglang.kernels.ops.diffusion.common import fallback_torch
    from sglang.multimodal_gen.runtime.layers import elementwise, layernorm
    from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp

    CustomOp.dispatch_forward = lambda self: self.forward_native
    for module in (layernorm, elementwise):
        module.fuse_scale_shift_kernel = fallback_torch.fuse_scale_shift_kernel_native


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: The area SGLang 0.5.23's Edit pipeline configs hard-code (item 7 of the module docstring).
SGLANG_EDIT_AREA = 1024 * 1024


def shrink_edit_reference_area(area: int):
    """Item 7 of the module docstring: SGLang's Edit configs size references at ``area`` where
    they pass ``SGLANG_EDIT_AREA``; returns the function that undoes it."""
    from sglang.multimodal_gen.configs.pipeline_configs import qwen_image

    original = qwen_image._calculate_dimensions

    def calculate_dimensions(target_area, ratio):
        return original(area if target_area == SGLANG_EDIT_AREA else target_area, ratio)

    qwen_image._calculate_dimensions = calculate_dimensions

    def undo() -> None:
        qwen_image._calculate_dimensions = original
    return undo


class _Worker:
    """The worker side: SGLang's pipeline and its post-training mixins (module docstring)."""

    def __init__(self, model_dir: str, extension: bool, port: int,
                 reference_area: int | None = None) -> None:
        from sglang.multimodal_gen.runtime.distributed import parallel_state
        from sglang.multimodal_gen.runtime.entrypoints.post_training import io_struct
        from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req
        from sglang.multimodal_gen.runtime.post_training import (gpu_worker_post_training_mixin,
                                                                  scheduler_post_training_mixin)
        from sglang.multimodal_gen.runtime.server_args import set_global_server_args

        _cpu_kernels()
        if reference_area is not None:  # item 7
            shrink_edit_reference_area(reference_area)
        if extension:
            _load_extension()
        self.server_args = server_args(model_dir)
        self.server_args.port = port
        set_global_server_args(self.server_args)
        parallel_state.maybe_init_distributed_environment_and_model_parallel(
            1, 1, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        pipeline_cls = _attr(NATIVE_PIPELINES[family_of(model_dir)][0])
        self.pipeline = pipeline_cls(model_dir, self.server_args)
        if extension:  # replacement 4: the extension's build_pipeline hook, on this pipeline
            from trainer.engine.sglang import extension as ext

            ext.install_weight_receiver(lambda *a, **k: self.pipeline, self.server_args)
        self.Req, self.io = Req, io_struct

        class Worker(gpu_worker_post_training_mixin.GPUWorkerPostTrainingMixin):
            local_rank = 0
            rank = 0

        class Scheduler(scheduler_post_training_mixin.SchedulerPostTrainingMixin):
            worker = Worker()

        Worker.pipeline, Worker.server_args = self.pipeline, self.server_args
        # the process groups SGLang's GPU worker keeps (gloo, world size 1)
        Worker.sp_group, Worker.tp_group = parallel_state.get_sp_group(), parallel_state.get_tp_group()
        Worker.sp_cpu_group, Worker.tp_cpu_group = Worker.sp_group.cpu_group, Worker.tp_group.cpu_group
        Scheduler.server_args = self.server_args
        self.scheduler = Scheduler()

    def forward(self, req):
        if isinstance(req, self.Req):
            out = self.pipeline.forward(req, self.server_args)
            return out, _stepped(req)
        io, sched = self.io, self.scheduler
        handlers = {io.UpdateWeightFromTensorReqInput: sched._handle_update_weights_from_tensor,
                    io.UpdateWeightFromTensorCheckerReqInput:
                        sched._handle_update_weights_from_tensor_checker,
                    io.UpdateWeightFromDiskReqInput: sched._handle_update_weights_from_disk,
                    io.GetWeightsChecksumReqInput: sched._handle_get_weights_checksum}
        return handlers[type(req)]([req]), None

    def set_device_uuid(self, uuid: str) -> None:
        from sglang.srt.platforms import current_platform

        current_platform.get_device_uuid = lambda index: uuid

    def named_tensors(self, module: str = "transformer") -> dict[str, torch.Tensor]:
        m = self.pipeline.get_module(module)
        out = {n: p.detach().clone() for n, p in m.named_parameters()}
        out.update({n: b.detach().clone() for n, b in m.named_buffers()})
        return out


def _stepped(req) -> dict[str, Any]:
    """What the tests read back from the request SGLang's loop stepped."""
    scheduler = getattr(req, "scheduler", None)
    return {"seed": req.seed, "num_outputs_per_prompt": req.num_outputs_per_prompt,
            "cfg": bool(req.sampling_params.should_use_classifier_free_guidance()),
            "sigmas": None if scheduler is None else scheduler.sigmas.clone(),
            "timesteps": None if req.timesteps is None else req.timesteps.clone()}


def _load_extension() -> None:
    """What SGLang's plugin loader does in every process for ``SGLANG_PLUGINS=flowgrpo``."""
    from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry

    from trainer.engine.sglang import extension

    extension.register()
    HookRegistry.apply_hooks()


def _worker_main(conn, model_dir: str, extension: bool, port: int,
                 reference_area: int | None = None) -> None:
    torch.set_num_threads(1)  # tiny model: intra-op threads only spin (tests/conftest.py)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            worker = _Worker(model_dir, extension, port, reference_area)
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    while True:
        try:
            op, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if op == "stop":
            return
        try:
            reply = ("ok", getattr(worker, op)(*args))
        except BaseException:
            reply = ("error", traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply))


class WorkerProcess:
    """The spawned worker and the one pipe to it; every call has a deadline."""

    def __init__(self, model_dir, *, extension: bool = False, port: int = 0,
                 reference_area: int | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.lock = threading.Lock()
        self.process = ctx.Process(target=_worker_main,
                                   args=(child, str(model_dir), extension, port, reference_area),
                                   daemon=True)
        self.process.start()
        child.close()
        self._reply("starting SGLang's pipeline", 600.0)

    def _reply(self, what: str, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"the SGLang worker did not answer {what} within {timeout_s} s")
        status, value = pickle.loads(self.conn.recv_bytes())
        if status == "error":
            raise RuntimeError(f"the SGLang worker failed {what}:\n{value}")
        return value

    def call(self, op: str, *args):
        with self.lock:
            self.conn.send_bytes(pickle.dumps((op, args)))
            return self._reply(op, WORKER_TIMEOUT_S)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send_bytes(pickle.dumps(("stop", ())))
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.conn.close()


# ---- the HTTP process --------------------------------------------------------------------------
class SGLangServer:
    """``url``; ``adapter`` (the trainer's adapter of the served checkpoint, for building
    requests); ``requests`` (what SGLang's loop stepped, per rollout request: seed, outputs,
    CFG, the scheduler's sigmas and timesteps) and ``weight_requests`` (every weight-route
    request object), in order; ``served_tensors()`` (the worker's live module tensors)."""

    def __init__(self, url: str, worker: WorkerProcess, adapter) -> None:
        self.url, self.worker, self.adapter = url, worker, adapter
        self.requests: list[dict[str, Any]] = []
        self.weight_requests: list = []

    def served_tensors(self, module: str = "transformer") -> dict[str, torch.Tensor]:
        return self.worker.call("named_tensors", module)

    def set_device_uuid(self, uuid: str) -> None:
        """The GPU UUID the worker reports (replacement 3 of the module docstring)."""
        self.worker.call("set_device_uuid", uuid)

    async def forward(self, req):
        return await asyncio.to_thread(self._forward, req)

    def _forward(self, req):
        from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req

        if not isinstance(req, Req):
            self.weight_requests.append(req)
        out, stepped = self.worker.call("forward", req)
        if stepped is not None:
            self.requests.append(stepped)
        return out


def build_app(server: SGLangServer, *, weights_api: bool = True, args=None):
    """SGLang's own post-training routers (plus a /health) in front of ``server``'s worker;
    ``weights_api=False`` leaves the weight routes out (a server that cannot take a sync).
    ``args``: the server's ``ServerArgs`` when the extension is loaded (its route is added as
    its ``create_app`` hook adds it: replacement 4)."""
    from fastapi import FastAPI

    s = _http_modules()
    # SGLang's routers call one process-wide client: one served worker at a time
    s["async_scheduler_client"].forward = server.forward
    app = FastAPI()
    app.include_router(s["rollout_api"].router)
    if weights_api:
        app.include_router(s["weights_api"].router)
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    if args is not None:
        from trainer.engine.sglang import extension

        app = extension.add_receiver_route(lambda *a, **k: app, server_args=args)
    return app


@contextlib.contextmanager
def serve_sglang(model_dir, *, weights_api: bool = True, extension: bool = False,
                 reference_area: int | None = None):
    """Start SGLang's worker process and its HTTP layer on a free loopback port; yields an
    SGLangServer. ``extension``: load ``trainer.engine.sglang.extension`` in both processes,
    as ``SGLANG_PLUGINS=flowgrpo`` does. ``reference_area``: item 7 of the module docstring
    (the server's adapter gets the same option)."""
    import uvicorn

    from trainer.models import adapter_class

    s = _http_modules()
    client = s["async_scheduler_client"]
    previous = client.__dict__.get("forward")  # an outer serve_sglang's worker, if any
    args = server_args(model_dir, s)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    args.port = sock.getsockname()[1]
    s["set_global_server_args"](args)
    if extension:
        with _process_state_kept():
            _load_extension()
    undo_area = None
    if reference_area is not None:  # item 7, in this process too (preflight reads it)
        undo_area = shrink_edit_reference_area(reference_area)
    strategy = torch.multiprocessing.get_sharing_strategy()
    # CPU tensors travel SGLang's payload through torch's reductions in shared-memory files
    torch.multiprocessing.set_sharing_strategy("file_system")
    server = None
    try:
        worker = WorkerProcess(model_dir, extension=extension, port=args.port,
                               reference_area=reference_area)
    except BaseException:
        sock.close()
        if undo_area is not None:
            undo_area()
        raise
    options = {} if reference_area is None else {"reference_area": reference_area}
    try:
        sglang = SGLangServer(f"http://127.0.0.1:{args.port}", worker,
                              adapter_class(family_of(model_dir))(str(model_dir), **options))
        app = build_app(sglang, weights_api=weights_api, args=args if extension else None)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("SGLang's HTTP layer did not start")
            time.sleep(0.05)
        yield sglang
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(timeout=30)
        sock.close()
        worker.close()
        if previous is None:
            client.__dict__.pop("forward", None)
        else:
            client.forward = previous
        restore_torch_reductions()
        torch.multiprocessing.set_sharing_strategy(strategy)
        if undo_area is not None:
            undo_area()


def stock_rollout(url: str, **fields: Any) -> dict:
    """One rollout request in SGLang's own schema, without the trainer's extension block (stock
    behaviour): a 4-step SDE rollout of one output with the trajectory and the denoising env
    returned; ``fields`` adds the family's (prompt, geometry, ``image_path``) or overrides."""
    import urllib.request

    import msgspec

    from trainer.engine.sglang.rollout import decode_tensors

    body = {"seed": 5, "num_inference_steps": 4, "num_outputs_per_prompt": 1,
            "guidance_scale": 1.0, "rollout": True, "rollout_sde_type": "sde",
            "rollout_noise_level": 0.7, "rollout_sde_step_indices": [1, 2],
            "rollout_return_dit_trajectory": True, "rollout_return_denoising_env": True,
            "rollout_debug_mode": False, "suppress_logs": True, **fields}
    request = urllib.request.Request(url + "/rollout/generate", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer = decode_tensors(msgspec.msgpack.decode(reply.read()))
    assert isinstance(answer, list) and len(answer) == 1
    return answer[0]


def tensor_shapes(obj: Any) -> list[tuple[int, ...]]:
    """The shape of every tensor in a nested answer (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return [tuple(obj.shape)]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in tensor_shapes(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in tensor_shapes(v)]
    return []


def trainer_overrides(model_dir, url: str, tmp_path, sampling: dict | None = None) -> list[str]:
    """Config overrides of a tiny run of ``model_dir``'s family against the SGLang server at
    ``url``."""
    from trainer.models import ADAPTERS

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"a red panda number {i}",
                                             "metadata": {"sample_id": f"p{i:03d}"}})
                                 for i in range(8)))
    sampling = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                "driver_sigmas": False, "driver_xt": False, "guidance_scale": 1.0,
                "sde_type": "sde", "sde_indices": [1, 2], "sde_pool": [1, 2, 3],
                "num_sde_steps": 2, **(sampling or {})}
    return [f"model.adapter_path={ADAPTERS[family_of(model_dir)]}",
            f"model.model_path={model_dir}", "rollout.engine=sglang",
            f"rollout.sglang_urls={json.dumps([url])}", f"rollout.sampling={json.dumps(sampling)}",
            "reward.scorer_path=trainer.rewards.jpeg.JpegCompressibilityScorer",
            "reward.required_components=[]", "reward.component_weights={}",
            f"data.prompt_data={prompts}", "data.eval_prompt_data=none",
            f"logging.run_dir={tmp_path / 'run'}", "logging.progress=false",
            "logging.tensorboard=false", "rollout.write_artifacts=false",
            "rollout.rollout_batch_size=1", "rollout.n_samples_per_prompt=4",
            "rollout.global_batch_size=none", "train.num_rollouts=2",
            "train.micro_batch_size=2", "train.lr=1e-3"]


def as_served(named, dit_class: str | None = None) -> dict[str, torch.Tensor]:
    """Our (diffusers) tensors under the native DiT's names, packed as it packs them
    (``dit_class``: the adapter's ``sglang_dit``; Qwen-Image's when None)."""
    from trainer.engine.sglang.packing import ServedLayout
    from trainer.models.qwen_image import QwenImageAdapter

    packer = ServedLayout(dit_class or QwenImageAdapter.sglang_dit).packer()
    return {served: t for n, p in named for served, t in packer.add(n, p.detach())}


def assert_served_and_sampled_from(trainer, adapter, server, old, new, step: int) -> None:
    """The server holds ``new``'s weights, and the next rollout (version ``step + 1``) was
    sampled by them: its recorded log-probs equal ``new``'s replay, not ``old``'s."""
    from trainer.actor.replay import replay_log_probs

    served = server.served_tensors()
    expected = as_served(new.named_parameters(), type(adapter).sglang_dit)
    assert all(torch.equal(served[n], p) for n, p in expected.items())
    batch = trainer.rollout(step + 1)
    assert batch.policy_version == step + 1
    with torch.no_grad():
        new_replay = replay_log_probs(adapter, new, batch, backend="torch")
        old_replay = replay_log_probs(adapter, old, batch, backend="torch")
    assert float((new_replay - batch.log_probs).abs().max()) < 2e-4
    assert float((old_replay - batch.log_probs).abs().max()) > 2e-3


def train_through_extension(cfg, server, adapter, steps: int = 2) -> int:
    """Train ``steps`` steps of ``cfg`` with SGLang and the trainer's extension, checking each:
    the weights go through our ipc/ transport (no SGLang weight route is called), the policy
    version is committed on the server, the first update's ratio is 1, and the next rollout is
    sampled by the new weights (``assert_served_and_sampled_from``). Returns the rollout
    requests SGLang served during the run."""
    from trainer.engine.sglang.transport import SGLangTransport
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    preflight(cfg, world_size=1, device="cpu")
    weight_routes, rollouts = len(server.weight_requests), len(server.requests)
    trainer = Trainer(cfg, rank=0, world=1, device="cpu")
    try:
        assert isinstance(trainer.sender, SGLangTransport)
        for step in range(steps):
            old = policy_copy(trainer, adapter)
            metrics = trainer.train_step(step)
            new = policy_copy(trainer, adapter)
            assert trainer.policy_version == trainer.engine.committed_version == step + 1
            if step == 0:
                assert abs(metrics["train/first_update_ratio_mean"] - 1.0) <= 2e-4
            assert_served_and_sampled_from(trainer, adapter, server, old, new, step)
        assert server.weight_requests[weight_routes:] == []
    finally:
        trainer.close()
    return len(server.requests) - rollouts


def policy_copy(trainer, adapter):
    """Our diffusers transformer holding the trainer's current weights (a replay model)."""
    names = trainer._engine_names()
    model = adapter.load_train_model().eval()
    # parameters only: buffers (SD3's fixed position table) are not trained and stay loaded
    missing, unexpected = model.load_state_dict(
        {names[n]: p.detach().clone() for n, p in trainer.model.named_parameters()},
        strict=False)
    buffers = {n for n, _ in model.named_buffers()}
    assert not unexpected and set(missing) <= buffers, (missing, unexpected)
    return model


# ---- Wan (text-to-video) -----------------------------------------------------------------------
NATIVE_PIPELINES["wan"] = (_SG + "runtime.pipelines.wan_pipeline.WanPipeline",
                           _SG + "configs.pipeline_configs.wan.WanT2V480PConfig")
#: The published Wan model a tiny Wan checkpoint stands for (tests/wan_models.py builds both).
WAN_MODEL_IDS = {False: "Wan2.1-T2V-1.3B-Diffusers", True: "Wan2.2-T2V-A14B-Diffusers"}


# ---- Wan image-to-video ------------------------------------------------------------------------
NATIVE_PIPELINES["wan_i2v"] = (_SG + "runtime.pipelines.wan_i2v_pipeline.WanImageToVideoPipeline",
                               _SG + "configs.pipeline_configs.wan.WanI2V480PConfig")
#: tests/wan_i2v_models.py's directory names -> the family they hold
WAN_I2V_DIRS = {"wan2.1-i2v": "wan_i2v", "wan2.2-i2v": "wan_i2v"}
#: The published Wan image-to-video model a tiny one stands for (by its experts' boundary).
WAN_I2V_MODEL_IDS = {False: "Wan2.1-I2V-14B-480P-Diffusers", True: "Wan2.2-I2V-A14B-Diffusers"}


def served_model(model_dir, config: str) -> tuple[str | None, str, dict[str, Any]]:
    """(``--model-id``, pipeline config class, config flags) of the server a user starts for
    ``model_dir``; for the image families (None, ``config``, {}).

    Wan, as a local Wan checkpoint is served: ``--model-id`` names the published model it is
    (Wan 2.2 T2V-A14B when model_index.json names the experts' boundary, else Wan 2.1 T2V), so
    SGLang's own registry picks that model's pipeline config (Wan 2.2: the boundary) and its
    sampling defaults (Wan 2.2: CFG 4.0 / 3.0, which the client's guidance 1.0 turns off), and
    ``--flow-shift`` is the checkpoint's scheduler ``flow_shift`` (image-to-video the same, with
    the published I2V model ids: ``WAN_I2V_MODEL_IDS``): SGLang's Wan configs fix the
    shift per model (Wan 2.2 A14B's: 12.0), the trainer's adapter reads the checkpoint's, and a
    schedule that differs moves Wan 2.2's trained steps across the boundary
    (trainer/engine/README.md). Wan's configs also decode in bf16 (``vae_decode_precision``): fp32
    here, as every other component (the module docstring's precision)."""
    ids = {"wan": WAN_MODEL_IDS, "wan_i2v": WAN_I2V_MODEL_IDS}.get(family_of(model_dir))
    if ids is None:
        return None, config, {}
    from sglang.multimodal_gen.registry import get_model_info

    index = json.loads((Path(model_dir) / "model_index.json").read_text())
    model_id = ids[index.get("boundary_ratio") is not None]
    info = get_model_info(str(model_dir), model_id=model_id)
    scheduler = json.loads((Path(model_dir) / "scheduler" / "scheduler_config.json").read_text())
    cls = info.pipeline_config_cls
    return model_id, f"{cls.__module__}.{cls.__qualname__}", {
        "flow_shift": scheduler["flow_shift"], "vae_decode_precision": "fp32"}


# ---- Qwen-Image-Edit and Edit-Plus -------------------------------------------------------------
NATIVE_PIPELINES["qwen_image_edit"] = (
    _SG + "runtime.pipelines.qwen_image.QwenImageEditPipeline",
    _SG + "configs.pipeline_configs.qwen_image.QwenImageEditPipelineConfig")
NATIVE_PIPELINES["qwen_image_edit_plus"] = (
    _SG + "runtime.pipelines.qwen_image.QwenImageEditPlusPipeline",
    _SG + "configs.pipeline_configs.qwen_image.QwenImageEditPlusPipelineConfig")
