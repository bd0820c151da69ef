"""The OCR, VLM-judge and GenEval scorers: Flow-GRPO's OCR formula (a scripted engine, and
RapidOCR on rendered text when it is installed), the judge against a local fake
OpenAI-compatible server, GenEval's rules with a colour-blob detector."""
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
from PIL import Image, ImageDraw, ImageFont

from trainer.rewards.base import RewardError
from trainer.rewards.ocr import OCRScorer, edit_distance, ocr_reward
from trainer.rewards.remote import RemoteRewardError


# ---- OCR ----------------------------------------------------------------------------------
def test_edit_distance_and_formula():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert edit_distance("flaw", "lawn") == 2 and edit_distance("same", "same") == 0
    assert ocr_reward("Hello World", "helloworld") == 1.0
    assert ocr_reward("Hello", "xx HELLO yy") == 1.0           # inside: distance 0
    assert ocr_reward("hello", "hellp") == pytest.approx(0.8)  # one substitution of five
    assert ocr_reward("abc", "zzzzzzzzzzzz") == 0.0           # capped at the target length
    assert ocr_reward("abc", "") == 0.0
    assert math.isnan(ocr_reward(None, "abc"))


SCRIPT = {}  # mean pixel value -> what the scripted engine "reads"


def scripted_engine():
    def read(image):
        return SCRIPT[int(image.mean())]
    return read


def test_ocr_scorer_with_a_scripted_engine():
    SCRIPT.clear()
    SCRIPT.update({10: [("FLOW", 0.9), ("GRPO", 0.8)], 20: [("FLOW", 0.9), ("GRPX", 0.0)],
                   30: [("nothing", 0.9)]})
    scorer = OCRScorer(engine="test_rewards_new_scorers.scripted_engine")
    images = torch.stack([torch.full((8, 8, 3), v, dtype=torch.uint8) for v in (10, 20, 30, 10)])
    prompts = ['a sign that says "Flow GRPO"'] * 3 + ["no quotes here"]
    out = scorer.score(images, prompts, [{}] * 4)["ocr"]
    # zero-confidence segments are dropped: "flow" vs "flowgrpo" is 4 edits of 8
    assert out[:3].tolist() == pytest.approx([1.0, 0.5, 1 - 7 / 8])
    assert math.isnan(out[3])


def render(text: str, size=(320, 96)) -> torch.Tensor:
    img = Image.new("RGB", size, "white")
    font = ImageFont.load_default(size=40)
    ImageDraw.Draw(img).text((12, 24), text, fill="black", font=font)
    return torch.from_numpy(np.asarray(img).copy())


def test_ocr_scorer_reads_rendered_text_with_rapidocr():
    pytest.importorskip("rapidocr_onnxruntime")
    scorer = OCRScorer()
    images = torch.stack([render("OPEN LATE"), render("OPEN LATE"), render(""),
                          render("OPEN LATX")])
    prompts = ['a shop sign reading "open late"', 'a neon sign: "closed"',
               'a sign reading "open late"', 'a shop sign reading "open late"']
    out = scorer.score(images, prompts, [{}] * 4)["ocr"].tolist()
    assert out[0] == 1.0
    assert out[1] < 0.5                       # "openlate" is 6+ edits from "closed"
    assert out[2] == 0.0                      # a blank image reads nothing
    assert out[3] == pytest.approx(1 - 1 / 8)  # one wrong letter of eight


# ---- VLM judge ----------------------------------------------------------------------------
class FakeChatServer(ThreadingHTTPServer):
    """/v1/chat/completions: answers "Score: <1 + 4 * mean brightness>" for the image sent,
    or scripted replies; records every request body."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _ChatHandler)
        self.requests, self.script, self.lock = [], [], threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _ChatHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append((self.path, dict(self.headers), body))
            scripted = self.server.script.pop(0) if self.server.script else None
        if scripted is not None and isinstance(scripted, int):
            self.send_response(scripted)
            self.end_headers()
            return
        url = body["messages"][0]["content"][0]["image_url"]["url"]
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
        answer = scripted or f"Score: {1 + 4 * image.mean() / 255:.3f}"
        payload = json.dumps({"choices": [{"message": {"role": "assistant",
                                                       "content": answer}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def chat_server():
    server = FakeChatServer()
    yield server
    server.shutdown()
    server.server_close()


def test_vlm_judge_against_a_fake_openai_server(chat_server, monkeypatch):
    from trainer.rewards.vlm_judge import VLMJudgeScorer
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    scorer = VLMJudgeScorer(endpoint=chat_server.url, model="unified-reward", concurrency=2,
                            api_key_env="JUDGE_KEY")
    images = torch.stack([torch.full((6, 5, 3), v, dtype=torch.uint8) for v in (0, 255, 51)])
    out = scorer.score(images, ["a cat", "a dog", "a red car"], [{}] * 3)["vlm_judge"]
    assert out.tolist() == pytest.approx([0.0, 1.0, 0.2], abs=1e-3)
    assert len(chat_server.requests) == 3
    path, headers, body = chat_server.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "unified-reward"
    assert headers["Authorization"] == "Bearer sk-test"
    texts = sorted(r[2]["messages"][0]["content"][1]["text"] for r in chat_server.requests)
    assert all("from 1 (poor) to 5 (excellent)" in t for t in texts)
    assert any('"a red car"' in t for t in texts)


def test_vlm_judge_retries_5xx_marks_unparseable_and_fails_loudly(chat_server):
    from trainer.rewards.vlm_judge import VLMJudgeScorer
    scorer = VLMJudgeScorer(endpoint=chat_server.url, max_retries=1, concurrency=1,
                            score_min=0, score_max=10)
    image = torch.full((1, 4, 4, 3), 255, dtype=torch.uint8)
    chat_server.script[:] = [500, "I cannot judge this."]
    out = scorer.score(image, ["x"], [{}])["vlm_judge"]
    assert math.isnan(out[0]) and len(chat_server.requests) == 2
    chat_server.script[:] = [503, 502]
    with pytest.raises(RemoteRewardError, match=r"failed after 2 attempt\(s\): HTTP 503; HTTP 502"):
        scorer.score(image, ["x"], [{}])
    assert "must be above" in VLMJudgeScorer.check_options(
        endpoint="http://h/v1", score_min=5, score_max=5)[0]
    assert "not a regular expression" in VLMJudgeScorer.check_options(
        endpoint="http://h/v1", score_pattern="(")[0]


def test_vlm_judge_score_pattern_picks_the_final_score(chat_server):
    from trainer.rewards.vlm_judge import VLMJudgeScorer, parse_score
    scorer = VLMJudgeScorer(endpoint=chat_server.url, concurrency=1,
                            score_pattern=r"Final Score:\s*(-?\d+(?:\.\d+)?)")
    chat_server.script[:] = ["1. The cat is red. 2. Sharp. Final Score: 4.0",
                             "3 cats, no final verdict"]
    image = torch.zeros((2, 4, 4, 3), dtype=torch.uint8)
    out = scorer.score(image, ["x", "y"], [{}, {}])["vlm_judge"]
    assert out[0] == pytest.approx(0.75) and math.isnan(out[1])
    assert parse_score("score 9", 1, 5) == 1.0 and parse_score("-3", 1, 5) == 0.0


# ---- GenEval ------------------------------------------------------------------------------
COLOURS = {(255, 0, 0): ("apple", "red"), (0, 0, 255): ("car", "blue"),
           (0, 255, 0): ("apple", "green")}


def blob_detector(min_pixels: int = 4):
    """Finds solid-colour rectangles (one per connected run of rows of one colour)."""
    def detect(images):
        out = []
        for image in images.numpy():
            found = []
            for rgb, (cls, colour) in COLOURS.items():
                mask = np.all(image == np.array(rgb, dtype=np.uint8), axis=-1)
                rows = np.flatnonzero(mask.any(axis=1))
                if rows.size < 1 or mask.sum() < min_pixels:
                    continue
                # split into separate blobs along x (the tests keep blobs side by side)
                cols = np.flatnonzero(mask.any(axis=0))
                runs = np.split(cols, np.flatnonzero(np.diff(cols) > 1) + 1)
                for run in runs:
                    ys = np.flatnonzero(mask[:, run].any(axis=1))
                    found.append({"class": cls, "color": colour, "score": 0.95,
                                  "box": [run[0], ys[0], run[-1] + 1, ys[-1] + 1]})
            out.append(found)
        return out
    return detect


def canvas(*rects):
    img = np.zeros((40, 60, 3), dtype=np.uint8)
    for (x0, y0, x1, y1), rgb in rects:
        img[y0:y1, x0:x1] = rgb
    return torch.from_numpy(img)


def test_geneval_rules_with_a_fake_detector():
    from trainer.rewards.geneval import GenEvalScorer
    scorer = GenEvalScorer(detector="test_rewards_new_scorers.blob_detector",
                           detector_options={"min_pixels": 4})
    red, blue, green = (255, 0, 0), (0, 0, 255), (0, 255, 0)
    images = torch.stack([
        canvas(((2, 10, 12, 20), red), ((40, 10, 50, 20), blue)),  # red apple left of car
        canvas(((40, 10, 50, 20), red), ((2, 10, 12, 20), blue)),  # apple right of car
        canvas(((2, 2, 8, 8), red), ((20, 2, 26, 8), red)),         # two red apples
        canvas(((2, 2, 8, 8), green), ((20, 2, 26, 8), blue)),      # green apple and a car
        canvas(),
    ])
    left = {"include": [{"class": "apple", "count": 1, "color": "red",
                         "position": ["left of", 1]}, {"class": "car", "count": 1}]}
    meta = [left, left,
            {"include": [{"class": "apple", "count": 2}], "exclude": [{"class": "apple",
                                                                       "count": 3}]},
            {"include": [{"class": "apple", "color": "red", "count": 1}],
             "exclude": [{"class": "car", "count": 1}]},
            {}]
    out = scorer.score(images, ["p"] * 5, meta)["geneval"]
    assert out[:4].tolist() == [1.0, 0.0, 1.0, 0.0] and math.isnan(out[4])
    partial = GenEvalScorer(detector="test_rewards_new_scorers.blob_detector", mode="partial")
    assert partial.score(images[1:2], ["p"], meta[1:2])["geneval"].tolist() == [0.5]
    assert partial.score(images[3:4], ["p"], meta[3:4])["geneval"].tolist() == [0.0]
    with pytest.raises(RewardError, match="position"):
        scorer.score(images[:1], ["p"], [{"include": [{"class": "a", "position": ["near", 0]}]}])


# ---- ImageReward --------------------------------------------------------------------------
TINY_ARCH = dict(image_size=32, patch_size=8, vision_hidden=32, vision_layers=2,
                 vision_heads=2, vision_mlp=64, text_hidden=24, text_layers=2, text_heads=2,
                 text_mlp=48, vocab_size=40, max_positions=64, max_length=12)
WORDS = ["a", "red", "cat", "dog", "on", "the", "table", "photo", "of", "blue"]


def original_names(model_state):
    """ImageRewardModel names -> the released checkpoint's (BLIP's own), by the inverse of
    the loader's table, written out independently here."""
    inverse = [(r"^embeddings\.class_embedding$", "cls_token"),
               (r"^embeddings\.position_embedding$", "pos_embed"),
               (r"^embeddings\.patch_embedding\.", "patch_embed.proj."),
               (r"^encoder\.layers\.(\d+)\.layer_norm1\.", r"blocks.\1.norm1."),
               (r"^encoder\.layers\.(\d+)\.layer_norm2\.", r"blocks.\1.norm2."),
               (r"^encoder\.layers\.(\d+)\.self_attn\.qkv\.", r"blocks.\1.attn.qkv."),
               (r"^encoder\.layers\.(\d+)\.self_attn\.projection\.", r"blocks.\1.attn.proj."),
               (r"^encoder\.layers\.(\d+)\.mlp\.", r"blocks.\1.mlp."),
               (r"^post_layernorm\.", "norm.")]
    import re
    out = {"blip.vision_proj.weight": torch.zeros(3, 3)}  # an unused BLIP head: ignored
    for key, value in model_state.items():
        if key.startswith("vision."):
            name = key[len("vision."):]
            for pattern, repl in inverse:
                name, n = re.subn(pattern, repl, name)
                if n:
                    break
            out["blip.visual_encoder." + name] = value
        elif key.startswith("text."):
            out["blip.text_encoder." + key[len("text."):]] = value
        else:
            out[key] = value
    return out


def manual_vit(state, pixels, heads, eps=1e-6):
    """BLIP's ViT forward from the checkpoint's own tensors (an independent oracle)."""
    import torch.nn.functional as F
    p = {k[len("blip.visual_encoder."):]: v.double() for k, v in state.items()
         if k.startswith("blip.visual_encoder.")}
    x = F.conv2d(pixels.double(), p["patch_embed.proj.weight"], p["patch_embed.proj.bias"],
                 stride=p["patch_embed.proj.weight"].shape[-1]).flatten(2).transpose(1, 2)
    x = torch.cat([p["cls_token"].expand(x.shape[0], -1, -1), x], 1) + p["pos_embed"]
    d = x.shape[-1]
    for i in range(len({k.split(".")[1] for k in p if k.startswith("blocks.")})):
        b = lambda n: p[f"blocks.{i}.{n}"]  # noqa: E731
        h = F.layer_norm(x, (d,), b("norm1.weight"), b("norm1.bias"), eps)
        q, k, v = F.linear(h, b("attn.qkv.weight"), b("attn.qkv.bias")).view(
            x.shape[0], -1, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // heads) ** 0.5, -1) @ v
        x = x + F.linear(a.transpose(1, 2).reshape(x.shape), b("attn.proj.weight"),
                         b("attn.proj.bias"))
        h = F.layer_norm(x, (d,), b("norm2.weight"), b("norm2.bias"), eps)
        x = x + F.linear(F.gelu(F.linear(h, b("mlp.fc1.weight"), b("mlp.fc1.bias"))),
                         b("mlp.fc2.weight"), b("mlp.fc2.bias"))
    return F.layer_norm(x, (d,), p["norm.weight"], p["norm.bias"], eps)


@pytest.fixture(scope="module")
def tiny_imagereward(tmp_path_factory):
    from transformers import BertTokenizer
    from trainer.rewards.imagereward import ImageRewardModel
    root = tmp_path_factory.mktemp("imagereward")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(root)
    torch.manual_seed(0)
    model = ImageRewardModel(TINY_ARCH)
    with torch.no_grad():
        for p in model.parameters():  # BLIP's vision init is ~0: draw visible weights
            p.normal_(0.0, 0.2)
    state = original_names(model.state_dict())
    torch.save(state, root / "ImageReward.pt")
    return root, state


def test_imagereward_loads_the_released_layout_and_scores(tiny_imagereward):
    from trainer.rewards.imagereward import SCORE_MEAN, SCORE_STD, ImageRewardScorer
    root, state = tiny_imagereward
    scorer = ImageRewardScorer(model_path=str(root), architecture=TINY_ARCH, batch_size=3)
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (4, 48, 40, 3), dtype=torch.uint8, generator=g)
    images[3] = images[0]
    prompts = ["a red cat", "a photo of a dog on the table", "blue", "a red dog"]
    out = scorer.score(images, prompts, [{}] * 4)["imagereward"]
    pixels = scorer.transform(images)
    with torch.no_grad():
        vision = scorer.model.vision(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(vision.double(), manual_vit(state, pixels, heads=2),
                               rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        text = scorer.tokenizer(prompts, padding="max_length", truncation=True,
                                max_length=12, return_tensors="pt")
        assert text.input_ids.shape == (4, 12) and text.input_ids[0, 0] == 2  # [CLS]
        cls = scorer.model.text(input_ids=text.input_ids, attention_mask=text.attention_mask,
                                encoder_hidden_states=vision, is_decoder=False
                                ).last_hidden_state[:, 0]
        head = [state[f"mlp.layers.{i}.weight"] for i in (0, 2, 4, 6, 7)]
        bias = [state[f"mlp.layers.{i}.bias"] for i in (0, 2, 4, 6, 7)]
        y = cls.double()
        for w, b in zip(head, bias):
            y = y @ w.double().T + b.double()
    torch.testing.assert_close(out.double(), (y.squeeze(-1) - SCORE_MEAN) / SCORE_STD,
                               rtol=1e-4, atol=1e-4)
    assert len(set(out.tolist())) == 4  # the prompt alone changes the score (0 vs 3)


def test_imagereward_refuses_a_truncated_checkpoint(tiny_imagereward, tmp_path):
    from transformers import BertTokenizer
    from trainer.rewards.imagereward import ImageRewardScorer
    root, state = tiny_imagereward
    BertTokenizer(str(root / "vocab.txt")).save_pretrained(tmp_path)
    torch.save({k: v for k, v in state.items() if "blocks.1." not in k},
               tmp_path / "ImageReward.pt")
    with pytest.raises(ValueError, match="missing"):
        ImageRewardScorer(model_path=str(tmp_path), architecture=TINY_ARCH)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "ImageReward.pt").write_bytes((tmp_path / "ImageReward.pt").read_bytes())
    with pytest.raises(ValueError, match="no tokenizer .* pass tokenizer_path"):
        ImageRewardScorer(model_path=str(bare / "ImageReward.pt"), architecture=TINY_ARCH)
    assert ImageRewardScorer.check_options(architecture={"depth": 3}) == [
        f"architecture keys ['depth'] unknown (known: {sorted(TINY_ARCH)})"]
