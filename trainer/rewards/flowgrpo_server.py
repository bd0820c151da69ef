"""Clients for the Flow-GRPO reference's reward servers (its GenEval, DeQA and UnifiedReward
servers), so a server a user already runs for the reference works here as it is.

The protocol, as the reference's ``flow_grpo/rewards.py`` clients and its reward-server apps
speak it (one URL, POST only, the reference's batches of 64 images)::

    client                                         server
      | POST  pickle({"images": [JPEG bytes] * B,    |
      |               ...per server, below...})      |
      | ------------------------------------------>  |
      |  200  pickle({...per server, below...})      |
      |  500  the server's traceback, UTF-8 text     |
      | <------------------------------------------  |

    GenEval        request + "meta_datas": [GenEval metadata] * B, "only_strict": bool
                   reply   {"scores": [float] * B, "rewards": [...], "strict_rewards": [...],
                            "group_rewards": {tag: [...]}, "group_strict_rewards": {...}}
    DeQA           reply   {"outputs": [float] * B}   (the quality score / 5)
    UnifiedReward  request + "prompts": [str] * B;  reply {"outputs": [float] * B}

Decoding: ``pickle.loads`` of a reply would run whatever the server (or anything between) put
in it. Replies are read with ``PlainUnpickler``, which resolves no global at all, so only the
pickle opcodes of plain values can appear: dicts, lists, tuples, sets, strings, bytes, ints,
floats, bools and None. The reference's servers reply exactly that (Python floats from
``.item()`` and arithmetic); a reply holding anything else (a numpy scalar, a tensor) is
refused with the name of the class it asked for. The request is pickled by us, from plain
values only, because the reference's servers ``pickle.loads`` it.

Each POST goes through ``bounded_http``: a deadline on the whole exchange (``timeout_s``,
120 s as the reference's) and a reply size cap. Missed deadlines, refused connections and 5xx
replies are retried ``max_retries`` times with backoff; anything else fails at once.
"""
from __future__ import annotations

import http.client
import io
import math
import pickle
import time
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image

from trainer.rewards import bounded_http
from trainer.rewards.base import RewardError, RewardScorer

GENEVAL_REWARDS = {"score": "scores", "strict": "strict_rewards"}
_MAX_BACKOFF_S = 30.0


class FlowGRPOServerError(RewardError):
    """A reference reward server failed or replied something unusable."""


class PlainUnpickler(pickle.Unpickler):
    """Unpickles plain values only: every global lookup (the one door to running code) is
    refused, so classes, functions and ``__reduce__`` payloads cannot be reached."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"the reply asks for {module}.{name}; only plain dicts, lists, tuples, strings, "
            f"numbers, bools and None are accepted from a reward server")


def loads_plain(data: bytes) -> Any:
    """``pickle.loads`` restricted to plain values (``PlainUnpickler``)."""
    return PlainUnpickler(io.BytesIO(data)).load()


def encode_jpeg(images: torch.Tensor, quality: int = 75) -> list[bytes]:
    """uint8 [B, H, W, 3] -> JPEG bytes per image (75: PIL's default, the reference's)."""
    out = []
    for array in images.detach().to("cpu").numpy():
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        out.append(buffer.getvalue())
    return out


def _numbers(reply: Any, key: str, n: int, where: str) -> list[float]:
    values = reply.get(key) if isinstance(reply, dict) else None
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else \
            type(values).__name__
        keys = sorted(map(str, reply)) if isinstance(reply, dict) else type(reply).__name__
        raise FlowGRPOServerError(f"{where}: reply's {key!r} should be a list of {n} numbers, "
                                  f"got {got} (reply keys: {keys})")
    bad = [i for i, v in enumerate(values)
           if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise FlowGRPOServerError(f"{where}: reply's {key!r} holds non-numbers at {bad[:5]}: "
                                  f"{[values[i] for i in bad[:3]]!r}")
    return [float(v) for v in values]


class FlowGRPOServerScorer(RewardScorer):
    """Base of the three clients (one component each; see the module docstring).

    Args:
        endpoint: the server's URL.
        timeout_s: deadline of each POST, the whole exchange.
        max_retries: retries after the first attempt, for missed deadlines, refused
            connections and 5xx replies.
        backoff_s: first backoff; doubles per retry (at most 30 s).
        batch_size: images per POST (the reference's 64).
        jpeg_quality: the images' JPEG quality (75, the reference's).
        max_reply_bytes: a larger reply fails at once.
    """

    components: ClassVar[tuple[str, ...]] = ()
    default_endpoint: ClassVar[str | None] = None
    reply_key: ClassVar[str] = "outputs"

    def __init__(self, *, endpoint: str | None = None, timeout_s: float = 120.0,
                 max_retries: int = 3, backoff_s: float = 1.0, batch_size: int = 64,
                 jpeg_quality: int = 75,
                 max_reply_bytes: int = bounded_http.DEFAULT_MAX_REPLY_BYTES,
                 device: str | torch.device | None = None) -> None:
        endpoint = endpoint or self.default_endpoint
        problems = self.check_options(endpoint=endpoint, timeout_s=timeout_s,
                                      max_retries=max_retries, batch_size=batch_size,
                                      jpeg_quality=jpeg_quality)
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self.endpoint, self.timeout_s = endpoint, float(timeout_s)
        self.max_retries, self.backoff_s = int(max_retries), float(backoff_s)
        self.batch_size, self.jpeg_quality = int(batch_size), int(jpeg_quality)
        self.max_reply_bytes = int(max_reply_bytes)

    @classmethod
    def check_options(cls, endpoint: str | None = None, timeout_s: float = 120.0,
                      max_retries: int = 3, batch_size: int = 64, jpeg_quality: int = 75,
                      **_: Any) -> list[str]:
        endpoint = endpoint or cls.default_endpoint
        problems = []
        if not endpoint:
            problems.append("needs endpoint = \"http://host:port\" (the reference's server)")
        elif not str(endpoint).startswith(("http://", "https://")):
            problems.append(f"endpoint={endpoint!r} is not an http(s) URL")
        if not timeout_s > 0:
            problems.append(f"timeout_s={timeout_s} must be > 0")
        if max_retries < 0:
            problems.append(f"max_retries={max_retries} must be >= 0")
        if batch_size < 1:
            problems.append(f"batch_size={batch_size} must be >= 1")
        if not 1 <= jpeg_quality <= 95:
            problems.append(f"jpeg_quality={jpeg_quality} must be in [1, 95]")
        return problems

    def post(self, payload: dict[str, Any]) -> Any:
        """POST ``pickle(payload)``; the reply decoded by ``loads_plain``."""
        body = pickle.dumps(payload, protocol=4)
        failures: list[str] = []
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            try:
                reply = bounded_http.request(self.endpoint, body=body, deadline_s=self.timeout_s,
                                             max_reply_bytes=self.max_reply_bytes)
            except bounded_http.ReplyTooLarge as exc:
                failures.append(f"attempt {attempt + 1}: {exc} (max_reply_bytes)")
                break
            except (OSError, http.client.HTTPException) as exc:  # deadline included
                failures.append(f"attempt {attempt + 1}: {type(exc).__name__}: {exc}")
                continue
            if reply.status != 200:
                text = reply.body[-500:].decode("utf-8", "replace").strip()
                failures.append(f"attempt {attempt + 1}: HTTP {reply.status} {text}")
                if reply.status >= 500:
                    continue
                break
            try:
                return loads_plain(reply.body)
            except Exception as exc:  # any malformed pickle: never executed, only refused
                failures.append(f"attempt {attempt + 1}: reply refused: "
                                f"{type(exc).__name__}: {exc}")
                break
        raise FlowGRPOServerError(f"{type(self).__name__} {self.endpoint} failed after "
                                  f"{len(failures)} attempt(s): " + " | ".join(failures))

    def payload(self, jpegs: list[bytes], prompts: list[str],
                metadata: list[dict[str, Any]]) -> dict[str, Any]:
        return {"images": jpegs}

    def scored(self, metadata: list[dict[str, Any]]) -> list[int]:
        """Indices of the samples this server can score (the rest are NaN)."""
        return list(range(len(metadata)))

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        values = np.full(len(prompts), math.nan)
        keep = self.scored(metadata)
        for start in range(0, len(keep), self.batch_size):
            rows = keep[start:start + self.batch_size]
            jpegs = encode_jpeg(images[rows], self.jpeg_quality)
            reply = self.post(self.payload(jpegs, [prompts[i] for i in rows],
                                           [metadata[i] for i in rows]))
            values[rows] = _numbers(reply, self.reply_key, len(rows),
                                    f"{type(self).__name__} {self.endpoint}")
        return {self.components[0]: torch.from_numpy(values)}  # fp64: the manager checks the range


class DeQAServerScorer(FlowGRPOServerScorer):
    """DeQA-Score (image quality, in [0, 1]) from the reference's DeQA server."""

    components: ClassVar[tuple[str, ...]] = ("deqa",)
    default_endpoint: ClassVar[str | None] = "http://127.0.0.1:18086"  # the reference's


class UnifiedRewardServerScorer(FlowGRPOServerScorer):
    """UnifiedReward from the reference's pickle server (an OpenAI-style server is
    ``vlm_judge``'s). No default endpoint: the reference's is a private address."""

    components: ClassVar[tuple[str, ...]] = ("unifiedreward",)

    def payload(self, jpegs, prompts, metadata):
        return {"images": jpegs, "prompts": list(prompts)}


class GenEvalServerScorer(FlowGRPOServerScorer):
    """GenEval from the reference's server (Mask2Former from mmdetection, and CLIP for colour).

    ``reward``: ``"score"`` (default: the fraction of requirements met, what the reference
    trains on) or ``"strict"`` (1 when every requirement is met). A sample whose metadata has
    no ``tag`` and ``include`` (GenEval's ``metadata.jsonl`` fields) is not sent and scores
    NaN. The server reads each metadata's ``prompt``; it is filled in from the prompt when the
    record's metadata lacks it.
    """

    components: ClassVar[tuple[str, ...]] = ("geneval",)
    default_endpoint: ClassVar[str | None] = "http://127.0.0.1:18085"  # the reference's

    def __init__(self, *, reward: str = "score", endpoint: str | None = None,
                 timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 1.0,
                 batch_size: int = 64, jpeg_quality: int = 75,
                 max_reply_bytes: int = bounded_http.DEFAULT_MAX_REPLY_BYTES,
                 device: str | torch.device | None = None) -> None:
        if reward not in GENEVAL_REWARDS:
            raise ValueError(f"GenEvalServerScorer: reward={reward!r}: choose one of "
                             f"{list(GENEVAL_REWARDS)}")
        super().__init__(endpoint=endpoint, timeout_s=timeout_s, max_retries=max_retries,
                         backoff_s=backoff_s, batch_size=batch_size, jpeg_quality=jpeg_quality,
                         max_reply_bytes=max_reply_bytes, device=device)
        self.reply_key = GENEVAL_REWARDS[reward]

    @classmethod
    def check_options(cls, reward: str = "score", **kwargs: Any) -> list[str]:
        problems = super().check_options(**kwargs)
        if reward not in GENEVAL_REWARDS:
            problems.append(f"reward={reward!r}: choose one of {list(GENEVAL_REWARDS)}")
        return problems

    def scored(self, metadata):
        return [i for i, m in enumerate(metadata) if m.get("tag") and m.get("include")]

    def payload(self, jpegs, prompts, metadata):
        metas = [{**m, "prompt": m.get("prompt", p)} for m, p in zip(metadata, prompts)]
        return {"images": jpegs, "meta_datas": metas, "only_strict": True}
