"""SGLang's own post-training HTTP layer (sglang==0.5.23) on loopback, over a tiny Qwen-Image.

    with serve_sglang(model_dir) as server:   # server.url, server.scheduler
        ...

What is SGLang's code here: the FastAPI routers (``rollout_api``, ``weights_api``: request
parsing, ``SamplingParams`` validation, per-output slicing, msgpack + tensor tags), the
request -> ``Req`` preparation, the pipeline object (a ``LoRAPipeline``: SGLang's own
constructor, LoRA layer conversion and merge), Qwen-Image's timestep stage
(``TimestepPreparationStage`` with ``prepare_mu`` over SGLang's ``FlowMatchEulerDiscreteScheduler``
built from the checkpoint's scheduler config), the rollout hooks (``prepare_rollout_if_enabled``
is called through the denoising stage's module, where plugins hook it, as SGLang's loop calls
it), the scheduler's ``step`` with the ``FlowRolloutController`` transition (the SDE step, its
log-prob, the [T+1] trajectory, the denoising env), the scheduler/worker post-training mixins
(payload selection by GPU UUID, ``MultiprocessingSerializer`` + restricted unpickler,
``WeightsUpdater`` flattened-bucket reconstruction, in-place load and ``lora_merge``,
``TensorUpdateChecker``).
What stands in for SGLang's GPU runtime: ``TinyScheduler`` answers ``async_scheduler_client.
forward`` with the tiny diffusers model of tests/tiny_models.py (prompt encoding, the
transformer forward, VAE decode through our adapter; x_T drawn from the request's generators as
SGLang draws it: one generator per output seeded seed + k), and ``TinyPipeline`` hands SGLang's
pipeline constructor those already-built modules instead of loading a checkpoint.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
import warnings
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    """Skip the calling test module unless the pinned SGLang is installed."""
    import pytest

    with _process_state_kept():
        pytest.importorskip("sglang.multimodal_gen", reason="install tests/requirements-sglang."
                            "txt, then sglang==0.5.23 with --no-deps (README's test command)")


def _sglang():
    """SGLang's modules (importing them takes ~20 s: done once, lazily)."""
    with _process_state_kept():
        return _import_sglang()


def _import_sglang():
    from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import QwenImagePipelineConfig
    from sglang.multimodal_gen.runtime.entrypoints.post_training import (io_struct, rollout_api,
                                                                          weights_api)
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch, Req
    from sglang.multimodal_gen.runtime.pipelines.qwen_image import prepare_mu
    from sglang.multimodal_gen.runtime.pipelines_core.lora.pipeline import LoRAPipeline
    from sglang.multimodal_gen.runtime.pipelines_core.stages import denoising
    from sglang.multimodal_gen.runtime.post_training import (gpu_worker_post_training_mixin,
                                                              rollout_hooks,
                                                              scheduler_post_training_mixin,
                                                              tensor_update_checker)
    from sglang.multimodal_gen.runtime.models.schedulers.scheduling_flow_match_euler_discrete import (
        FlowMatchEulerDiscreteScheduler)
    from sglang.multimodal_gen.runtime.post_training.flow_rollout_controller import (
        FlowRolloutController)
    from sglang.multimodal_gen.runtime.scheduler_client import async_scheduler_client
    from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args
    return locals()


def restore_torch_reductions() -> None:
    """Undo SGLang's ``monkey_patch_torch_reductions`` (its worker applies it on every tensor
    update): the patched reducer assumes CUDA tensors and breaks pickling CPU tensors, which
    the rest of the suite does through torch.multiprocessing."""
    from torch.multiprocessing import reductions

    if hasattr(reductions, "_reduce_tensor_original"):
        reductions.reduce_tensor = reductions._reduce_tensor_original
        reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
        del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
        reductions.init_reductions()


def tiny_pipeline_class():
    """A ``LoRAPipeline`` over modules built in-process: SGLang's constructor runs (its LoRA
    bookkeeping, its stage list), only loading a checkpoint and building an executor are
    replaced; its stage is Qwen-Image's timestep preparation, as ``QwenImagePipeline`` adds it."""
    s = _sglang()

    class TinyPipeline(s["LoRAPipeline"]):
        pipeline_name = "TinyQwenImage"
        _required_config_modules = ["transformer", "scheduler"]

        def __init__(self, model_path, server_args, modules) -> None:
            self._built = modules
            super().__init__(model_path, server_args)

        def build_executor(self, server_args):
            return None  # stages are called one at a time by TinyScheduler

        def load_modules(self, server_args, loaded_modules=None):
            return dict(self._built)

        def create_pipeline_stages(self, server_args):
            self.add_standard_timestep_preparation_stage(prepare_extra_kwargs=[s["prepare_mu"]])

    return TinyPipeline


def _server_args(s, model_dir):
    """SGLang's native Qwen-Image configs (task T2I, QwenImageSamplingParams), as a server
    launched on a Qwen-Image checkpoint resolves them; the VAE's arch from its config.json (the
    timestep stage's ``prepare_mu`` reads its scale factor)."""
    server_args = s["ServerArgs"](model_path=str(model_dir), pipeline_class_name="QwenImagePipeline")
    server_args.pipeline_config = s["QwenImagePipelineConfig"]()
    vae = server_args.pipeline_config.vae_config
    vae.update_model_arch(json.loads((Path(model_dir) / "vae" / "config.json").read_text()))
    vae.post_init()
    return server_args


def _build_controller(*, batch, pipeline_config):
    """SGLang's scheduler-stepped rollout controller, minus sequence-parallel sharding (its
    default needs SGLang's process groups; one worker here)."""
    return _sglang()["FlowRolloutController"](
        sde_type=batch.rollout_sde_type, noise_level=float(batch.rollout_noise_level),
        log_prob_no_const=batch.rollout_log_prob_no_const, debug_mode=batch.rollout_debug_mode,
        sde_step_indices=batch.rollout_sde_step_indices, generator=batch.generator,
        return_dit_trajectory=batch.rollout_return_dit_trajectory,
        return_step_indices=batch.rollout_return_step_indices,
        shard_for_sp=lambda b, x: x, gather_for_sp=lambda b, x: x,
        sigmas=batch.scheduler.sigmas, latents_shape=tuple(batch.latents.shape))


class TinyScheduler:
    """Answers SGLang's scheduler-client calls in-process (see the module docstring)."""

    def __init__(self, model_dir, server_args) -> None:
        from trainer.models.qwen_image import QwenImageAdapter

        s = _sglang()
        self.s, self.server_args = s, server_args
        self.adapter = QwenImageAdapter(str(model_dir))
        self.frozen = self.adapter.load_frozen(device="cpu", dtype=torch.float32)
        self.transformer = self.adapter.load_train_model().eval()
        scheduler = s["FlowMatchEulerDiscreteScheduler"].from_pretrained(str(model_dir),
                                                                         subfolder="scheduler")
        self.pipeline = tiny_pipeline_class()(str(model_dir), server_args,
                                              {"transformer": self.transformer,
                                               "scheduler": scheduler})
        self.lock = threading.Lock()
        self.requests: list = []  # every rollout Req, for the tests to inspect
        self.weight_requests: list = []  # every weight-route request object

        class Worker(s["gpu_worker_post_training_mixin"].GPUWorkerPostTrainingMixin):
            local_rank = 0

            def update_weights_from_tensor_checker(inner, req):  # one worker: no TP gather
                checker = s["tensor_update_checker"].TensorUpdateChecker(inner.pipeline)
                return checker.verify(target_module=req.target_module,
                                      expected_named_tensors_sha256=req
                                      .expected_named_tensors_sha256)

        class Scheduler(s["scheduler_post_training_mixin"].SchedulerPostTrainingMixin):
            worker = Worker()

        Worker.pipeline, Worker.server_args = self.pipeline, server_args
        Scheduler.server_args = server_args
        self.scheduler = Scheduler()

    async def forward(self, req):
        return await asyncio.to_thread(self._forward, req)

    def _forward(self, req):
        io, sched = self.s["io_struct"], self.scheduler
        with self.lock:
            if isinstance(req, self.s["Req"]):
                return self._rollout(req)
            self.weight_requests.append(req)
            handlers = {io.UpdateWeightFromTensorReqInput: sched._handle_update_weights_from_tensor,
                        io.UpdateWeightFromTensorCheckerReqInput:
                            sched._handle_update_weights_from_tensor_checker,
                        io.UpdateWeightFromDiskReqInput: sched._handle_update_weights_from_disk,
                        io.GetWeightsChecksumReqInput: sched._handle_get_weights_checksum}
            return handlers[type(req)]([req])

    def _prepare(self, req):
        """x_T from the request's generators, then SGLang's timestep stage (Qwen-Image's order:
        latent preparation, timestep preparation, denoising)."""
        n, h, w = req.num_outputs_per_prompt, req.height, req.width
        gens = [torch.Generator("cpu").manual_seed(req.seed + k) for k in range(n)]
        shape = self.adapter.latent_shape(h, w)
        req.generator = gens
        req.latents = torch.stack([torch.randn(shape, generator=g) for g in gens])
        (stage,) = self.pipeline.stages
        return stage(req, self.server_args)

    @torch.no_grad()
    def _rollout(self, req):
        s, adapter = self.s, self.adapter
        self.requests.append(req)
        req = self._prepare(req)
        n, h, w = req.num_outputs_per_prompt, req.height, req.width
        scheduler, timesteps = req.scheduler, req.timesteps
        cond = adapter.encode_prompts(self.frozen, [req.prompt] * n)

        hooks = s["rollout_hooks"]
        # called through the denoising stage's module attribute, as SGLang's loop calls it
        # (where a plugin's hook on it takes effect)
        s["denoising"].prepare_rollout_if_enabled(
            batch=req, pipeline_config=self.server_args.pipeline_config,
            build_controller=_build_controller)
        latents = req.latents
        # SGLang's Qwen-Image cond kwargs: no mask when every text token is real (always so
        # for one prompt), txt_seq_lens, img_shapes, and the embeddings
        mask = cond["prompt_embeds_mask"]
        pos = {"encoder_hidden_states": cond["prompt_embeds"],
               "encoder_hidden_states_mask": None if bool(mask.all()) else mask,
               "txt_seq_lens": mask.sum(dim=1).tolist(),
               "img_shapes": [[(1, *(d // 2 for d in adapter.latent_grid(h, w)))]] * n}
        hooks.init_rollout_env_if_enabled(batch=req, image_kwargs={}, pos_cond_kwargs=pos,
                                          neg_cond_kwargs={}, guidance=None)
        scheduler.set_begin_index(0)
        # eager: SGLang compiles its LoRA layers' forward (a GPU-side speed-up, slow on CPU)
        with torch.compiler.set_stance("force_eager"):
            for i, t in enumerate(timesteps):
                v = adapter.velocity(self.transformer, latents, scheduler.sigmas[i], cond, h, w)
                latents = scheduler.step(v, t, latents, return_dict=False,
                                         **hooks.rollout_step_kwargs(req))[0]
        hooks.finalize_rollout_if_enabled(batch=req, latents=latents,
                                          num_inference_steps=len(timesteps),
                                          final_timestep=timesteps.new_zeros(()),
                                          pipeline_config=self.server_args.pipeline_config)
        images = adapter.decode(self.frozen, latents, h, w)  # uint8 [n, H, W, 3]
        # SGLang's decoded frames: float in [0, 1], [B, C, F=1, H, W]
        output = (images.permute(0, 3, 1, 2).float() / 255.0).unsqueeze(2)
        return s["OutputBatch"](output=output, rollout_trajectory_data=req.rollout_trajectory_data)


class SGLangServer:
    def __init__(self, url: str, scheduler: TinyScheduler) -> None:
        self.url, self.scheduler = url, scheduler


def build_app(scheduler: TinyScheduler, *, weights_api: bool = True):
    """SGLang's own post-training routers (plus a /health) with ``scheduler`` behind them;
    ``weights_api=False`` leaves the weight routes out (a server that cannot take a sync)."""
    from fastapi import FastAPI

    s = _sglang()
    # SGLang's routers call one process-wide client: one served scheduler at a time
    s["async_scheduler_client"].forward = scheduler.forward
    app = FastAPI()
    app.include_router(s["rollout_api"].router)
    if weights_api:
        app.include_router(s["weights_api"].router)
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    return app


@contextlib.contextmanager
def serve_sglang(model_dir, *, weights_api: bool = True):
    """Start SGLang's HTTP layer on a free loopback port in a thread; yields an SGLangServer."""
    import uvicorn

    s = _sglang()
    client = s["async_scheduler_client"]
    previous = client.__dict__.get("forward")  # an outer serve_sglang's scheduler, if any
    server_args = _server_args(s, model_dir)
    s["set_global_server_args"](server_args)
    scheduler = TinyScheduler(model_dir, server_args)
    strategy = torch.multiprocessing.get_sharing_strategy()
    # CPU tensors travel SGLang's payload through torch's reductions in shared-memory files
    torch.multiprocessing.set_sharing_strategy("file_system")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(scheduler, weights_api=weights_api),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("SGLang's HTTP layer did not start")
        time.sleep(0.05)
    try:
        yield SGLangServer(f"http://127.0.0.1:{port}", scheduler)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        if previous is None:
            client.__dict__.pop("forward", None)
        else:
            client.forward = previous
        restore_torch_reductions()
        torch.multiprocessing.set_sharing_strategy(strategy)


def trainer_overrides(model_dir, url: str, tmp_path, sampling: dict | None = None) -> list[str]:
    """Config overrides of a tiny Qwen-Image run against the SGLang server at ``url``."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"a red panda number {i}",
                                             "metadata": {"sample_id": f"p{i:03d}"}})
                                 for i in range(8)))
    sampling = {"height": 32, "width": 32, "num_inference_steps": 4, "eta": 0.7,
                "driver_sigmas": False, "driver_xt": False, "guidance_scale": 1.0,
                "sde_type": "sde", "sde_indices": [1, 2], "sde_pool": [1, 2, 3],
                "num_sde_steps": 2, **(sampling or {})}
    return ["model.adapter_path=trainer.models.qwen_image.QwenImageAdapter",
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
