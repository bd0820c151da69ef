"""The remote runtime: score over HTTP (stdlib only); ``trainer.rewards.serve`` is the server side.

Wire schema, version ``flowgrpo.reward.v1`` (UTF-8 JSON both ways, one URL):

``GET <endpoint>`` -> 200 ``{"schema": "flowgrpo.reward.v1", "components": [str, ...],
"required_tracks": ["image"], "media": ["image", "video"]}``: what the server produces (asked
once, when the client is built without a component list) and, from a server that takes
videos, ``media``.

``POST <endpoint>`` with ``{"schema": "flowgrpo.reward.v1", "components": [str, ...],
"prompts": [str] * B, "metadata": [object] * B, "images": [str] * B}`` where each image is a
base64-encoded PNG (8-bit RGB) -> 200 ``{"rewards": {component: [number | null] * B}}``.
``null`` marks a sample the server could not score (it becomes NaN, which fails the sample's
group if the component is required). The reply must hold exactly the components the request
listed. A non-2xx reply carries a plain-text or JSON body with the reason.

Video (same schema, an optional key): a batch of videos (uint8 [B, F, H, W, 3], F > 1) is
sent as ``"videos": [{"shape": [F, H, W, 3], "frames": [str] * F}] * B`` in place of
``"images"``, each frame a base64 PNG as above, each video tagged with its shape so the
server checks what it decoded against what was sent (a frame lost or resized is a 400, not
a silently shorter video). A one-frame video goes as an image: an image-only server keeps
working for every image batch. The server scores a video with a scorer that reads videos
as it is, and with an image scorer frame by frame under its own ``--frame-aggregation``
(``trainer.rewards.serve``, ``trainer.rewards.video``); an older server answers a video
request with a 400 naming the missing ``images``. A video request is bound by the same
deadline and reply cap as any other; it carries every frame (the server's rule decides which
it scores), so its size grows with B * F.

Client policy: every attempt has a deadline on the whole exchange (``timeout_s``: connect,
send, and the whole reply, so a server that trickles bytes cannot hold it) and a reply size cap
(``max_reply_bytes``, 16 MiB): ``trainer.rewards.bounded_http``. Missed deadlines, refused or
reset connections, 5xx and 429 are retried up to ``max_retries`` times with exponential backoff
(``backoff_s * 2**attempt``, at most 30 s), so one ``score`` call waits at most
``(max_retries + 1) * timeout_s`` plus the backoffs; a 4xx, an oversized or malformed reply,
missing or unexpected components and wrong lengths are the server's or the configuration's
bug and fail at once.
Either way the error is a RemoteRewardError naming the endpoint and every attempt's failure.
"""
from __future__ import annotations

import base64
import http.client
import io
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from trainer.rewards import bounded_http
from trainer.rewards.base import RewardError, RewardScorer, check_score_inputs

SCHEMA = "flowgrpo.reward.v1"
_RETRY_STATUS = {429}
_MAX_BACKOFF_S = 30.0


class RemoteRewardError(RewardError):
    """The remote scorer failed or replied something unusable."""


def encode_png_base64(images: torch.Tensor, *, compress_level: int = 1) -> list[str]:
    """uint8 [B, H, W, 3] -> base64 PNG strings. Level 1: lossless either way, and the
    fastest zlib level (the payload is on a local network; encode time is on the step)."""
    arrays = images.detach().to("cpu").numpy()

    def one(array) -> str:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="PNG", compress_level=compress_level)
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(arrays)))) as pool:
        return list(pool.map(one, arrays))


def encode_videos(videos: torch.Tensor, *, compress_level: int = 1) -> list[dict[str, Any]]:
    """uint8 [B, F, H, W, 3] -> the request's shape-tagged ``videos`` list."""
    batch, count = videos.shape[:2]
    frames = encode_png_base64(videos.reshape(batch * count, *videos.shape[2:]),
                               compress_level=compress_level)
    shape = [int(d) for d in videos.shape[1:]]
    return [{"shape": shape, "frames": frames[i * count:(i + 1) * count]}
            for i in range(batch)]


def decode_videos(payloads: Sequence[Any]) -> torch.Tensor:
    """The request's ``videos`` list -> uint8 [B, F, H, W, 3]; ValueError naming every video
    whose tag, frame count or frame size disagrees with what it holds."""
    problems: list[str] = []
    videos = []
    for i, item in enumerate(payloads):
        shape = item.get("shape") if isinstance(item, dict) else None
        frames = item.get("frames") if isinstance(item, dict) else None
        if not (isinstance(shape, list) and len(shape) == 4 and shape[3] == 3 and
                all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
            problems.append(f"videos[{i}]: 'shape' must be [F, H, W, 3], got {shape!r}")
            continue
        if not isinstance(frames, list) or len(frames) != shape[0]:
            got = len(frames) if isinstance(frames, list) else type(frames).__name__
            problems.append(f"videos[{i}]: shape says {shape[0]} frames, 'frames' holds {got}")
            continue
        try:
            video = decode_png_base64(frames)
        except ValueError as exc:
            problems.append(f"videos[{i}]: {exc}")
            continue
        if list(video.shape) != shape:
            problems.append(f"videos[{i}]: frames decode to {list(video.shape)}, shape says "
                            f"{shape}")
            continue
        videos.append(video)
    shapes = sorted({tuple(v.shape) for v in videos})
    if len(shapes) > 1:
        problems.append(f"videos of different shapes in one request: {shapes}")
    if problems:
        raise ValueError("; ".join(problems))
    if not videos:
        return torch.empty(0, 1, 0, 0, 3, dtype=torch.uint8)
    return torch.stack(videos)


def decode_png_base64(payloads: Sequence[str]) -> torch.Tensor:
    """base64 PNG strings (one size) -> uint8 [B, H, W, 3]."""
    arrays = [np.asarray(Image.open(io.BytesIO(base64.b64decode(p, validate=True))).convert("RGB"))
              for p in payloads]
    shapes = sorted({a.shape for a in arrays})
    if len(shapes) > 1:
        raise ValueError(f"images of different sizes in one request: {shapes}")
    if not arrays:
        return torch.empty(0, 0, 0, 3, dtype=torch.uint8)
    return torch.from_numpy(np.stack(arrays))


class RemoteScorer(RewardScorer):
    """Client for an HTTP reward endpoint speaking ``flowgrpo.reward.v1`` (videos included:
    it sends a video batch whole, and the server scores it).

    Args:
        endpoint: the URL (http or https).
        components: what the server produces; None asks the server once (GET) at construction.
        timeout_s: deadline of each attempt, the whole exchange (connect, send, whole reply).
        max_reply_bytes: a larger reply fails the request at once (not retried).
        max_retries: retries after the first attempt for retryable failures.
        backoff_s: first backoff; doubles per retry.
    """

    takes_video = True  # a video goes to the server whole (the module docstring)

    def __init__(self, endpoint: str, *, components: Sequence[str] | None = None,
                 timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5,
                 png_compress_level: int = 1,
                 max_reply_bytes: int = bounded_http.DEFAULT_MAX_REPLY_BYTES) -> None:
        problems = []
        if not endpoint.startswith(("http://", "https://")):
            problems.append(f"endpoint {endpoint!r} is not an http(s) URL")
        if not timeout_s > 0:
            problems.append(f"timeout_s={timeout_s} must be > 0")
        if max_retries < 0:
            problems.append(f"max_retries={max_retries} must be >= 0")
        if backoff_s < 0:
            problems.append(f"backoff_s={backoff_s} must be >= 0")
        if not max_reply_bytes > 0:
            problems.append(f"max_reply_bytes={max_reply_bytes} must be > 0")
        if problems:
            raise ValueError("remote reward: " + "; ".join(problems))
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.png_compress_level = int(png_compress_level)
        self.max_reply_bytes = int(max_reply_bytes)
        if components is None:
            info = self._request(None)
            components = info.get("components") if isinstance(info, dict) else None
            if not isinstance(components, list) or not components or \
                    not all(isinstance(c, str) for c in components):
                raise RemoteRewardError(f"{endpoint}: GET reply has no list of component "
                                        f"names: {str(info)[:200]}")
        self.components = tuple(components)

    def _request(self, body: bytes | None) -> Any:
        """GET (body None) or POST JSON with retries; returns the parsed JSON reply."""
        failures: list[str] = []
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            try:
                reply = bounded_http.request(
                    self.endpoint, body=body, deadline_s=self.timeout_s,
                    max_reply_bytes=self.max_reply_bytes,
                    headers={"Content-Type": "application/json", "Accept": "application/json"})
            except bounded_http.ReplyTooLarge as exc:
                failures.append(f"attempt {attempt + 1}: {exc} (max_reply_bytes)")
                break
            except bounded_http.DeadlineExceeded as exc:
                failures.append(f"attempt {attempt + 1}: timed out: {exc} (timeout_s)")
                continue
            except (OSError, http.client.HTTPException) as exc:
                failures.append(f"attempt {attempt + 1}: {type(exc).__name__}: {exc}")
                continue
            if reply.status >= 300:
                detail = reply.body[:500].decode("utf-8", "replace").strip()
                failures.append(f"attempt {attempt + 1}: HTTP {reply.status} {detail}")
                if reply.status >= 500 or reply.status in _RETRY_STATUS:
                    continue
                break
            try:
                return json.loads(reply.body)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                failures.append(f"attempt {attempt + 1}: malformed JSON reply ({exc}): "
                                f"{reply.body[:200]!r}")
                break
        raise RemoteRewardError(f"remote reward {self.endpoint} failed after {len(failures)} "
                                f"attempt(s): " + " | ".join(failures))

    def score(self, images: torch.Tensor, prompts: list[str],
              metadata: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = check_score_inputs(images, prompts, metadata, video=True)
        if images.dim() == 5 and images.shape[1] == 1:
            images = images[:, 0]  # a one-frame video is an image, on the wire too
        media = {"videos": encode_videos(images, compress_level=self.png_compress_level)} \
            if images.dim() == 5 else \
            {"images": encode_png_base64(images, compress_level=self.png_compress_level)}
        try:
            body = json.dumps({"schema": SCHEMA, "components": list(self.components),
                               "prompts": list(prompts), "metadata": list(metadata), **media},
                              allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"remote reward: metadata is not JSON-serialisable ({exc})") from exc
        reply = self._request(body)
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(rewards, dict):
            raise RemoteRewardError(f"{self.endpoint}: reply has no 'rewards' object: "
                                    f"{str(reply)[:200]}")
        problems = []
        missing = [c for c in self.components if c not in rewards]
        extra = sorted(set(rewards) - set(self.components))
        if missing:
            problems.append(f"missing components {missing}")
        if extra:
            problems.append(f"unexpected components {extra}")
        out = {}
        for name in self.components:
            values = rewards.get(name)
            if values is None:
                continue
            if not isinstance(values, list) or len(values) != batch:
                got = len(values) if isinstance(values, list) else type(values).__name__
                problems.append(f"{name!r}: expected a list of {batch} values, got {got}")
                continue
            bad = [i for i, v in enumerate(values)
                   if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
            if bad:
                problems.append(f"{name!r}: non-numeric values at {bad[:5]}")
                continue
            # fp64: the manager refuses a value beyond fp32's range instead of an inf
            out[name] = torch.tensor([math.nan if v is None else float(v) for v in values],
                                     dtype=torch.float64)
        if problems:
            raise RemoteRewardError(f"{self.endpoint}: bad reply: " + "; ".join(problems))
        return out
