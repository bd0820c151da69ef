"""Clients of the Flow-GRPO reference's reward servers (GenEval, DeQA, UnifiedReward) against a
loopback server that speaks the reference's protocol as its reward-server apps do (pickled
request of JPEG bytes, pickled reply, the traceback as text with a 500), plus replies that
must be refused: a pickle that would run code, a numpy scalar, an oversized reply, a server
that trickles its reply one byte at a time."""
from __future__ import annotations

import io
import os
import pickle
import socket
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.config import ConfigError, load_config
from trainer.preflight.imports import check_imports
from trainer.rewards import build_reward_manager_from_config, clear_reward_manager_cache
from trainer.rewards.flowgrpo_server import (DeQAServerScorer, FlowGRPOServerError,
                                             GenEvalServerScorer, UnifiedRewardServerScorer,
                                             loads_plain)
from trainer.rewards.remote import RemoteRewardError, RemoteScorer

B = 5


def images():
    # flat colours: JPEG keeps a flat image's mean to within a unit
    levels = torch.tensor([0, 60, 120, 180, 240], dtype=torch.uint8)
    return levels.view(B, 1, 1, 1).expand(B, 16, 24, 3).contiguous()


class ReferenceServer(ThreadingHTTPServer):
    """The reference's server side: ``pickle.loads`` the request, open each image as JPEG,
    score, ``pickle.dumps`` the reply; a failure replies 500 with the traceback. ``reply``
    replaces the pickled reply (bytes) to test what the client refuses."""

    daemon_threads = True

    def __init__(self, kind, reply=None):
        super().__init__(("127.0.0.1", 0), _ReferenceHandler)
        self.kind, self.reply, self.requests = kind, reply, []
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self):
        self.shutdown()
        self.server_close()


class _ReferenceHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        data = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            request = pickle.loads(data)  # the reference server's own decoding
            self.server.requests.append(request)
            pics = [Image.open(io.BytesIO(d), formats=["jpeg"]) for d in request["images"]]
            means = [float(np.asarray(p).mean()) / 255 for p in pics]
            if self.server.kind == "geneval":
                metas = request["meta_datas"]
                assert request["only_strict"] is True
                scores = [m + len(meta["include"]) for m, meta in zip(means, metas)]
                strict = [1.0 if meta["tag"] == "single_object" else 0.0
                          for meta in metas if meta["prompt"]]
                reply = {"scores": scores, "rewards": [0.0] * len(pics),
                         "strict_rewards": strict, "group_rewards": {},
                         "group_strict_rewards": {}}
            elif self.server.kind == "unifiedreward":
                reply = {"outputs": [m + len(p) for m, p in zip(means, request["prompts"])]}
            else:
                reply = {"outputs": means}
            body = self.server.reply if self.server.reply is not None else pickle.dumps(reply)
            self._send(200, body)
        except Exception:
            self._send(500, traceback.format_exc().encode())


@pytest.fixture
def serve():
    servers = []

    def start(kind, reply=None):
        servers.append(ReferenceServer(kind, reply))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
    clear_reward_manager_cache()


def test_deqa_scores_through_the_reference_protocol_in_batches(serve):
    server = serve("deqa")
    scorer = DeQAServerScorer(endpoint=server.url, batch_size=2)
    out = scorer.score(images(), [f"p{i}" for i in range(B)], [{}] * B)
    expected = torch.tensor([0, 60, 120, 180, 240]) / 255
    torch.testing.assert_close(out["deqa"], expected.double(), atol=2 / 255, rtol=0)
    assert [len(r["images"]) for r in server.requests] == [2, 2, 1]
    assert set(server.requests[0]) == {"images"}


def test_unifiedreward_sends_the_prompts(serve):
    server = serve("unifiedreward")
    prompts = ["a", "bb", "ccc", "dddd", "eeeee"]
    out = UnifiedRewardServerScorer(endpoint=server.url).score(images(), prompts, [{}] * B)
    assert server.requests[0]["prompts"] == prompts
    assert torch.round(out["unifiedreward"]).tolist() == [1.0, 2.0, 3.0, 5.0, 6.0]


def test_geneval_sends_metadata_with_its_prompt_and_skips_samples_without_it(serve):
    server = serve("geneval")
    meta = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}]},
            {},  # not a GenEval prompt: not sent, NaN
            {"tag": "two_object", "include": [{"class": "cat", "count": 1},
                                              {"class": "dog", "count": 1}]},
            {"tag": "counting", "include": [{"class": "cup", "count": 3}], "prompt": "own"},
            {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}]
    prompts = [f"prompt {i}" for i in range(B)]
    out = GenEvalServerScorer(endpoint=server.url).score(images(), prompts, meta)["geneval"]
    sent = server.requests[0]["meta_datas"]
    assert [m["prompt"] for m in sent] == ["prompt 0", "prompt 2", "own", "prompt 4"]
    assert torch.isnan(out[1]) and torch.round(out[[0, 2, 3, 4]]).tolist() == [1, 2, 2, 2]
    strict = GenEvalServerScorer(endpoint=server.url, reward="strict").score(
        images(), prompts, meta)["geneval"]
    assert strict[[0, 2, 3, 4]].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_server_traceback_is_reported_and_retried_then_fails(serve):
    server = serve("geneval")  # a request without meta_datas: KeyError on the server
    scorer = DeQAServerScorer(endpoint=server.url, max_retries=1, backoff_s=0.01)
    with pytest.raises(FlowGRPOServerError) as err:
        scorer.score(images(), ["p"] * B, [{}] * B)
    assert str(err.value).count("HTTP 500") == 2 and "KeyError: 'meta_datas'" in str(err.value)


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['FLOWGRPO_TEST_MARKER']}",))


def test_a_reply_that_would_run_code_is_refused_without_running_it(serve, tmp_path,
                                                                   monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("FLOWGRPO_TEST_MARKER", str(marker))
    evil = pickle.dumps({"outputs": [_RunsCode()] * B})
    server = serve("deqa", reply=evil)
    with pytest.raises(FlowGRPOServerError) as err:
        DeQAServerScorer(endpoint=server.url, max_retries=0).score(images(), ["p"] * B, [{}] * B)
    assert "asks for posix.system" in str(err.value) or "asks for os.system" in str(err.value)
    assert not marker.exists()


def test_only_plain_values_unpickle():
    plain = {"a": [1, 2.5, None, True], "b": ("x", b"y"), "c": {1, 2}, "d": frozenset([3])}
    assert loads_plain(pickle.dumps(plain, protocol=5)) == plain
    with pytest.raises(pickle.UnpicklingError, match="numpy"):
        loads_plain(pickle.dumps({"outputs": [np.float32(0.5)]}))
    with pytest.raises(pickle.UnpicklingError, match="torch"):
        loads_plain(pickle.dumps(torch.zeros(2)))


def test_server_scorers_are_built_ins_with_checked_options(serve):
    server = serve("deqa")
    cfg = load_config("tiny", ["reward.component_weights={}", "reward.required_components=[]",
                               "reward.scorer_path=none",
                               f'reward.scorers={{"deqa": {{"endpoint": "{server.url}"}}}}'])
    check_imports(cfg)
    manager = build_reward_manager_from_config(cfg.reward)
    scores, _ = manager.score(images(), ["p"] * B, [{}] * B)
    assert scores["deqa"].shape == (B,)
    bad = load_config("tiny", ["reward.component_weights={}", "reward.required_components=[]",
                               "reward.scorer_path=none",
                               'reward.scorers={"unifiedreward_server": {}, '
                               '"geneval_server": {"reward": "loose"}}'])
    with pytest.raises(ConfigError) as err:
        check_imports(bad)
    assert "needs endpoint" in str(err.value) and "reward='loose'" in str(err.value)


# ---- replies that must not hold a run: a trickle and an oversized body -----------------------
class RawServer:
    """A TCP server that answers each connection with ``respond(conn)``."""

    def __init__(self, respond):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.respond, self.stop = respond, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/"

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            conn.settimeout(10)
            try:
                conn.recv(1 << 20)
                self.respond(conn, self.stop)
            except OSError:
                pass  # the client hung up: what the test wants

    def close(self):
        self.stop.set()
        self.sock.close()


def trickle(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    while not stop.wait(0.1):  # one byte every 0.1 s: every socket read finds data
        conn.sendall(b" ")


def trickle_headers(conn, stop):
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
        if stop.wait(0.1):
            return
        conn.sendall(bytes([byte]))


def endless(conn, stop):  # no Content-Length: read until the server closes, which it never does
    conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    chunk = b"0" * 65536
    while not stop.is_set():
        conn.sendall(chunk)


def announces_a_gigabyte(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n" + b"0" * 1024)
    stop.wait(5)


@pytest.mark.parametrize("respond", [trickle, trickle_headers], ids=["body", "headers"])
def test_a_trickling_server_misses_the_request_deadline(respond):
    server = RawServer(respond)
    try:
        for client in (RemoteScorer(server.url, components=("r",), timeout_s=0.5,
                                    max_retries=1, backoff_s=0.01),
                       DeQAServerScorer(endpoint=server.url, timeout_s=0.5, max_retries=1,
                                        backoff_s=0.01)):
            start = time.monotonic()
            with pytest.raises((RemoteRewardError, FlowGRPOServerError)) as err:
                client.score(images(), ["p"] * B, [{}] * B)
            assert time.monotonic() - start < 3.0  # 2 attempts x 0.5 s, not one per byte
            assert str(err.value).count("no whole reply within 0.5 s") == 2, str(err.value)
    finally:
        server.close()


@pytest.mark.parametrize("respond", [endless, announces_a_gigabyte],
                         ids=["streamed", "announced"])
def test_an_oversized_reply_is_refused_at_the_cap(respond):
    server = RawServer(respond)
    try:
        for client in (RemoteScorer(server.url, components=("r",), timeout_s=20,
                                    max_reply_bytes=1 << 20),
                       DeQAServerScorer(endpoint=server.url, timeout_s=20,
                                        max_reply_bytes=1 << 20)):
            start = time.monotonic()
            with pytest.raises((RemoteRewardError, FlowGRPOServerError)) as err:
                client.score(images(), ["p"] * B, [{}] * B)
            assert "1 attempt(s)" in str(err.value) and "cap of 1048576" in str(err.value)
            assert time.monotonic() - start < 10
    finally:
        server.close()
