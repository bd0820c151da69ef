"""The remote runtime against local HTTP servers started here on 127.0.0.1: the reference
server for the happy path, and a scripted one for timeouts, 5xx, 4xx and malformed replies."""
from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from trainer.rewards import (RemoteRewardError, RewardError, RewardScorer, RewardServer,
                             build_reward_manager, clear_reward_manager_cache)
from trainer.rewards.jpeg import JpegIncompressibilityScorer
from trainer.rewards.remote import SCHEMA, RemoteScorer, decode_png_base64, encode_png_base64

B = 4


def batch():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (B, 24, 20, 3), dtype=torch.uint8, generator=g)
    prompts = [f"prompt {i}" for i in range(B)]
    return images, prompts, [{"sample_id": f"s{i}", "task": "t2i"} for i in range(B)]


class PixelStatsScorer(RewardScorer):
    """Two components that depend on the exact pixels and on the metadata."""

    components = ("brightness", "id_len")

    def score(self, images, prompts, metadata):
        return {"brightness": images.float().mean(dim=(1, 2, 3)) / 255.0,
                "id_len": torch.tensor([len(m["sample_id"]) * 1.0 for m in metadata])}


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_reward_manager_cache()
    yield
    clear_reward_manager_cache()


@pytest.fixture
def reference_server():
    server = RewardServer(PixelStatsScorer()).start()
    yield server
    server.close()


def test_png_round_trip_is_lossless():
    images, _, _ = batch()
    assert torch.equal(decode_png_base64(encode_png_base64(images)), images)


def test_remote_scores_equal_local_scores(reference_server):
    images, prompts, metadata = batch()
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="remote",
                                   endpoint=reference_server.url, timeout_s=5)
    assert manager.components == ("brightness", "id_len")  # asked the server (GET)
    remote, metrics = manager.score(images, prompts, metadata)
    local = PixelStatsScorer().score(images, prompts, metadata)
    for name in local:
        assert torch.equal(remote[name], local[name].float())
    assert metrics["reward/score_samples_per_s"] > 0


def test_remote_with_scorer_path_takes_components_from_the_class():
    server = RewardServer(JpegIncompressibilityScorer()).start()
    try:
        manager = build_reward_manager(
            scorer_path="trainer.rewards.jpeg.JpegIncompressibilityScorer", model_path=None,
            runtime="remote", endpoint=server.url)
        images, prompts, metadata = batch()
        scores, _ = manager.score(images, prompts, metadata)
        expected = JpegIncompressibilityScorer().score(images, prompts, metadata)
        assert torch.equal(scores["jpeg_incompressibility"], expected["jpeg_incompressibility"])
    finally:
        server.close()


def test_reference_server_rejects_bad_requests_and_reports_scorer_failures(reference_server):
    request = urllib.request.Request(reference_server.url, method="POST",
                                     data=json.dumps({"schema": "v0"}).encode())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 400 and "schema" in err.value.read().decode()

    class Broken(RewardScorer):
        components = ("x",)

        def score(self, images, prompts, metadata):
            raise RuntimeError("boom")

    server = RewardServer(Broken()).start()
    try:
        client = RemoteScorer(server.url, timeout_s=5, max_retries=1, backoff_s=0.01)
        with pytest.raises(RemoteRewardError) as err:
            client.score(*batch())
        assert str(err.value).count("HTTP 500") == 2 and "RuntimeError: boom" in str(err.value)
    finally:
        server.close()


class ScriptedServer(ThreadingHTTPServer):
    """Answers POST n with script[n] (the last entry repeats); counts the requests."""

    daemon_threads = True

    def __init__(self, script, info=None):
        super().__init__(("127.0.0.1", 0), _ScriptedHandler)
        self.script, self.info, self.posts = list(script), info, 0
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/score"

    def handle_error(self, request, client_address):
        pass  # the client hung up on a "sleep" reply: that is the test

    def close(self):
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=5)


class _ScriptedHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status, body: bytes):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        info = self.server.info
        self._send(200, info if isinstance(info, bytes) else json.dumps(info).encode())

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert request["schema"] == SCHEMA and len(request["images"]) == B
        action = self.server.script[min(self.server.posts, len(self.server.script) - 1)]
        self.server.posts += 1
        good = {"rewards": {"r": [0.5, 1.0, None, 2.0]}}
        if action == "ok":
            self._send(200, json.dumps(good).encode())
        elif action == "sleep":
            time.sleep(0.6)  # longer than the client's timeout; bounded, then answers
            self._send(200, json.dumps(good).encode())
        elif action in ("500", "503", "400", "429"):
            self._send(int(action), b"scripted failure")
        elif action == "malformed":
            self._send(200, b'{"rewards": {"r": [0.5, 1.0')
        elif action == "short":
            self._send(200, json.dumps({"rewards": {"r": [1.0, 2.0, 3.0]}}).encode())
        elif action == "renamed":
            self._send(200, json.dumps({"rewards": {"q": [1.0] * B}}).encode())
        elif action == "huge":
            self._send(200, json.dumps({"rewards": {"r": [1e300, 1.0, 2.0, 3.0]}}).encode())
        elif action == "strings":
            self._send(200, json.dumps({"rewards": {"r": ["a", 1, True, 2]}}).encode())


@pytest.fixture
def scripted():
    servers = []

    def start(script, info=None):
        servers.append(ScriptedServer(script, info))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def client(url, **kwargs):
    options = dict(components=("r",), timeout_s=0.2, max_retries=2, backoff_s=0.01)
    options.update(kwargs)
    return RemoteScorer(url, **options)


def test_retries_5xx_and_429_then_succeeds(scripted):
    server = scripted(["500", "429", "ok"])
    scores = client(server.url).score(*batch())
    assert server.posts == 3
    r = scores["r"]
    assert r[[0, 1, 3]].tolist() == [0.5, 1.0, 2.0] and math.isnan(r[2])  # null -> NaN


def test_gives_up_after_max_retries_on_5xx(scripted):
    server = scripted(["503"])
    with pytest.raises(RemoteRewardError) as err:
        client(server.url, max_retries=2).score(*batch())
    assert server.posts == 3 and str(err.value).count("HTTP 503 scripted failure") == 3
    assert "failed after 3 attempt(s)" in str(err.value) and server.url in str(err.value)


def test_timeout_is_retried_then_fails(scripted):
    server = scripted(["sleep"])
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as err:
        client(server.url, max_retries=1).score(*batch())
    assert str(err.value).count("timed out") == 2
    assert time.monotonic() - start < 3.0


def test_timeout_then_success(scripted):
    server = scripted(["sleep", "ok"])
    assert client(server.url).score(*batch())["r"][0].item() == 0.5
    assert server.posts == 2


@pytest.mark.parametrize("action,message", [
    ("malformed", "malformed JSON reply"),
    ("short", "'r': expected a list of 4 values, got 3"),
    ("renamed", "missing components ['r']; unexpected components ['q']"),
    ("strings", "'r': non-numeric values at [0, 2]"),
    ("400", "HTTP 400 scripted failure"),
])
def test_unusable_replies_fail_at_once(scripted, action, message):
    server = scripted([action])
    with pytest.raises(RemoteRewardError) as err:
        client(server.url).score(*batch())
    assert message in str(err.value)
    assert server.posts == 1  # deterministic failures are not retried


def test_connection_refused_is_retried():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteRewardError) as err:
        client(f"http://127.0.0.1:{port}/", max_retries=1).score(*batch())
    assert "failed after 2 attempt(s)" in str(err.value)
    assert "Connection" in str(err.value) or "refused" in str(err.value)


def test_component_discovery_errors(scripted):
    server = scripted(["ok"], info={"schema": SCHEMA})
    with pytest.raises(RemoteRewardError, match="no list of component names"):
        RemoteScorer(server.url, timeout_s=1, max_retries=0)
    server = scripted(["ok"], info=b"<html>")
    with pytest.raises(RemoteRewardError, match="malformed JSON"):
        RemoteScorer(server.url, timeout_s=1, max_retries=0)


def test_client_option_and_payload_errors():
    with pytest.raises(ValueError) as err:
        RemoteScorer("ftp://x", components=("r",), timeout_s=0, max_retries=-1)
    assert all(s in str(err.value) for s in ("not an http(s) URL", "timeout_s=0", "max_retries=-1"))
    images, prompts, _ = batch()
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        client("http://127.0.0.1:9/").score(images, prompts, [{"x": object()}] * B)


def test_serving_module_end_to_end():
    """`python -m trainer.rewards.serve` serves a scorer; the client talks to it."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.rewards.serve", "--scorer-path",
         "trainer.rewards.jpeg.JpegIncompressibilityScorer", "--port", "0"],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)  # bounded even if the server never starts
    watchdog.start()
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving trainer.rewards.jpeg.JpegIncompressibilityScorer"), \
            line + proc.stderr.read()
        url = line.rsplit(" at ", 1)[1].strip()
        remote = RemoteScorer(url, timeout_s=30, max_retries=0)
        assert remote.components == ("jpeg_incompressibility",)
        images, prompts, metadata = batch()
        expected = JpegIncompressibilityScorer().score(images, prompts, metadata)
        assert torch.equal(remote.score(images, prompts, metadata)["jpeg_incompressibility"],
                           expected["jpeg_incompressibility"])
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(timeout=30)


def test_a_remote_reward_beyond_float32_is_refused_not_turned_into_inf(scripted):
    server = scripted(["huge"])
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="remote",
                                   endpoint=server.url, components=("r",), timeout_s=5)
    with pytest.raises(RewardError, match=r"'r': values beyond float32's range .*1e\+300"):
        manager.score(*batch())
