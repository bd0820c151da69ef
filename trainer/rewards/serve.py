"""A reference server for any scorer over ``flowgrpo.reward.v1`` (``trainer.rewards.remote``
documents the wire schema; ``RemoteScorer`` is its client).

``python -m trainer.rewards.serve --scorer-path X [--model-path Y] --port N``
``[--frame-aggregation mean|min|sampled [--frames K]]``: how an image scorer scores the videos
it is sent (``trainer.rewards.video``; a scorer that reads videos gets them whole).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from trainer.rewards.base import RewardScorer, check_score_inputs
from trainer.rewards.manager import build_reward_manager
from trainer.rewards.remote import SCHEMA, decode_png_base64, decode_videos
from trainer.rewards.spec import FRAME_AGGREGATIONS
from trainer.rewards.video import DEFAULT_RULE, FrameRule, score_batch


class RewardServer(ThreadingHTTPServer):
    """Serves a local scorer over ``flowgrpo.reward.v1`` (one scoring call at a time).

    ``RewardServer(scorer, ("127.0.0.1", 0))``; ``.url`` is the endpoint once bound;
    ``start()`` serves from a daemon thread, ``close()`` stops and joins it. ``frame_rule``:
    how an image scorer scores a video request (default: the mean over every frame).
    """

    daemon_threads = True

    def __init__(self, scorer: RewardScorer, address: tuple[str, int] = ("127.0.0.1", 0), *,
                 frame_rule: FrameRule = DEFAULT_RULE) -> None:
        super().__init__(address, _RewardHandler)
        self.scorer = scorer
        self.frame_rule = frame_rule
        self.lock = threading.Lock()  # a scorer's model is not re-entrant
        self._thread: threading.Thread | None = None

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # the client gave up (its timeout) before the reply was written
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"

    def start(self) -> "RewardServer":
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)


class _RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer

    def log_message(self, format: str, *args: Any) -> None:  # keep test and job logs quiet
        pass

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, allow_nan=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        scorer = self.server.scorer
        self._reply(200, {"schema": SCHEMA, "components": list(scorer.components),
                          "required_tracks": list(scorer.required_tracks),
                          "media": ["image", "video"]})

    def do_POST(self) -> None:  # noqa: N802
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if request.get("schema") != SCHEMA:
                raise ValueError(f"schema {request.get('schema')!r} is not {SCHEMA!r}")
            video = "videos" in request
            images = decode_videos(request["videos"]) if video else \
                decode_png_base64(request["images"])
            prompts, metadata = list(request["prompts"]), list(request["metadata"])
            check_score_inputs(images, prompts, metadata, video=video)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self._reply(400, {"error": f"bad request: {exc}"})
            return
        try:
            with self.server.lock:
                if video:
                    scores = score_batch(self.server.scorer, images, prompts, metadata, None,
                                         self.server.frame_rule)
                else:
                    scores = self.server.scorer.score(images, prompts, metadata)
        except Exception as exc:  # the client sees the reason; the server keeps serving
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        rewards = {name: [float(v) if math.isfinite(v) else None
                          for v in torch.as_tensor(values, dtype=torch.float64).cpu().tolist()]
                   for name, values in scores.items()}
        self._reply(200, {"rewards": rewards})


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.rewards.serve --scorer-path X [--model-path Y] --port N``."""
    parser = argparse.ArgumentParser(description="Serve a reward scorer over HTTP "
                                     f"({SCHEMA}; see trainer/rewards/remote.py)")
    parser.add_argument("--scorer-path", required=True)
    parser.add_argument("--model-path")
    parser.add_argument("--device", help="e.g. cuda:0 (default: cpu)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--frame-aggregation", choices=FRAME_AGGREGATIONS,
                        default=DEFAULT_RULE.aggregation,
                        help="how an image scorer scores a video: per frame, then this")
    parser.add_argument("--frames", type=int,
                        help="frames scored per video with --frame-aggregation sampled")
    args = parser.parse_args(argv)
    try:
        rule = FrameRule(args.frame_aggregation, args.frames)
    except ValueError as exc:
        parser.error(str(exc))
    device = torch.device(args.device or "cpu")
    manager = build_reward_manager(scorer_path=args.scorer_path, model_path=args.model_path,
                                   runtime="colocate" if device.type == "cuda" else "cpu",
                                   device=device)
    server = RewardServer(manager.scorers[0], (args.host, args.port), frame_rule=rule)
    print(f"serving {args.scorer_path} {list(manager.components)} at {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
