"""CUDA backend (cupy IPC + Triton copy kernel) between real processes on one GPU.

Run on the GPU machine:  python -m pytest -q -m gpu tests/test_ipc_cuda.py
The engine host, payload spec and fault injection are shared with tests/test_ipc_shm.py.
"""
import multiprocessing as mp
import time

import pytest
import torch

import ipc
from ipc._copyplan import CopyPlan
from ipc.transport import cupy_runtime

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc, pytest.mark.skipif(
    not torch.cuda.is_available() or cupy_runtime() is None, reason="needs CUDA and cupy")]

from test_ipc_shm import (LORA, SPEC, Host, _bytes_equal, _corrupting_run_bucket,  # noqa: E402
                          _sender, _victim_host, as_engine, trainer_tensors)

CTX = mp.get_context("spawn")


def cuda_tensors(seed, names=None, dtype_of=None):
    out = {n: t.cuda() for n, t in trainer_tensors(seed, names).items()}
    if dtype_of:  # mixed sources: some already in bf16 (bf16 -> bf16), some fp32 -> fp32
        out = {n: t.to(dtype_of.get(n, t.dtype)) for n, t in out.items()}
    return out


def cpu(d):
    return {n: t.cpu() for n, t in d.items()}


@pytest.fixture(scope="module")
def host():
    h = Host("cuda")
    yield h
    h.close()


def test_cuda_round_trip_is_bit_exact_and_opens_once(host):
    s_end, rid, _ = host.receiver(seed=1)
    sender = _sender(s_end)
    src = cuda_tensors(50, dtype_of={SPEC[0][0]: torch.bfloat16})
    stats = sender.sync(1, src)
    assert stats.backend == "cuda" and stats.handle_opens == 2  # memory + "free" event
    assert stats.buckets >= 4 and stats.launches < stats.tensors + stats.buckets * 2
    want = as_engine(cpu(src))
    assert _bytes_equal(host.weights(rid), want)
    version, dirty, checksum, err = host.state(rid)
    assert (version, dirty, err) == (1, False, None)
    assert checksum == stats.checksum == ipc.weights_checksum(want, impl="torch")
    assert ipc.weights_checksum(as_engine(src), impl="triton") == stats.checksum
    t0 = time.perf_counter()
    stats2 = sender.sync(2, cuda_tensors(51))
    assert stats2.handle_opens == 0 and sender.handle_opens == 2
    assert time.perf_counter() - t0 < 5.0
    assert _bytes_equal(host.weights(rid), as_engine(cpu(cuda_tensors(51))))
    sender.close()


def test_cuda_adapter_mode_and_fused_verify(host):
    s_end, rid, _ = host.receiver(seed=2, verify="fused")
    sender = _sender(s_end)
    base = cuda_tensors(52)
    sender.sync(0, base)
    lora = cuda_tensors(53, names=LORA)
    stats = sender.sync(1, lora, mode="adapter")
    assert stats.verify == "fused" and stats.tensors == len(LORA)
    assert _bytes_equal(host.weights(rid), as_engine(cpu({**base, **lora})))
    sender.close()


def test_cuda_pre_write_rejection_leaves_weights(host):
    s_end, rid, _ = host.receiver(seed=3)
    sender = _sender(s_end)
    sender.sync(1, cuda_tensors(54))
    before, before_w = host.state(rid), host.weights(rid)
    bad = {**cuda_tensors(55), SPEC[0][0]: torch.zeros(29, 37, device="cuda")}
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(2, bad)
    assert err.value.stage == "pre-write" and "shape mismatch" in str(err.value)
    assert host.state(rid) == before and _bytes_equal(host.weights(rid), before_w)
    sender.close()


def test_cuda_checksum_mismatch_then_retry(host, monkeypatch):
    s_end, rid, _ = host.receiver(seed=4)
    sender = _sender(s_end)
    sender.sync(1, cuda_tensors(56))
    monkeypatch.setattr(CopyPlan, "run_bucket", _corrupting_run_bucket(CopyPlan.run_bucket))
    src = cuda_tensors(57)
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(2, src)
    assert err.value.stage == "post-write" and "checksum mismatch" in str(err.value)
    assert host.state(rid)[:2] == (1, True)
    monkeypatch.undo()
    stats = sender.sync(2, src)
    assert host.state(rid) == (2, False, stats.checksum, None)
    sender.close()


def test_cuda_receiver_killed_mid_sync_fails_sender_quickly():
    s_end, r_end = ipc.channel_pair()
    ctl, child = CTX.Pipe()
    proc = CTX.Process(target=_victim_host, args=(child, r_end, "cuda"), daemon=True)
    proc.start()
    r_end.close()
    child.close()
    assert ctl.recv() == "ready"
    sender = _sender(s_end, timeout_s=60.0)
    t0 = time.perf_counter()
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(1, cuda_tensors(58))
    assert err.value.stage == "post-write" and time.perf_counter() - t0 < 10.0
    proc.join(10)
