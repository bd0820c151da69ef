"""Rewards for editing: scorers that ask for the source images get them (decoded by PIL from
the files the test writes), the others are called as before; the built-in image-similarity and
red-to-blue terms, CLIP image-image similarity on a tiny random CLIP; custom functions that
name ``sources``; the VLM judge sends source and result in one OpenAI-style request, checked
by a loopback server."""
from __future__ import annotations

import base64
import io
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.config import load_config
from trainer.media import ImageRef
from trainer.rewards.base import RewardError, RewardScorer
from trainer.rewards.edit import ImageSimilarityScorer, RedToBlueScorer
from trainer.rewards.manager import (RewardManager, build_reward_manager_from_config,
                                     clear_reward_manager_cache)

from test_rewards_scorers import tiny_clip_dir  # noqa: F401  (the tiny CLIP fixture)


def _solid(colour, h=16, w=16):
    return np.broadcast_to(np.array(colour, np.uint8), (h, w, 3)).copy()


def _batch(*arrays):
    return torch.from_numpy(np.stack(arrays))


class _Plain(RewardScorer):
    """A scorer written before sources existed: its score takes no ``sources``."""
    components = ("plain",)

    def __init__(self):
        self.calls = 0

    def score(self, images, prompts, metadata):
        self.calls += 1
        return {"plain": images.float().mean(dim=(1, 2, 3))}


class _Seer(RewardScorer):
    components = ("seen",)
    wants_sources = True

    def __init__(self):
        self.received = "unset"

    def score(self, images, prompts, metadata, sources=None):
        self.received = sources
        return {"seen": torch.zeros(len(prompts))}


def test_manager_passes_decoded_sources_only_to_scorers_that_want_them(tmp_path):
    Image.fromarray(_solid((200, 0, 0), 10, 12)).save(tmp_path / "src.png")
    ref = ImageRef(str(tmp_path / "src.png"))
    plain, seer = _Plain(), _Seer()
    manager = RewardManager([plain, seer], runtime="cpu", device=torch.device("cpu"))
    images = _batch(_solid((0, 0, 0)), _solid((9, 9, 9)))
    out, _ = manager.score(images, ["make it blue"] * 2, [{}, {}], sources=[(ref,), (ref,)])
    assert plain.calls == 1 and out["plain"].tolist() == [0.0, 9.0]
    assert [len(s) for s in seer.received] == [1, 1]
    pixels = seer.received[0][0]
    assert pixels.dtype == np.uint8 and pixels.shape == (10, 12, 3)
    assert (pixels == (200, 0, 0)).all()
    assert seer.received[0][0] is seer.received[1][0]  # a group's shared source: decoded once
    manager.score(images, ["a cat"] * 2, [{}, {}])  # text-to-image: None, not empty tuples
    assert seer.received is None and plain.calls == 2
    with pytest.raises(ValueError, match="1 source lists for 2 images"):
        manager.score(images, ["x"] * 2, [{}, {}], sources=[(ref,)])


def test_image_similarity_is_one_for_a_copy_and_falls_with_the_change():
    scorer = ImageSimilarityScorer(size=8)
    source = np.zeros((32, 24, 3), np.uint8)
    source[:, :12] = 255
    changed = source.copy()
    changed[:16] = 128  # the top half repainted
    out = scorer.score(_batch(source, changed, 255 - source), ["x"] * 3, [{}] * 3,
                       sources=[(source,)] * 3)["image_similarity"]
    assert out[0] == pytest.approx(1.0)
    assert out[2] < out[1] < 1.0
    assert out[1] == pytest.approx(1 - (0.5 * 127 + 0.5 * 128) / 255 / 2)
    assert out[2] == pytest.approx(0.0)  # every pixel inverted
    # a source of another size is compared at the common downsampled size
    small = np.asarray(Image.fromarray(source).resize((12, 16), Image.BOX))
    assert scorer.score(_batch(source), ["x"], [{}], sources=[(small,)])["image_similarity"][0] \
        == pytest.approx(1.0, abs=0.01)
    with pytest.raises(RewardError, match="carries none"):
        scorer.score(_batch(source), ["x"], [{}], sources=None)


def test_red_to_blue_is_dense_in_how_much_red_became_blue():
    scorer = RedToBlueScorer()
    source = _solid((0, 160, 0))
    source[:, :8] = (220, 20, 20)  # the left half is red
    half = source.copy()
    half[:8, :8] = (20, 20, 220)  # half of the red area turned blue
    full = source.copy()
    full[:, :8] = (20, 20, 220)
    out = scorer.score(_batch(source, half, full, full), ["make the red blue"] * 4, [{}] * 4,
                       sources=[(source,)] * 3 + [(_solid((0, 0, 200)),)])["red_to_blue"]
    # still red: -200/255 per red pixel, blue: +200/255; the score is their red-weighted mean
    assert out[:3].tolist() == pytest.approx([-200 / 255, 0.0, 200 / 255], abs=1e-5)
    assert math.isnan(out[3])  # a source without red cannot be scored
    with pytest.raises(RewardError, match=r"samples \[1\] of 2 have no source image"):
        scorer.score(_batch(source, source), ["x"] * 2, [{}] * 2, sources=[(source,), ()])


def test_edit_scorers_are_built_ins_by_short_name(tmp_path):
    clear_reward_manager_cache()
    cfg = load_config("tiny", ['reward.scorers={"red_to_blue": {"weight": 1.0}, '
                               '"image_similarity": {"weight": 0.5, "size": 16}}'])
    manager = build_reward_manager_from_config(cfg.reward)
    assert manager.components == ("red_to_blue", "image_similarity")
    source = _solid((220, 0, 0))
    out, _ = manager.score(_batch(_solid((0, 0, 220))), ["make it blue"], [{}],
                           sources=[(source,)])
    assert out["red_to_blue"][0] == pytest.approx(220 / 255)
    assert 0.0 < out["image_similarity"][0] < 1.0


# ---- the VLM judge over a loopback OpenAI-compatible server --------------------------------
def _decode_data_url(url):
    assert url.startswith("data:image/png;base64,"), url[:40]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))


class _JudgeHandler(BaseHTTPRequestHandler):
    """Refuses (HTTP 400) any request that is not one user message of image_url parts then
    one text part, each image a PNG data URL; answers with the mean brightness of the last
    image (the result) minus that of the first (the source, when there are two or more)."""

    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            (message,) = body["messages"]
            parts = message["content"]
            assert message["role"] == "user" and parts[-1]["type"] == "text"
            assert all(p["type"] == "image_url" for p in parts[:-1]) and len(parts) >= 2
            images = [_decode_data_url(p["image_url"]["url"]) for p in parts[:-1]]
        except (AssertionError, KeyError, ValueError, TypeError):
            self.send_response(400)
            self.end_headers()
            return
        with self.server.lock:
            self.server.requests.append((parts[-1]["text"], images))
        score = images[-1].mean() - (images[0].mean() if len(images) > 1 else 0.0)
        payload = json.dumps({"choices": [{"message": {"content": f"{score / 255:.4f}"}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload.encode())


@pytest.fixture
def judge_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _JudgeHandler)
    server.requests, server.lock = [], threading.Lock()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_vlm_judge_sends_source_and_result_in_one_request(judge_server):
    from trainer.rewards.vlm_judge import VLMJudgeScorer
    url = f"http://127.0.0.1:{judge_server.server_address[1]}/v1"
    scorer = VLMJudgeScorer(endpoint=url, score_min=-1, score_max=1, concurrency=1)
    source = _solid((51, 51, 51), 8, 10)
    results = _batch(_solid((255, 255, 255)), _solid((102, 102, 102)))
    out = scorer.score(results, ["make it white", "make it grey"], [{}, {}],
                       sources=[(source,), (source,)])["vlm_judge"]
    # (result - source) brightness in [-1, 1], mapped to [0, 1]: only right if both were sent
    assert out.tolist() == pytest.approx([(1 + 204 / 255) / 2, (1 + 51 / 255) / 2], abs=1e-3)
    text, images = judge_server.requests[0]
    assert len(images) == 2 and images[0].shape == (8, 10, 3) and (images[0] == 51).all()
    assert images[1].shape == (16, 16, 3)
    assert 'instruction "make it white"' in text and "from -1 (poor) to 1 (excellent)" in text
    # text-to-image: one image, the plain question, the request as it always was
    judge_server.requests.clear()
    out = scorer.score(results[:1], ["a white square"], [{}], sources=None)["vlm_judge"]
    (text, images), = judge_server.requests
    assert len(images) == 1 and 'description "a white square"' in text
    assert out[0] == pytest.approx(1.0)
    question = scorer.question.format(prompt="p", score_min="-1", score_max="1")
    assert json.loads(scorer._body("QUJD", "p")) == {  # the text-to-image body, unchanged
        "model": "default", "temperature": 0.0, "max_tokens": 16, "messages": [
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                {"type": "text", "text": question}]}]}
    assert "edit_question uses unknown fields ['source']" in VLMJudgeScorer.check_options(
        endpoint=url, edit_question="{source} {prompt}")[0]


def test_clip_image_similarity_matches_transformers_own_clip_path(tiny_clip_dir):
    from test_rewards_scorers import IMAGE, reference_clip_embeds
    from trainer.rewards.edit import CLIPImageSimilarityScorer
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8) for _ in range(2)]
    results = np.stack([sources[0], 255 - sources[0], sources[1]])
    scorer = CLIPImageSimilarityScorer(model_path=tiny_clip_dir)
    out = scorer.score(torch.from_numpy(results), ["x"] * 3, [{}] * 3,
                       sources=[(sources[0],), (sources[0],), (sources[1],)])
    out = out["clip_image_similarity"]
    image, _, _ = reference_clip_embeds(tiny_clip_dir, torch.from_numpy(np.stack(
        [*results, *sources])), ["x"] * 5)
    expected = [float(image[0] @ image[3]), float(image[1] @ image[3]), float(image[2] @ image[4])]
    assert out.tolist() == pytest.approx(expected, abs=1e-4)
    assert out[0] == pytest.approx(1.0, abs=1e-5) and out[1] < 0.999


def test_custom_reward_functions_get_sources_only_when_they_name_them(tmp_path):
    from trainer.rewards.function import FunctionScorer, dummy_batch_problems
    seen = {}

    def kept_red(images, prompts, metadata, sources=None):
        seen["sources"] = sources
        return [float((s[0][..., 0] > 128).mean()) for s in sources]

    def brightness(images, prompts, metadata):
        return images.float().mean(dim=(1, 2, 3))

    edit_fn, plain = FunctionScorer(kept_red), FunctionScorer(brightness)
    assert edit_fn.wants_sources and not plain.wants_sources
    manager = RewardManager([edit_fn, plain], runtime="cpu", device=torch.device("cpu"))
    source = _solid((200, 0, 0))
    source[:8] = 0
    out, _ = manager.score(_batch(_solid((1, 1, 1))), ["make it blue"], [{}],
                           sources=[(source,)])
    assert out["kept_red"].tolist() == [0.5] and out["brightness"].tolist() == [1.0]
    assert seen["sources"][0][0].shape == (16, 16, 3)
    assert dummy_batch_problems(edit_fn) == [] and dummy_batch_problems(plain) == []
    assert seen["sources"][0][0].shape == (64, 64, 3)  # no records: grey stand-ins
    # with the run's first records, their own sources (decoded from the files) are used
    Image.fromarray(source).save(tmp_path / "src.png")
    records = [{"prompt": "make it blue", "metadata": {}, "images": [str(tmp_path / "src.png")]}]
    assert dummy_batch_problems(edit_fn, records=records * 2) == []
    assert [s[0].shape for s in seen["sources"]] == [(16, 16, 3)] * 2
    assert (seen["sources"][0][0] == source).all()
