"""Video over the remote reward protocol, against our own reference server (``serve.py``)
on 127.0.0.1: shape-tagged frames there and back, an image scorer aggregated by the server's
frame rule, a video scorer given the whole video, a one-frame video sent as an image, and a
tampered request refused with a 400 naming what disagrees."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from trainer.rewards import RewardServer, build_reward_manager, clear_reward_manager_cache
from trainer.rewards.remote import SCHEMA, RemoteScorer, encode_videos
from trainer.rewards.video import FrameRule, TemporalConsistencyScorer, score_batch
from test_rewards_video import META, PROMPTS, SEEN, VIDEO, Brightness, B, F, H, W


@pytest.fixture(autouse=True)
def _fresh():
    clear_reward_manager_cache()
    SEEN.clear()
    yield
    clear_reward_manager_cache()


@pytest.fixture
def serve():
    servers = []

    def start(scorer, **kwargs):
        servers.append(RewardServer(scorer, **kwargs).start())
        return servers[-1]
    yield start
    for server in servers:
        server.close()


def post(url: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("rule", [FrameRule("min"), FrameRule("sampled", 3), FrameRule()])
def test_a_video_round_trip_scores_as_the_local_frame_rule_does(serve, rule):
    server = serve(Brightness(), frame_rule=rule)
    remote = RemoteScorer(server.url, components=("brightness",))
    got = remote.score(VIDEO, PROMPTS, META)["brightness"]
    k = len(rule.indices(F))
    assert SEEN[0] == ((B * k, H, W, 3), [p for p in PROMPTS for _ in range(k)])
    local = score_batch(Brightness(), VIDEO, PROMPTS, META, None, rule)["brightness"]
    torch.testing.assert_close(got.float(), local, rtol=0, atol=0)  # PNG is lossless


def test_a_video_scorer_behind_the_server_gets_the_whole_video(serve):
    server = serve(TemporalConsistencyScorer())
    info = json.loads(urllib.request.urlopen(server.url, timeout=30).read())
    assert info["media"] == ["image", "video"] and info["required_tracks"] == ["video"]
    manager = build_reward_manager(scorer_path=None, model_path=None, runtime="remote",
                                   endpoint=server.url)
    scores, _ = manager.score(VIDEO, PROMPTS, META)
    local = TemporalConsistencyScorer().score(VIDEO, PROMPTS, META)["temporal_consistency"]
    torch.testing.assert_close(scores["temporal_consistency"], local)
    assert (scores["temporal_consistency"] < 1).all()  # not the one-frame value: F frames came


class _Capture(BaseHTTPRequestHandler):
    """Records the request body; replies zeros for every listed component."""

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        data = json.dumps({"rewards": {c: [0.0] * len(body["prompts"])
                                       for c in body["components"]}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_on_the_wire_a_video_is_shape_tagged_and_a_one_frame_video_is_an_image():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        remote = RemoteScorer(f"http://127.0.0.1:{server.server_address[1]}/",
                              components=("x",))
        remote.score(VIDEO, PROMPTS, META)
        remote.score(VIDEO[:, 4:5], PROMPTS, META)
    finally:
        server.shutdown()
        server.server_close()
    video, image = server.bodies
    assert "images" not in video and len(video["videos"]) == B
    assert all(v["shape"] == [F, H, W, 3] and len(v["frames"]) == F for v in video["videos"])
    assert "videos" not in image and len(image["images"]) == B


def test_a_request_whose_frames_disagree_with_their_shape_tag_is_a_400_naming_them(serve):
    server = serve(Brightness())
    videos = encode_videos(VIDEO)
    videos[1]["frames"] = videos[1]["frames"][:-1]              # a frame lost
    videos[2]["shape"] = [F, H + 2, W, 3]                        # a size that is not there
    status, reply = post(server.url, {"schema": SCHEMA, "components": ["brightness"],
                                      "prompts": PROMPTS, "metadata": META, "videos": videos})
    assert status == 400
    assert f"videos[1]: shape says {F} frames, 'frames' holds {F - 1}" in reply["error"]
    assert f"videos[2]: frames decode to [{F}, {H}, {W}, 3], shape says [{F}, {H + 2}, {W}, 3]" \
        in reply["error"]
    assert SEEN == []  # nothing scored


def test_the_server_refuses_a_frame_rule_it_cannot_apply():
    from trainer.rewards.serve import main
    with pytest.raises(SystemExit):
        main(["--scorer-path", "trainer.rewards.jpeg.JpegCompressibilityScorer",
              "--frame-aggregation", "sampled"])


class _Silent(BaseHTTPRequestHandler):
    """Reads the request, then never answers (until the test lets it go)."""

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.release.wait(30)


def test_a_video_request_has_the_same_deadline_as_any_other():
    from trainer.rewards.remote import RemoteRewardError
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    server.daemon_threads = True
    server.release = threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = RemoteScorer(f"http://127.0.0.1:{server.server_address[1]}/",
                              components=("x",), timeout_s=0.5, max_retries=1, backoff_s=0)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match="failed after 2 attempt.*timed out"):
            remote.score(VIDEO, PROMPTS, META)
        assert time.monotonic() - start < 5
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
