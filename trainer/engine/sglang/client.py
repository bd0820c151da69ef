"""``SGLangEngineClient``: the ``EngineClient`` calls over HTTP, against SGLang's diffusion server.

Two servers answer ``POST /rollout/generate``:

- a stock SGLang diffusion server (``sglang==0.5.23``, the pinned and CI-tested version): the
  client sends one request per candidate (seed derived from its sample id), ``concurrency`` of
  them in flight, decodes SGLang's msgpack answers and maps them onto our schema
  (``trainer/engine/sglang/rollout.py``). Weights reach it through
  ``trainer/engine/sglang/sync.py`` (``/update_weights_from_tensor`` + checker); the version
  the trainer last committed there is echoed as the response's ``policy_version``, so the
  driver's stale-weights check holds.
- the embedded engine's HTTP mode (identifies itself on ``/health``): one batched JSON request.

``release()`` / ``resume()`` call ``/release_memory_occupation`` / ``/resume_memory_occupation``;
any failure raises (fatal). ``checksum()`` is the server's own digest of the transformer only
(``/get_weights_checksum`` hashes every module it is asked for; the text encoder and VAE never
change, and hashing them costs more than the DiT).
"""
from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainer.engine.embedded.client import EngineError
from trainer.engine.embedded.core import EngineStateError
from trainer.engine.sglang.rollout import (decode_tensors, to_schema_response, to_sglang_requests,
                                           write_condition_images)
from trainer.models.wire import ROLLOUT_PATH, from_wire


class EngineRequestError(ValueError):
    """The server rejected a request (HTTP 4xx); ``problems`` lists what it said."""

    def __init__(self, status: int, message: str, problems: list[str]) -> None:
        self.status, self.problems = status, problems
        super().__init__(f"HTTP {status}: {message}" + (
            "" if problems == [message] else "\n  - " + "\n  - ".join(problems)))


class SGLangEngineClient:
    """``EngineClient``'s calls against ``base_url`` (e.g. ``http://127.0.0.1:30000``).

    ``embedded``: the server is the embedded engine's HTTP mode (one batched JSON request);
    None decides on first use from ``/health``. ``concurrency``: SGLang requests (one per
    candidate) in flight at once. ``extension``: the server loads
    ``trainer.engine.sglang.extension`` (driver sigmas, x_T and step noise, ``dance``).
    ``timeout_s`` bounds each call. ``committed_version`` is the weight version the trainer's
    sync last verified on this server (None: never synced). ``media_root``: where a rollout's
    conditioning images are written for the server to read (a folder per call, removed when
    its answers are in; None: the system's temporary folder; the server must see the same
    filesystem, as a colocated one does).
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, embedded: bool | None = None,
                 concurrency: int = 8, extension: bool = False,
                 media_root: str | None = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.embedded = embedded
        self.concurrency = concurrency
        self.extension = extension
        self.media_root = media_root
        self.http_url = self.base_url
        self.committed_version: int | None = None

    # ---- transport ---------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
                msgpack = "msgpack" in (resp.headers.get("Content-Type") or "")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                payload = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                payload = {"error": raw.decode("utf-8", "replace")[:2000]}
            message = str(payload.get("error") or payload.get("detail") or payload.get("message")
                          or payload)
            problems = payload.get("problems") or [message]
            if exc.code == 409:
                raise EngineStateError(f"{method} {path}: {message}") from None
            if 400 <= exc.code < 500:
                raise EngineRequestError(exc.code, message, list(problems)) from None
            raise EngineError(f"{method} {path} failed with HTTP {exc.code}: {message}\n"
                              f"{payload.get('traceback', '')}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise EngineError(f"{method} {self.base_url}{path}: {exc}") from exc
        if not raw:
            return None
        if msgpack:  # SGLang's rollout answer: tensors as tagged safetensors blobs
            import msgspec
            return decode_tensors(msgspec.msgpack.decode(raw))
        try:
            return from_wire(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise EngineError(f"{method} {path} answered neither JSON nor msgpack: "
                              f"{raw[:200]!r}") from None

    def _is_embedded(self) -> bool:
        if self.embedded is None:
            self.embedded = self.health().get("engine") == "flowgrpo-embedded"
        return self.embedded

    # ---- EngineClient calls ----------------------------------------------------------------
    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._is_embedded():
            return self._call("POST", ROLLOUT_PATH, request)
        # conditioning images go to SGLang as files it reads (its request takes paths): one
        # private folder per call, removed once every answer is in, whatever happened
        with tempfile.TemporaryDirectory(prefix="flowgrpo-sglang-media-",
                                         dir=self.media_root) as media_dir:
            image_paths = write_condition_images(request, media_dir)
            bodies = to_sglang_requests(request, extension=self.extension,
                                        image_paths=image_paths)
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(bodies))) as pool:
                answers = list(pool.map(lambda body: self._call("POST", ROLLOUT_PATH, body),
                                        bodies))
        response = to_schema_response(answers, bodies, request)
        if self.committed_version is not None:
            response["policy_version"] = self.committed_version
        return response

    def checksum(self) -> str:
        reply = self._call("POST", "/get_weights_checksum", {"module_names": ["transformer"]})
        if isinstance(reply, dict) and isinstance(reply.get("checksum"), str):
            return reply["checksum"]
        return json.dumps(reply, sort_keys=True)  # a server's own digest layout, e.g. per module

    @property
    def version(self) -> int:
        """The embedded engine's committed version; on SGLang (no such route) the version the
        trainer's sync last verified there (-1 before the first)."""
        if not self._is_embedded():
            return -1 if self.committed_version is None else self.committed_version
        reply = self._call("GET", "/get_weight_version")
        return int(reply["weight_version"] if isinstance(reply, dict) else reply)

    def _fatal(self, path: str) -> dict[str, Any]:
        reply = self._call("POST", path, {})
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(f"{path} failed: {reply.get('message')}")
        return reply if isinstance(reply, dict) else {"success": True}

    def release(self) -> dict[str, Any]:
        return self._fatal("/release_memory_occupation")

    def resume(self) -> dict[str, Any]:
        return self._fatal("/resume_memory_occupation")

    def health(self) -> dict[str, Any]:
        reply = self._call("GET", "/health")
        return reply if isinstance(reply, dict) else {"status": "ok"}

    def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        reply = self._call("POST", "/update_weights_from_disk",
                           {"model_path": str(model_path), "target_modules": ["transformer"]})
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(f"update_weights_from_disk failed: {reply.get('message')}")
        return reply

    def close(self) -> None:
        """Nothing to stop: the server belongs to whoever started it."""

    def __enter__(self) -> "SGLangEngineClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
