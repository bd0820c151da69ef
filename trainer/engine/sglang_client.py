"""``SGLangEngineClient``: the ``EngineClient`` calls over HTTP, in SGLang's diffusion schema.

It talks to the embedded engine's HTTP mode (what the tests exercise) and to a user-started
SGLang diffusion server. Limits against a real SGLang server, stated plainly (see also
trainer/engine/README.md):

- Rollout: upstream ``POST /rollout/generate`` takes one prompt per request and answers a list
  of per-output responses; this client sends one request per prompt group in that form
  (``batch_prompts=False``, chosen automatically unless the server identifies itself as the
  embedded engine) and merges the outputs. A full ``dit_trajectory`` chain ([N+1, ...]) is
  sliced into the (x_i, x_{i+1}) pairs at the SDE steps. Upstream SGLang does not know the
  driver's x_T/noise recipe (``sample_ids``, ``noise_recipe``) nor, without a patch, driver
  sigmas; its log-probs come from its own sampler, not ``kernels.sde_step``, so the first PPO
  ratio is not exactly 1 and reproducibility per sample id does not hold. The adapter's
  ``validate_rollout_response`` still checks every answer (shapes, echoed geometry, sigmas as
  sent), so a server that ignores driver sigmas fails loudly instead of training on them.
- Weights: upstream SGLang diffusion offers ``POST /update_weights_from_disk`` (a reload from a
  directory: a checkpoint write and read per step) — exposed as ``update_weights_from_disk``.
  The in-memory paths (``/update_weights_from_tensor`` over CUDA IPC, ``/set_lora_from_tensor``)
  exist only in patched SGLang builds, and our ``ipc/`` transport does not speak them: the
  per-step in-memory sync (full / adapter / merge) is an embedded-engine feature.
- ``checksum()`` returns the server's digest; only the embedded engine's equals
  ``ipc.weights_checksum``. ``version`` is the server's ``/get_weight_version``.
- ``release()`` / ``resume()`` call ``/release_memory_occupation`` / ``/resume_memory_occupation``
  (present in SGLang builds with memory saving); any failure raises (fatal, per spec).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import torch

from trainer.engine.client import EngineError
from trainer.engine.core import EngineStateError
from trainer.engine.wire import from_wire
from trainer.models.schema import ROLLOUT_PATH


class EngineRequestError(ValueError):
    """The server rejected a request (HTTP 4xx); ``problems`` lists what it said."""

    def __init__(self, status: int, message: str, problems: list[str]) -> None:
        self.status, self.problems = status, problems
        super().__init__(f"HTTP {status}: {message}" + (
            "" if problems == [message] else "\n  - " + "\n  - ".join(problems)))


def _groups(request: dict[str, Any]) -> list[list[int]]:
    """Candidate positions per prompt group (extra.group_index, else runs of equal prompts)."""
    prompts = request["prompt"]
    group = (request.get("extra_sampling_params") or {}).get("group_index")
    keys = group if isinstance(group, list) and len(group) == len(prompts) else prompts
    out: dict[Any, list[int]] = {}
    for pos, key in enumerate(keys):
        out.setdefault((key, prompts[pos]), []).append(pos)
    return list(out.values())


def _pairs(latents: torch.Tensor, sde_indices: list[int]) -> torch.Tensor:
    """[S, 2, *latent] from either pairs already or SGLang's full [N+1, *latent] chain."""
    n_sde = len(sde_indices)
    if latents.dim() >= 2 and latents.shape[0] == n_sde and latents.shape[1] == 2:
        return latents
    idx = torch.tensor(sde_indices, dtype=torch.long)
    return torch.stack([latents[idx], latents[idx + 1]], dim=1)


def _per_sde_step(log_probs: torch.Tensor, sde_indices: list[int]) -> torch.Tensor:
    """[S] log-probs from either [S] or SGLang's per-step [N] (values at the SDE steps)."""
    flat = log_probs.reshape(-1)
    if flat.numel() == len(sde_indices):
        return flat
    if sde_indices and flat.numel() > max(sde_indices):
        return flat[torch.tensor(sde_indices, dtype=torch.long)]
    raise EngineError(f"rollout_log_probs has {flat.numel()} values for SDE steps {sde_indices}")


def _flat_env(env: Any) -> dict[str, torch.Tensor]:
    """Conditions by leaf name (SGLang nests them, e.g. ``pos_cond_kwargs.prompt_embeds``)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(env, dict):
        for key, value in env.items():
            if isinstance(value, torch.Tensor):
                out[key] = value
            elif isinstance(value, dict):
                out.update(_flat_env(value))
    return out


def merge_outputs(entries: list[dict[str, Any]], request: dict[str, Any]) -> dict[str, Any]:
    """SGLang's per-output responses (tensors decoded) -> one batched response (schema.py)."""
    if not entries:
        raise EngineError("the server answered an empty list of outputs")
    first = entries[0]
    indices = [int(i) for i in first.get("sde_indices", request.get("rollout_sde_step_indices") or [])]
    extra = request.get("extra_sampling_params") or {}
    ids = [e.get("sample_id") for e in entries]
    out: dict[str, Any] = {
        "request_id": first.get("request_id"),
        "prompt": [e.get("prompt") for e in entries],
        "seed": first.get("seed"),
        "sample_ids": ids if all(isinstance(i, str) for i in ids) else list(extra.get("sample_ids") or []),
        "height": first.get("height", request.get("height")),
        "width": first.get("width", request.get("width")),
        "sde_indices": indices,
    }
    logps = [e.get("rollout_log_probs") for e in entries]
    logps = [lp.get("log_probs") if isinstance(lp, dict) else lp for lp in logps]
    if all(isinstance(lp, torch.Tensor) for lp in logps):
        out["rollout_log_probs"] = torch.stack([_per_sde_step(lp, indices) for lp in logps])
    images = [e.get("generated_output") for e in entries]
    if all(isinstance(i, torch.Tensor) for i in images):
        out["images"] = torch.stack(images)
    if all(isinstance(e.get("dit_trajectory"), dict) for e in entries):
        trajs = [e["dit_trajectory"] for e in entries]
        traj: dict[str, Any] = {"latents": torch.stack([_pairs(t["latents"], indices) for t in trajs])}
        for key in ("timesteps", "sigmas"):
            if key in trajs[0]:
                traj[key] = trajs[0][key]
        out["dit_trajectory"] = traj
    envs = [_flat_env(e.get("denoising_env")) for e in entries]
    if envs[0]:
        out["denoising_env"] = {k: torch.stack([env[k] for env in envs]) for k in envs[0]
                                if all(k in env for env in envs)}
    if "policy_version" in first:
        out["policy_version"] = first["policy_version"]
    return out


class SGLangEngineClient:
    """``EngineClient``'s calls against ``base_url`` (e.g. ``http://127.0.0.1:30000``).

    ``batch_prompts``: send the batched request (prompt list) in one POST; None decides on first
    use: True when ``/health`` says the server is the embedded engine, False otherwise (one
    request per prompt group, SGLang's single-prompt form). ``timeout_s`` bounds each call.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 600.0,
                 batch_prompts: bool | None = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.batch_prompts = batch_prompts
        self.http_url = self.base_url

    # ---- transport ---------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode("utf-8")
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                payload = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                payload = {"error": raw.decode("utf-8", "replace")[:2000]}
            message = str(payload.get("error") or payload.get("detail") or payload)
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
        return from_wire(json.loads(raw))

    # ---- EngineClient calls ----------------------------------------------------------------
    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.batch_prompts is None:
            health = self.health()
            self.batch_prompts = health.get("engine") == "flowgrpo-embedded"
        prompt = request.get("prompt")
        if self.batch_prompts or not isinstance(prompt, list):
            reply = self._call("POST", ROLLOUT_PATH, request)
            return merge_outputs(reply, request) if isinstance(reply, list) else reply
        entries: list[dict[str, Any]] = [None] * len(prompt)  # type: ignore[list-item]
        extra = request.get("extra_sampling_params") or {}
        for positions in _groups(request):
            sub_extra = dict(extra)
            for key in ("sample_ids", "group_index"):
                if isinstance(extra.get(key), list):
                    sub_extra[key] = [extra[key][p] for p in positions]
            sub = dict(request, prompt=prompt[positions[0]], num_outputs_per_prompt=len(positions),
                       extra_sampling_params=sub_extra)
            reply = self._call("POST", ROLLOUT_PATH, sub)
            outputs = reply if isinstance(reply, list) else [reply]
            if len(outputs) != len(positions):
                raise EngineError(f"the server answered {len(outputs)} outputs for a group of "
                                  f"{len(positions)} candidates")
            for pos, entry in zip(positions, outputs):
                entries[pos] = entry
        return merge_outputs(entries, request)

    def checksum(self) -> str:
        reply = self._call("POST", "/get_weights_checksum", {})
        if isinstance(reply, dict) and isinstance(reply.get("checksum"), str):
            return reply["checksum"]
        return json.dumps(reply, sort_keys=True)  # a server's own digest layout, e.g. per module

    @property
    def version(self) -> int:
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
