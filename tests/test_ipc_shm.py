"""Weight sync over the shared-memory backend between real processes (spawn).

One module-scoped "engine host" process owns the receivers (a fresh one per test, over a
fresh channel); the test process is the sender. Failures are injected on the sender side by
patching the copy step in this process, and on the receiver side by patching the receiver
object inside the host (test code only; nothing in ipc/ knows about tests). The two peer-death
tests spawn one extra process each.
"""
import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

import ipc
from ipc._copyplan import CopyPlan

pytestmark = pytest.mark.multiproc
CTX = mp.get_context("spawn")
BUCKET = 64 << 10  # small buckets: "big" (160 KB of bf16) is split across three of them
SPEC = [  # name, shape, engine dtype
    ("blocks.0.attn.to_q.weight", (37, 29), torch.bfloat16),
    ("blocks.0.norm.weight", (29,), torch.float32),
    ("big.weight", (80_000,), torch.bfloat16),
    ("empty.bias", (0,), torch.float32),
    ("pos_ids", (13,), torch.int64),
    ("blocks.0.attn.to_q.lora_A.weight", (4, 29), torch.float32),
    ("blocks.0.attn.to_q.lora_B.weight", (37, 4), torch.float32),
]
LORA = [n for n, _, _ in SPEC if "lora_" in n]
BASE = [n for n, _, _ in SPEC if "lora_" not in n]
MODES = {"adapter": LORA, "merge": BASE}


def make_params(seed: int, device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dt in SPEC:
        if dt.is_floating_point:
            out[name] = torch.nn.Parameter(torch.randn(shape, generator=g).to(device, dt))
        else:
            out[name] = torch.randint(0, 1000, shape, generator=g, dtype=dt).to(device)
    return out


def trainer_tensors(seed: int, names=None) -> dict:
    """What a trainer sends: fp32 masters for float weights (cast to the engine's dtype on
    the wire), exact dtype otherwise."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dt in SPEC:
        t = torch.randn(shape, generator=g) if dt.is_floating_point else \
            torch.randint(0, 1000, shape, generator=g, dtype=dt)
        if names is None or name in names:
            out[name] = t
    return out


def as_engine(tensors: dict) -> dict:
    dtypes = {n: dt for n, _, dt in SPEC}
    return {n: t.to(dtypes[n]) for n, t in tensors.items()}


# ------------------------------------------------------------------------ engine host
def _engine_host(ctl) -> None:
    import ipc as _ipc
    receivers = {}
    while True:
        cmd = ctl.recv()
        op, args = cmd[0], cmd[1:]
        if op == "quit":
            return
        rid = args[0]
        if op == "new":
            _, conn, seed, kwargs = args
            params = make_params(seed, kwargs.pop("device", "cpu"))
            r = _ipc.WeightReceiver(conn, params, **kwargs).start()
            receivers[rid] = (r, params)
            ctl.send(r.checksum())
            continue
        r, params = receivers[rid]
        if op == "state":
            try:
                r.assert_servable()
                err = None
            except _ipc.WeightSyncError as exc:
                err = str(exc)
            ctl.send((r.version, r.dirty, r.checksum(), err))
        elif op == "weights":
            ctl.send({n: t.detach().cpu().numpy() if t.dtype != torch.bfloat16 else
                      t.detach().view(torch.int16).cpu().numpy() for n, t in params.items()})
        elif op == "fault":
            _inject(r, params, *args[1:])
            ctl.send("ok")
        elif op == "close":
            r.close()
            ctl.send("ok")


def _inject(r, params, kind, arg) -> None:
    finish = r._finish
    if kind == "slow_finish":
        def slow(*a, **k):
            time.sleep(arg)
            return finish(*a, **k)
        r._finish = slow
    elif kind == "exit_on_end":
        r._finish = lambda *a, **k: os._exit(17)
    elif kind == "rebind":
        params[arg].data = params[arg].data.clone()


class Host:
    def __init__(self, device: str = "cpu"):
        self.device = device
        self.ctl, child = CTX.Pipe()
        self.proc = CTX.Process(target=_engine_host, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.n = 0

    def receiver(self, seed=0, **kwargs):
        """A fresh receiver in the host; returns (sender end, rid, initial checksum)."""
        self.n += 1
        s_end, r_end = ipc.channel_pair()
        kwargs.setdefault("modes", MODES)
        kwargs.setdefault("device", self.device)
        self.ctl.send(("new", self.n, r_end, seed, kwargs))
        checksum = self.ctl.recv()
        r_end.close()
        return s_end, self.n, checksum

    def call(self, op, rid, *args):
        self.ctl.send((op, rid, *args))
        return self.ctl.recv()

    def state(self, rid):
        return self.call("state", rid)

    def weights(self, rid):
        raw = self.call("weights", rid)
        return {n: torch.from_numpy(a).view(torch.bfloat16) if dt == torch.bfloat16
                else torch.from_numpy(a) for (n, _, dt), a in zip(SPEC, raw.values())}

    def close(self):
        try:
            self.ctl.send(("quit",))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture(scope="module")
def host():
    h = Host()
    yield h
    h.close()


def _bytes_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].contiguous().reshape(-1)
                    .view(torch.uint8)) for n in a)


def _sender(s_end, **kw):
    kw.setdefault("bucket_bytes", BUCKET)
    kw.setdefault("timeout_s", 30.0)
    return ipc.WeightSender(s_end, **kw)


# ------------------------------------------------------------------------ happy path
def test_round_trip_is_bit_exact_and_opens_once(host):
    s_end, rid, _ = host.receiver(seed=1)
    sender = _sender(s_end)
    src = trainer_tensors(10)
    stats = sender.sync(1, src)
    assert stats.tensors == len(SPEC) and stats.buckets >= 4 and stats.handle_opens == 1
    assert stats.bytes == sum(t.numel() * t.element_size() for t in as_engine(src).values())
    assert _bytes_equal(host.weights(rid), as_engine(src))
    version, dirty, checksum, err = host.state(rid)
    assert (version, dirty, err) == (1, False, None)
    assert checksum == stats.checksum == ipc.weights_checksum(as_engine(src))
    # the next step: nothing reopened, new bytes land, the generator form works too, and so
    # do a non-contiguous and a misaligned source (copied before the write)
    src2 = trainer_tensors(11)
    src2[SPEC[0][0]] = src2[SPEC[0][0]].t().contiguous().t()
    src2[SPEC[1][0]] = torch.cat([torch.zeros(1), src2[SPEC[1][0]]])[1:]
    assert not src2[SPEC[0][0]].is_contiguous() and src2[SPEC[1][0]].data_ptr() % 16
    stats2 = sender.sync(2, iter(list(src2.items())))
    assert stats2.handle_opens == 0 and sender.handle_opens == 1
    assert _bytes_equal(host.weights(rid), as_engine(src2))
    assert host.state(rid)[:2] == (2, False)
    # a retry of the committed version is accepted (idempotent)
    assert sender.sync(2, src2).checksum == stats2.checksum
    sender.close()


def test_fused_verify_round_trip(host):
    s_end, rid, _ = host.receiver(seed=2, verify="fused")
    sender = _sender(s_end)
    src = trainer_tensors(12)
    stats = sender.sync(5, src)
    assert stats.verify == "fused"
    assert _bytes_equal(host.weights(rid), as_engine(src))
    assert host.state(rid)[2] == stats.checksum
    sender.close()


def test_adapter_and_merge_modes(host):
    s_end, rid, _ = host.receiver(seed=3)
    sender = _sender(s_end)
    base = trainer_tensors(13)
    sender.sync(0, base)                                   # base once, in full mode
    lora = trainer_tensors(14, names=LORA)
    stats = sender.sync(1, lora, mode="adapter")
    assert stats.tensors == len(LORA)
    want = as_engine({**base, **lora})
    assert _bytes_equal(host.weights(rid), want)
    assert host.state(rid)[2] == ipc.weights_checksum(want)
    merged = trainer_tensors(15, names=BASE)
    sender.sync(2, merged, mode="merge")
    assert _bytes_equal(host.weights(rid), as_engine({**merged, **lora}))
    with pytest.raises(ipc.WeightSyncError) as err:    # base tensors are not adapter payload
        sender.sync(3, {**lora, BASE[0]: merged[BASE[0]]}, mode="adapter")
    assert err.value.stage == "pre-write" and "outside mode 'adapter'" in str(err.value)
    sender.close()


def test_lazy_tensors_are_produced_bucket_by_bucket(host, monkeypatch):
    s_end, rid, _ = host.receiver(seed=4)
    sender = _sender(s_end)
    src = trainer_tensors(16)
    events = []

    def lazy(name, t):
        return ipc.LazyTensor(tuple(t.shape), t.dtype,
                              lambda: events.append(("produce", name)) or t.clone())
    real = CopyPlan.run_bucket
    monkeypatch.setattr(CopyPlan, "run_bucket",
                        lambda self, b, *a, **k: events.append(("bucket", b)) or
                        real(self, b, *a, **k))
    sender.sync(1, [(n, lazy(n, t)) for n, t in src.items()])
    assert _bytes_equal(host.weights(rid), as_engine(src))
    plan = sender._manifest.plan
    for b, bucket in enumerate(plan.buckets):  # each tensor produced right before its bucket
        at = events.index(("bucket", b))
        before = events[events.index(("bucket", b - 1)) + 1 if b else 0:at]
        firsts = [src_name for src_name in src
                  if min(bb for bb, bk in enumerate(plan.buckets)
                         for k, _, _ in bk if list(src)[k] == src_name) == b]
        assert before == [("produce", n) for n in firsts]
    sender.close()


# ------------------------------------------------------------------------ pre-write failures
def _pre_write_cases():
    good = trainer_tensors(20)
    name0, name1 = SPEC[0][0], SPEC[1][0]
    return {
        "unknown": ({**good, "ghost.weight": torch.zeros(3)}, ["unknown tensors", "ghost"]),
        "missing": ({n: t for n, t in good.items() if n != name1}, ["missing", name1]),
        "shape": ({**good, name0: torch.zeros(29, 37)}, ["shape mismatch", name0]),
        "dtype": ({**good, "pos_ids": torch.zeros(13)}, ["cannot cast float32", "pos_ids"]),
        "all_at_once": ({**{n: t for n, t in good.items() if n != name1},
                         name0: torch.zeros(29, 37), "ghost.weight": torch.zeros(3)},
                        ["unknown tensors", "missing", "shape mismatch"]),
    }


@pytest.mark.parametrize("case", ["unknown", "missing", "shape", "dtype", "all_at_once",
                                  "manifest_hash", "stale_version", "unknown_mode"])
def test_pre_write_failure_leaves_weights_and_version_untouched(host, monkeypatch, case):
    s_end, rid, _ = host.receiver(seed=5)
    sender = _sender(s_end)
    sender.sync(3, trainer_tensors(21))
    before_state, before_w = host.state(rid), host.weights(rid)
    version, mode, needles = 4, "full", None
    if case in _pre_write_cases():
        payload, needles = _pre_write_cases()[case]
    else:
        payload = trainer_tensors(22)
    if case == "manifest_hash":  # the begin message's hash disagrees with its entries
        monkeypatch.setitem(sender._manifest.header, "hash", "f" * 64)
        needles = ["manifest hash"]
    elif case == "stale_version":
        version, needles = 2, ["older than the committed version 3"]
    elif case == "unknown_mode":
        mode, needles = "delta", ["unknown sync mode 'delta'"]
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(version, payload, mode=mode)
    assert err.value.stage == "pre-write" and err.value.version == version
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert host.state(rid) == before_state                 # version, clean, same checksum
    assert _bytes_equal(host.weights(rid), before_w)       # not one byte written
    monkeypatch.undo()
    good = trainer_tensors(23)
    sender.sync(4, good)                                   # and the next sync just works
    assert _bytes_equal(host.weights(rid), as_engine(good))
    sender.close()


def test_rebound_tensor_is_rejected_before_writing(host):
    s_end, rid, _ = host.receiver(seed=6)
    sender = _sender(s_end)
    sender.sync(1, trainer_tensors(24))
    host.call("fault", rid, "rebind", "blocks.0.norm.weight")
    before = host.weights(rid)
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(2, trainer_tensors(25))
    assert err.value.stage == "pre-write" and "rebound" in str(err.value)
    assert _bytes_equal(host.weights(rid), before) and host.state(rid)[:2] == (1, False)
    sender.close()


# ------------------------------------------------------------------------ post-write failures
def _corrupting_run_bucket(real):
    def run(self, b, memory, *a, **k):
        real(self, b, memory, *a, **k)
        if b == 0:  # flip one byte of the first tensor after the sender checksummed it
            memory[self.dst_offsets[0]] ^= 0x40
    return run


def test_checksum_mismatch_marks_dirty_and_same_version_retry_recovers(host, monkeypatch):
    s_end, rid, _ = host.receiver(seed=7)
    sender = _sender(s_end)
    sender.sync(1, trainer_tensors(30))
    monkeypatch.setattr(CopyPlan, "run_bucket", _corrupting_run_bucket(CopyPlan.run_bucket))
    src = trainer_tensors(31)
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(2, src)
    assert err.value.stage == "post-write"
    assert "checksum mismatch in 1 tensors: " + SPEC[0][0] in str(err.value)
    version, dirty, _, servable = host.state(rid)
    assert version == 1 and dirty and "dirty" in servable and "version 2" in servable
    monkeypatch.undo()
    with pytest.raises(ipc.WeightSyncError) as err:        # only a retry of 2 is accepted
        sender.sync(3, src)
    assert err.value.stage == "pre-write" and "only a retry of version 2" in str(err.value)
    with pytest.raises(ipc.WeightSyncError) as err:        # ... covering every dirty tensor
        sender.sync(2, trainer_tensors(31, names=LORA), mode="adapter")
    assert "leaves 5 dirty tensors unwritten" in str(err.value)
    stats = sender.sync(2, src)
    assert host.state(rid) == (2, False, stats.checksum, None)
    assert _bytes_equal(host.weights(rid), as_engine(src))
    sender.close()


def test_receiver_timeout_while_sender_stalls_marks_dirty(host, monkeypatch):
    s_end, rid, _ = host.receiver(seed=8, timeout_s=1.0)
    sender = _sender(s_end)
    sender.sync(1, trainer_tensors(32))
    real = CopyPlan.run_bucket
    monkeypatch.setattr(CopyPlan, "run_bucket",
                        lambda self, b, *a, **k: (time.sleep(1.5) if b == 1 else None)
                        or real(self, b, *a, **k))
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(2, trainer_tensors(33))
    assert err.value.stage == "post-write" and "abandoned" in str(err.value)
    version, dirty, _, servable = host.state(rid)
    assert version == 1 and dirty and "timed out" in servable
    monkeypatch.undo()
    sender.sync(2, trainer_tensors(33))
    assert host.state(rid)[:2] == (2, False)
    sender.close()


def test_sender_timeout_is_bounded_when_receiver_stalls(host):
    s_end, rid, _ = host.receiver(seed=9)
    sender = _sender(s_end, timeout_s=1.0)
    sender.sync(1, trainer_tensors(34))
    host.call("fault", rid, "slow_finish", 3.0)
    t0 = time.perf_counter()
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(2, trainer_tensors(35))
    assert err.value.stage == "post-write" and "timed out" in str(err.value)
    assert time.perf_counter() - t0 < 2.5
    sender.close()


def test_lazy_tensor_failure_aborts_and_marks_dirty_at_once(host):
    s_end, rid, _ = host.receiver(seed=10)
    sender = _sender(s_end)
    sender.sync(1, trainer_tensors(36))
    src = trainer_tensors(37)
    last = SPEC[-1][0]
    payload = {**src, last: ipc.LazyTensor(tuple(src[last].shape), torch.float32,
                                           lambda: torch.zeros(2, 2))}
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(2, payload)
    assert err.value.stage == "post-write" and "declared" in str(err.value)
    version, dirty, _, servable = host.state(rid)  # no wait for the receiver's timeout
    assert version == 1 and dirty and "aborted" in servable
    sender.close()


def _victim_host(ctl, r_end, device="cpu"):
    params = make_params(0, device)
    r = ipc.WeightReceiver(r_end, params, timeout_s=60).start()
    _inject(r, params, "exit_on_end", None)
    ctl.send("ready")
    time.sleep(120)


def test_receiver_killed_mid_sync_fails_sender_quickly():
    s_end, r_end = ipc.channel_pair()
    ctl, child = CTX.Pipe()
    proc = CTX.Process(target=_victim_host, args=(child, r_end), daemon=True)
    proc.start()
    r_end.close()
    child.close()
    assert ctl.recv() == "ready"
    sender = _sender(s_end, timeout_s=60.0)
    t0 = time.perf_counter()
    with pytest.raises(ipc.WeightSyncError) as err:
        sender.sync(1, trainer_tensors(40))
    elapsed = time.perf_counter() - t0
    proc.join(10)
    assert err.value.stage == "post-write" and "went away" in str(err.value)
    assert elapsed < 10.0 and proc.exitcode == 17  # well under the 60 s timeout


def _dying_sender(s_end, seed):
    real = CopyPlan.run_bucket

    def run(self, b, *a, **k):
        real(self, b, *a, **k)
        if b == 1:
            os._exit(23)  # killed after writes began
    CopyPlan.run_bucket = run
    ipc.WeightSender(s_end, bucket_bytes=BUCKET).sync(7, trainer_tensors(seed))


def test_sender_killed_mid_sync_leaves_receiver_refusing_to_serve():
    s_end, r_end = ipc.channel_pair()
    params = make_params(1)
    recv = ipc.WeightReceiver(r_end, params, timeout_s=60).start()
    before = recv.checksum()
    proc = CTX.Process(target=_dying_sender, args=(s_end, 41), daemon=True)
    proc.start()
    s_end.close()
    proc.join(60)
    assert proc.exitcode == 23
    # The receiver is dirty from the moment writes begin ("sync in progress"); wait until it
    # has also noticed the sender's death, which is what this test is about.
    deadline = time.perf_counter() + 10.0
    reason = ""
    while time.perf_counter() < deadline:
        try:
            recv.assert_servable()
            reason = ""
        except ipc.WeightSyncError as exc:
            reason = str(exc)
            if "went away" in reason:
                break
        time.sleep(0.05)
    assert recv.dirty and recv.version == 0
    with pytest.raises(ipc.WeightSyncError) as err:
        recv.assert_servable()
    assert "went away" in str(err.value) and "version 7" in str(err.value), reason
    assert recv.checksum() != before  # writes had begun: refusing to serve was right
    recv.close()
    r_end.close()
