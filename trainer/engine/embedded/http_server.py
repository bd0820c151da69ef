"""The embedded engine's HTTP mode: SGLang's diffusion rollout endpoints, on loopback.

Endpoints (JSON in and out, tensors encoded by ``trainer.models.wire.codec``):

    POST /rollout/generate              batched request (prompt list) -> one batched response
                                        SGLang form (prompt string)   -> list of per-output responses
    GET  /health                        engine status (200 while the process serves)
    GET  /health_generate               200 when generate would be served now, else 503
    GET  /get_weight_version            {"weight_version": int}
    POST /get_weights_checksum          {"checksum": str, "weight_version": int} (GET accepted)
    POST /release_memory_occupation     {"success": true, ...}
    POST /resume_memory_occupation      {"success": true, ...}
    POST /update_weights_from_disk      {"model_path": str} -> {"success": true, "message": ...}

Errors: 400 for a malformed request, with ``{"error": message, "problems": [every problem]}``;
404 unknown path; 405 wrong method; 409 when the engine cannot serve in its state (released,
weights dirty after a failed sync); 411 without Content-Length; 500 for an engine failure.

The server is the standard library's threading HTTP server: requests are rare and large
(one per wave), so an async framework would buy nothing, and the engine core serialises
operations itself. It binds 127.0.0.1 only: the engine is a colocated peer, not a service.
"""
from __future__ import annotations

import json
import threading
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from trainer.engine.embedded.core import EngineCore, EngineStateError
from trainer.engine.embedded.request import RequestError
from trainer.models.wire import ROLLOUT_PATH, to_wire

MAX_BODY_BYTES = 64 << 20


class HTTPError(Exception):
    def __init__(self, status: int, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.problems = status, message, problems or [message]


def split_outputs(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A batched response as SGLang's list of per-output responses (tensors lose the batch dim)."""
    entries = []
    traj = response.get("dit_trajectory")
    env = response.get("denoising_env")
    for b, sample_id in enumerate(response["sample_ids"]):
        entry: dict[str, Any] = {
            "request_id": f"{response['request_id']}-{b}",
            "prompt": response["prompt"][b],
            "seed": response["seed"],
            "sample_id": sample_id,
            "generated_output": response["images"][b],
            "rollout_log_probs": {"log_probs": response["rollout_log_probs"][b]},
            "sde_indices": response["sde_indices"],
            "height": response["height"],
            "width": response["width"],
            "policy_version": response["policy_version"],
            "inference_time_s": response["inference_time_s"],
        }
        if traj is not None:
            entry["dit_trajectory"] = {"latents": traj["latents"][b], "timesteps": traj["timesteps"],
                                       "sigmas": traj["sigmas"]}
        if env is not None:
            entry["denoising_env"] = {k: v[b] for k, v in env.items()}
        entries.append(entry)
    return entries


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, (RequestError, ValueError)):
        return HTTPStatus.BAD_REQUEST
    if isinstance(exc, EngineStateError) or type(exc).__name__ == "WeightSyncError":
        return HTTPStatus.CONFLICT
    return HTTPStatus.INTERNAL_SERVER_ERROR


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: the trainer logs what matters
        pass

    # ---- plumbing ------------------------------------------------------------------------
    def _send(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode("utf-8")
        if status >= 400:
            self.close_connection = True  # an unread request body must not leak into the next
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            self.send_header("Allow", ", ".join(self.server.allowed(self.path)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None:
            raise HTTPError(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        try:
            size = int(length)
        except ValueError as exc:
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length!r}") from exc
        if size > MAX_BODY_BYTES:
            raise HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {size} bytes exceeds "
                            f"{MAX_BODY_BYTES}")
        raw = self.rfile.read(size) if size else b""
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {exc}") from exc

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        route = self.server.routes.get(path)
        try:
            if route is None:
                raise HTTPError(HTTPStatus.NOT_FOUND, f"no endpoint {path}")
            handler = route.get(method)
            if handler is None:
                raise HTTPError(HTTPStatus.METHOD_NOT_ALLOWED, f"{method} not allowed on {path}")
            body = self._body() if method == "POST" else None
            status, payload = handler(body)
        except HTTPError as exc:
            if method == "POST" and exc.status in (HTTPStatus.NOT_FOUND, HTTPStatus.METHOD_NOT_ALLOWED):
                self._drain()
            status, payload = exc.status, {"error": exc.message, "problems": exc.problems}
        except Exception as exc:  # the engine's own error, reported to the client
            status = _status_of(exc)
            problems = getattr(exc, "problems", None) or [str(exc)]
            payload = {"error": str(exc), "problems": problems}
            if status == HTTPStatus.INTERNAL_SERVER_ERROR:
                payload["traceback"] = traceback.format_exc()
        self._send(status, payload)

    def _drain(self) -> None:
        try:
            size = int(self.headers.get("Content-Length") or 0)
            if 0 < size <= MAX_BODY_BYTES:
                self.rfile.read(size)
        except ValueError:
            pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    routes: dict[str, dict[str, Callable[[Any], tuple[int, Any]]]]

    def allowed(self, path: str) -> list[str]:
        return sorted(self.routes.get(path.split("?", 1)[0], {}))


class EngineHTTPServer:
    """Serves one ``EngineCore`` on ``127.0.0.1:port`` from a daemon thread."""

    def __init__(self, core: EngineCore, port: int = 0) -> None:
        self.core = core
        self._server = _Server(("127.0.0.1", int(port)), _Handler)
        self._server.routes = self._routes()
        self._thread = threading.Thread(target=self._server.serve_forever, name="engine-http",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    # ---- endpoints -------------------------------------------------------------------------
    def _routes(self) -> dict[str, dict[str, Callable[[Any], tuple[int, Any]]]]:
        checksum = self._checksum
        return {
            ROLLOUT_PATH: {"POST": self._generate},
            "/health": {"GET": lambda _: (HTTPStatus.OK, self.core.health())},
            "/health_generate": {"GET": self._health_generate},
            "/get_weight_version": {"GET": lambda _: (HTTPStatus.OK,
                                                      {"weight_version": self.core.get_version()})},
            "/get_weights_checksum": {"GET": checksum, "POST": checksum},
            "/release_memory_occupation": {"POST": lambda _: (HTTPStatus.OK, self.core.release())},
            "/resume_memory_occupation": {"POST": lambda _: (HTTPStatus.OK, self.core.resume())},
            "/update_weights_from_disk": {"POST": self._update_from_disk},
        }

    def _generate(self, body: Any) -> tuple[int, Any]:
        response = self.core.generate(body)
        if isinstance(body, dict) and isinstance(body.get("prompt"), str):
            return HTTPStatus.OK, to_wire(split_outputs(response))
        return HTTPStatus.OK, to_wire(response)

    def _health_generate(self, _: Any) -> tuple[int, Any]:
        health = self.core.health()
        ok = health["status"] == "ok"
        return (HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE), health

    def _checksum(self, _: Any) -> tuple[int, Any]:
        return HTTPStatus.OK, {"checksum": self.core.checksum(),
                               "weight_version": self.core.get_version()}

    def _update_from_disk(self, body: Any) -> tuple[int, Any]:
        problems = []
        if not isinstance(body, dict):
            raise HTTPError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            problems.append("model_path must be a non-empty string")
        targets = body.get("target_modules")
        if targets is not None and targets != ["transformer"]:
            problems.append(f"target_modules may only be ['transformer'] (the trained module), "
                            f"got {targets!r}")
        if problems:
            raise HTTPError(HTTPStatus.BAD_REQUEST, "invalid update_weights_from_disk request", problems)
        return HTTPStatus.OK, self.core.update_weights_from_disk(path)


def start_http_server(core: EngineCore, *, port: int = 0) -> EngineHTTPServer:
    return EngineHTTPServer(core, port)

