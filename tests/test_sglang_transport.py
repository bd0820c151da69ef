"""Our ipc/ transport into SGLang's native Qwen-Image DiT (sglang==0.5.23), on CPU, over shared
memory.

A spawned "SGLang worker" process does what SGLang's worker does at start with the extension
loaded: the extension registers its hooks in SGLang's ``HookRegistry``, SGLang applies them,
and SGLang's ``pipelines_core.build_pipeline`` (hooked) builds the pipeline, after which our
hook installs the receiver on its native ``QwenImageTransformer2DModel`` (packed
``to_added_qkv``, SGLang's ``MergedColumnParallelLinear``, in SGLang's gloo process group of one).
The trainer side (this process) reads the published descriptor through the extension's route
on a FastAPI app, connects ``SGLangTransport`` and syncs the parameters of diffusers'
``QwenImageTransformer2DModel`` (our names) built from the same tiny config.

Stand-ins (what needs what we lack, nothing else):
- SGLang's ``build_pipeline`` body loads a full checkpoint (text encoder, VAE, tokenizer) from
  disk; here the function the hook wraps builds only the native DiT from a tiny config (SGLang's
  own class and config dataclasses), and returns it in a one-module pipeline holder.
- SGLang's ``create_app`` builds its whole HTTP app and needs its scheduler client; the hook is
  applied to a function returning a bare FastAPI app, and the route is read with a TestClient.
"""
import multiprocessing as mp
import os
import socket
import traceback
import warnings

import pytest
import torch

import ipc
from ipc._copyplan import CopyPlan

pytestmark = pytest.mark.multiproc
CTX = mp.get_context("spawn")
TINY = dict(num_layers=2, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
            in_channels=16, axes_dims_rope=(2, 2, 4))
BUCKET = 64 << 10


# ---- the SGLang worker process -----------------------------------------------------------------
class _Pipeline:
    """Stand-in for SGLang's pipeline object: the one module the receiver needs."""

    def __init__(self, modules):
        self.modules = modules

    def get_module(self, name):
        return self.modules[name]


def _native_dit_pipeline(server_args):
    """Stand-in for build_pipeline's checkpoint loading: SGLang's native DiT, tiny config."""
    from sglang.multimodal_gen.configs.models.dits.qwenimage import (QwenImageArchConfig,
                                                                     QwenImageDitConfig)
    from sglang.multimodal_gen.runtime.models.dits.qwen_image import QwenImageTransformer2DModel

    torch.manual_seed(0)
    config = QwenImageDitConfig(arch_config=QwenImageArchConfig(**TINY))
    return _Pipeline({"transformer": QwenImageTransformer2DModel(config=config, hf_config={})})


def _arrays(module) -> dict:
    """Parameters as numpy copies (a pipe pickles them plainly, whatever their storage)."""
    return {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


def _worker_main(ctl, port: int, receiver_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["FLOWGRPO_RECEIVER_DIR"] = receiver_dir
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.multimodal_gen.configs.pipeline_configs.qwen_image import (
                QwenImagePipelineConfig)
            from sglang.multimodal_gen.runtime import pipelines_core
            from sglang.multimodal_gen.runtime.distributed import parallel_state
            from sglang.multimodal_gen.runtime.platforms.plugins import HookRegistry
            from sglang.multimodal_gen.runtime.server_args import (ServerArgs,
                                                                    set_global_server_args)

            from trainer.engine.sglang import extension

            args = ServerArgs(model_path=receiver_dir, pipeline_class_name="QwenImagePipeline",
                              port=port)
            args.pipeline_config = QwenImagePipelineConfig(dit_precision="fp32")
            set_global_server_args(args)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                free = s.getsockname()[1]
            parallel_state.maybe_init_distributed_environment_and_model_parallel(
                1, 1, distributed_init_method=f"tcp://127.0.0.1:{free}")
            pipelines_core.build_pipeline = _native_dit_pipeline
            extension.register()
            HookRegistry.apply_hooks()
            pipeline = pipelines_core.build_pipeline(args)
            dit = pipeline.get_module("transformer")
            installed = extension.installed_receiver()
        ctl.send(("ready", _arrays(dit)))
    except BaseException:
        ctl.send(("error", traceback.format_exc()))
        return
    r = installed.receiver
    while True:
        op = ctl.recv()
        if op == "quit":
            installed.close()
            return
        if op == "state":
            try:
                r.assert_servable()
                err = None
            except ipc.WeightSyncError as exc:
                err = str(exc)
            ctl.send((r.version, r.dirty, err))
        elif op == "weights":
            ctl.send(_arrays(dit))
        elif op == "checksum":
            ctl.send(r.checksum())
        elif op == "release":  # SGLang's release of every module, through the hooked move
            from sglang.multimodal_gen.runtime.managers.memory_managers import (
                memory_occupation_controller as moc)
            controller = moc.MemoryOccupationController.__new__(moc.MemoryOccupationController)
            controller.pipeline = pipeline
            ptrs = [p.data_ptr() for p in dit.parameters()]
            result = moc.MemoryOccupationController._move_modules(controller, ["transformer"],
                                                                   "cpu")
            ctl.send((result, ptrs == [p.data_ptr() for p in dit.parameters()]))
        elif op == "denoise":  # the extension's hook on SGLang's DenoisingStage.forward
            from sglang.multimodal_gen.runtime.pipelines_core.stages import denoising
            try:
                denoising.DenoisingStage.forward(object(), None, None)
                ctl.send(None)
            except ipc.WeightSyncError as exc:
                ctl.send(str(exc))
            except Exception as exc:  # past our check: SGLang's own stage ran
                ctl.send(f"sglang:{type(exc).__name__}")


def _tensors(arrays: dict) -> dict:
    return {n: torch.from_numpy(a) for n, a in arrays.items()}


class Worker:
    def __init__(self, tmp_dir: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tmp_dir
        self.ctl, child = CTX.Pipe()
        self.proc = CTX.Process(target=_worker_main, args=(child, self.port, tmp_dir),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.ctl.poll(600):
            raise TimeoutError("the SGLang worker did not start within 600 s")
        tag, payload = self.ctl.recv()
        if tag != "ready":
            raise RuntimeError(payload)
        self.initial = _tensors(payload)

    def call(self, op):
        self.ctl.send(op)
        if not self.ctl.poll(120):
            raise TimeoutError(f"worker did not answer {op!r}")
        reply = self.ctl.recv()
        return _tensors(reply) if op == "weights" else reply

    def close(self):
        try:
            self.ctl.send("quit")
        except OSError:
            pass
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    pytest.importorskip("sglang.multimodal_gen", reason="install tests/requirements-sglang.txt, "
                        "then sglang==0.5.23 with --no-deps (README's test command)")
    w = Worker(str(tmp_path_factory.mktemp("receivers")))
    yield w
    w.close()


# ---- the trainer side ---------------------------------------------------------------------------
def _diffusers_params(seed: int) -> dict:
    """Our names: diffusers' Qwen-Image transformer from the same tiny config, fp32."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=1, in_channels=TINY["in_channels"], out_channels=TINY["in_channels"],
        num_layers=TINY["num_layers"], attention_head_dim=TINY["attention_head_dim"],
        num_attention_heads=TINY["num_attention_heads"],
        joint_attention_dim=TINY["joint_attention_dim"], axes_dims_rope=TINY["axes_dims_rope"])
    return {n: p.detach() for n, p in model.named_parameters()}


def _descriptor(worker):
    """The worker's descriptor, read through the extension's route on an app (see docstring)."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from trainer.engine.sglang import extension, receiver
    from trainer.engine.sglang.transport import pick_receiver

    os.environ["FLOWGRPO_RECEIVER_DIR"] = worker.dir
    try:
        app = extension.add_receiver_route(lambda server_args: FastAPI(),
                                           SimpleNamespace(port=worker.port))
        body = TestClient(app).get(receiver.ROUTE).json()
    finally:
        del os.environ["FLOWGRPO_RECEIVER_DIR"]
    return pick_receiver(body["receivers"], torch.device("cpu"))


@pytest.fixture(scope="module")
def transport(worker):
    from trainer.engine.sglang.transport import SGLangTransport

    t = SGLangTransport(_descriptor(worker), bucket_bytes=BUCKET, timeout_s=30.0)
    yield t
    t.close()


def _served(params: dict, packing) -> dict:
    """What the server must hold after a sync of ``params``: packed sections concatenated."""
    return {n: t.full_tensor() if hasattr(t, "full_tensor") else t
            for n, t in packing.payload(params.items())}


def _bytes_equal(a: dict, b: dict) -> list:
    """Names whose bytes differ (or that one side lacks)."""
    bad = sorted(set(a) ^ set(b))
    bad += [n for n in set(a) & set(b) if a[n].dtype != b[n].dtype or not torch.equal(
        a[n].contiguous().reshape(-1).view(torch.uint8), b[n].contiguous().reshape(-1)
        .view(torch.uint8))]
    return bad


def test_descriptor_carries_the_native_packing_rules(worker):
    desc = _descriptor(worker)
    assert desc["backend"] == "shm" and desc["device"] == "cpu"
    packed = [r for r in desc["packing"]
              if r[1].endswith("to_added_qkv.\\2") and r[2] is not None]  # not a rename
    assert sorted(r[2] for r in packed) == [0, 1, 2] and {r[3] for r in packed} == {3}
    assert "transformer_blocks.0.attn.to_added_qkv.weight" in desc["names"]
    assert not any(".add_q_proj." in n for n in desc["names"])


def test_full_sync_lands_bit_exact_in_the_native_packed_parameters(worker, transport):
    params = _diffusers_params(seed=1)
    expected = _served(params, transport.packing)
    # the payload in our names covers the native DiT exactly once packed
    assert set(expected) == set(worker.initial)
    assert _bytes_equal(expected, worker.initial)  # a sync has something to change
    stats = transport.sync(1, params.items())
    assert stats.version == 1 and stats.tensors == len(expected) and stats.buckets >= 2
    assert _bytes_equal(worker.call("weights"), expected) == []
    qkv = worker.call("weights")["transformer_blocks.1.attn.to_added_qkv.weight"]
    inner = TINY["attention_head_dim"] * TINY["num_attention_heads"]
    assert torch.equal(qkv[inner:2 * inner], params["transformer_blocks.1.attn.add_k_proj.weight"])
    assert worker.call("checksum") == stats.checksum == ipc.weights_checksum(expected)
    assert worker.call("state") == (1, False, None)
    assert worker.call("denoise").startswith("sglang:")  # clean weights: SGLang's stage runs


def test_manifest_mismatch_is_refused_before_any_byte_moves(worker, transport, monkeypatch):
    transport.sync(2, _diffusers_params(seed=2).items())
    before = worker.call("weights")
    writes = []
    monkeypatch.setattr(CopyPlan, "run_bucket", lambda *a, **k: writes.append(1))
    bad = _diffusers_params(seed=3)
    bad["proj_out.weight"] = bad["proj_out.weight"][:, :-1]              # shape
    del bad["norm_out.linear.bias"]                                      # missing
    bad["transformer_blocks.0.attn.extra.weight"] = torch.zeros(3)       # unknown
    with pytest.raises(ipc.WeightSyncError) as err:
        transport.sync(3, bad.items())
    msg = str(err.value)
    assert err.value.stage == "pre-write" and writes == []
    for part in ("shape mismatch (1): proj_out.weight", "missing tensors required by mode "
                 "'full' (1): norm_out.linear.bias", "unknown tensors (the engine has no such "
                 "weight) (1): transformer_blocks.0.attn.extra.weight"):
        assert part in msg
    assert worker.call("state") == (2, False, None)
    assert _bytes_equal(worker.call("weights"), before) == []
    # a packed parameter with a section missing never reaches the wire either
    partial = _diffusers_params(seed=3)
    del partial["transformer_blocks.0.attn.add_v_proj.bias"]
    with pytest.raises(ipc.WeightSyncError) as err:
        transport.sync(3, partial.items())
    assert err.value.stage == "pre-write" and writes == []
    assert "transformer_blocks.0.attn.to_added_qkv.bias: sections [0, 1] of 3" in str(err.value)


def _corrupting_run_bucket(real):
    def run(self, b, memory, *a, **k):
        real(self, b, memory, *a, **k)
        if b == 1:  # one flipped byte of the bucket's first tensor, after the copy's checksum
            memory[self.dst_offsets[self.buckets[1][0][0]]] ^= 0x40
    return run


def test_corrupted_bucket_is_caught_marks_dirty_and_a_retry_recovers(worker, transport,
                                                                      monkeypatch):
    transport.sync(4, _diffusers_params(seed=4).items())
    params = _diffusers_params(seed=5)
    monkeypatch.setattr(CopyPlan, "run_bucket", _corrupting_run_bucket(CopyPlan.run_bucket))
    with pytest.raises(ipc.WeightSyncError) as err:
        transport.sync(5, params.items())
    assert err.value.stage == "post-write" and "checksum mismatch in 1 tensors" in str(err.value)
    version, dirty, servable = worker.call("state")
    assert version == 4 and dirty and "version 5" in servable
    assert "dirty" in worker.call("denoise")  # SGLang's denoising stage refuses to run
    monkeypatch.undo()
    with pytest.raises(ipc.WeightSyncError) as err:
        transport.sync(6, params.items())
    assert err.value.stage == "pre-write" and "only a retry of version 5" in str(err.value)
    stats = transport.sync(5, params.items())
    assert worker.call("state") == (5, False, None)
    expected = _served(params, transport.packing)
    assert _bytes_equal(worker.call("weights"), expected) == []
    assert worker.call("checksum") == stats.checksum


def test_sglang_memory_release_leaves_the_served_dit_in_transport_memory(worker, transport):
    assert worker.call("release") == (None, True)
    version = worker.call("state")[0]
    params = _diffusers_params(seed=7)
    transport.sync(version + 1, params.items())  # still writable where SGLang computes
    assert _bytes_equal(worker.call("weights"), _served(params, transport.packing)) == []


def test_a_restarted_trainer_reconnects_and_numbers_its_syncs_above_the_server(worker,
                                                                                transport):
    """The server outlives trainer runs and its receiver refuses versions below its committed
    one: the descriptor publishes that version, and a new trainer's version 0 lands above it."""
    from trainer.engine.sglang.transport import SGLangTransport

    version = worker.call("state")[0]
    assert version > 0
    with pytest.raises(ipc.WeightSyncError) as err:  # the receiver itself keeps its floor
        transport.sync(version - 1, _diffusers_params(seed=6).items())
    assert err.value.stage == "pre-write" and "older than the committed" in str(err.value)
    again = SGLangTransport(_descriptor(worker), bucket_bytes=BUCKET, timeout_s=30.0)
    try:
        assert again.version_base == version + 1
        params = _diffusers_params(seed=6)
        stats = again.sync(0, params.items())  # a new run's first sync
        assert stats.version == version + 1
        assert worker.call("state") == (version + 1, False, None)
        assert _bytes_equal(worker.call("weights"), _served(params, again.packing)) == []
    finally:
        again.close()


def _serve_app(app):
    """uvicorn on loopback in a thread; returns (url, server)."""
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise TimeoutError("uvicorn did not start within 30 s")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def test_the_trainer_connects_through_the_route_over_http(worker, monkeypatch):
    from types import SimpleNamespace

    from fastapi import FastAPI

    from trainer.engine.sglang import extension
    from trainer.engine.sglang.transport import SGLangTransport, TransportError

    monkeypatch.setenv("FLOWGRPO_RECEIVER_DIR", worker.dir)
    stock_url, stock = _serve_app(FastAPI())
    app = extension.add_receiver_route(lambda server_args: FastAPI(),
                                       SimpleNamespace(port=worker.port))
    url, server = _serve_app(app)
    try:
        with pytest.raises(TransportError, match="SGLANG_PLUGINS=flowgrpo"):
            SGLangTransport.connect(stock_url, "cpu")
        version = worker.call("state")[0]
        transport = SGLangTransport.connect(url, "cpu", bucket_bytes=BUCKET)
        try:
            params = _diffusers_params(seed=8)
            transport.sync(0, params.items())  # numbered above the server's committed version
        finally:
            transport.close()
        assert worker.call("state") == (version + 1, False, None)
        assert _bytes_equal(worker.call("weights"), _served(params, transport.packing)) == []
    finally:
        server.should_exit = stock.should_exit = True
