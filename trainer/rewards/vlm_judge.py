"""A VLM judge over an OpenAI-compatible chat endpoint: how UnifiedReward and Qwen-VL models
are served (vLLM, SGLang and most inference servers speak ``POST <endpoint>/chat/completions``).

One request per image: the image as a ``data:image/png;base64`` URL and the question (the
``question`` option, ``{prompt}`` replaced by the sample's prompt). For an edit (a sample with
source images) the one request holds every source image, then the result, each its own
``image_url`` part in that order, and the ``edit_question`` (``{prompt}`` is the instruction):
the judge sees what was asked to change and what should have stayed. The score is the first
match of ``score_pattern`` in the answer (its first group when it has one; default: the first
number; UnifiedReward-style answers want ``"Final Score:\\s*(-?\\d+(?:\\.\\d+)?)"``), mapped to
[0, 1] by ``(s - score_min) / (score_max - score_min)`` and clipped there; an answer without a
match scores NaN (that sample only). ``timeout_s`` bounds each request's whole exchange and a
reply is capped in size (``bounded_http``). Transport failures (connection, timeout, HTTP 5xx) are
retried ``max_retries`` times with a short backoff, then the whole batch fails with every cause
listed: a judge that cannot answer must not train the policy on zeros.

An API key, when the server wants one, is read from the environment variable named by
``api_key_env`` (never written in a config file).
"""
from __future__ import annotations

import http.client
import json
import math
import os
import re
import string
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from trainer.rewards import bounded_http
from trainer.rewards.base import RewardScorer
from trainer.rewards.remote import RemoteRewardError, encode_png_base64

DEFAULT_QUESTION = ('Rate how well this image matches the description "{prompt}" and how good '
                    'it looks, from {score_min} (poor) to {score_max} (excellent). Answer with '
                    'the number only.')
DEFAULT_EDIT_QUESTION = ('The first image is the source; the last image is the result of '
                         'editing it with the instruction "{prompt}". Rate how well the result '
                         'follows the instruction while keeping everything it did not ask to '
                         'change, from {score_min} (poor) to {score_max} (excellent). Answer '
                         'with the number only.')
NUMBER = r"-?\d+(?:\.\d+)?"


def parse_score(answer: str, score_min: float, score_max: float,
                pattern: str = NUMBER) -> float:
    m = re.search(pattern, answer or "")
    if m is None:
        return math.nan
    try:
        raw = float(m.group(1) if m.re.groups else m.group())
    except ValueError:
        return math.nan
    return min(1.0, max(0.0, (raw - score_min) / (score_max - score_min)))


class VLMJudgeScorer(RewardScorer):
    """Options: ``endpoint`` (e.g. ``http://host:8000/v1``), ``model``, ``question``,
    ``edit_question`` (asked when a sample has source images), ``score_min``/``score_max``,
    ``score_pattern``, ``max_tokens``, ``timeout_s``, ``max_retries``, ``concurrency``
    (requests in flight), ``api_key_env``."""

    components: ClassVar[tuple[str, ...]] = ("vlm_judge",)
    wants_sources: ClassVar[bool] = True

    def __init__(self, *, endpoint: str, model: str = "default",
                 question: str = DEFAULT_QUESTION, edit_question: str = DEFAULT_EDIT_QUESTION,
                 score_min: float = 1.0,
                 score_max: float = 5.0, score_pattern: str = NUMBER, max_tokens: int = 16,
                 timeout_s: float = 60.0,
                 max_retries: int = 2, concurrency: int = 4, api_key_env: str | None = None,
                 device: str | torch.device | None = None) -> None:
        problems = self.check_options(endpoint=endpoint, question=question,
                                      edit_question=edit_question, score_min=score_min,
                                      score_max=score_max, score_pattern=score_pattern,
                                      concurrency=concurrency, api_key_env=api_key_env)
        if problems:
            raise ValueError("; ".join(problems))
        self.url = endpoint.rstrip("/") + "/chat/completions"
        self.model, self.question, self.edit_question = model, question, edit_question
        self.score_min, self.score_max = float(score_min), float(score_max)
        self.score_pattern = score_pattern
        self.max_tokens, self.timeout_s = int(max_tokens), float(timeout_s)
        self.max_retries, self.concurrency = int(max_retries), int(concurrency)
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        self.device = device

    @classmethod
    def check_options(cls, endpoint: str = "", question: str = DEFAULT_QUESTION,
                      edit_question: str = DEFAULT_EDIT_QUESTION, score_min: float = 1.0,
                      score_max: float = 5.0, score_pattern: str = NUMBER, concurrency: int = 4,
                      api_key_env: str | None = None, **_: Any) -> list[str]:
        problems = []
        try:
            re.compile(score_pattern)
        except (re.error, TypeError) as exc:
            problems.append(f"score_pattern={score_pattern!r} is not a regular expression: {exc}")
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            problems.append(f"endpoint={endpoint!r} is not an http(s) URL")
        for name, text in (("question", question), ("edit_question", edit_question)):
            problems += _template_problems(name, text)
        if not float(score_max) > float(score_min):
            problems.append(f"score_max={score_max} must be above score_min={score_min}")
        if int(concurrency) < 1:
            problems.append(f"concurrency={concurrency} must be >= 1")
        if api_key_env and api_key_env not in os.environ:
            problems.append(f"api_key_env={api_key_env!r}: no such environment variable")
        return problems

    def _body(self, png_b64: str, prompt: str, source_pngs: tuple[str, ...] = ()) -> bytes:
        template = self.edit_question if source_pngs else self.question
        text = template.format(prompt=prompt, score_min=_fmt(self.score_min),
                               score_max=_fmt(self.score_max))
        parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
                 for png in (*source_pngs, png_b64)]
        return json.dumps({
            "model": self.model, "temperature": 0.0, "max_tokens": self.max_tokens,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        }).encode()

    def _ask(self, body: bytes) -> str:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        errors = []
        for attempt in range(self.max_retries + 1):
            try:  # a deadline on the whole exchange and a size cap (bounded_http)
                response = bounded_http.request(self.url, body=body, headers=headers,
                                                deadline_s=self.timeout_s)
                if response.status >= 300:
                    errors.append(f"HTTP {response.status}")
                    if response.status < 500:  # the request itself is wrong: retrying cannot help
                        break
                    time.sleep(min(2.0, 0.2 * 2 ** attempt))
                    continue
                reply = json.loads(response.body)
                return str(reply["choices"][0]["message"]["content"])
            except bounded_http.ReplyTooLarge as exc:
                errors.append(str(exc))
                break
            except (OSError, http.client.HTTPException) as exc:  # the deadline included
                errors.append(f"{type(exc).__name__}: {exc}")
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                errors.append(f"malformed reply ({type(exc).__name__}: {exc})")
                break
            time.sleep(min(2.0, 0.2 * 2 ** attempt))
        raise RemoteRewardError(f"VLM judge {self.url} failed after {len(errors)} attempt(s): "
                                + "; ".join(errors))

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]],
              sources: Sequence[tuple[np.ndarray, ...]] | None = None
              ) -> dict[str, torch.Tensor]:
        source_pngs = _source_pngs(sources, len(prompts))
        bodies = [self._body(png, p, srcs) for png, p, srcs
                  in zip(encode_png_base64(images), prompts, source_pngs)]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(bodies)))) as pool:
            answers = list(pool.map(self._ask, bodies))
        values = [parse_score(a, self.score_min, self.score_max, self.score_pattern)
                  for a in answers]
        return {"vlm_judge": torch.tensor(values, dtype=torch.float32)}


def _source_pngs(sources: Sequence[tuple[np.ndarray, ...]] | None, batch: int
                 ) -> list[tuple[str, ...]]:
    """Per sample, its source images as base64 PNG (none for text-to-image); a group's
    candidates share their sources, so each distinct array is encoded once."""
    if sources is None:
        return [()] * batch
    encoded: dict[int, str] = {}
    for sample in sources:
        for array in sample:
            if id(array) not in encoded:
                encoded[id(array)] = encode_png_base64(torch.from_numpy(
                    np.ascontiguousarray(array)).unsqueeze(0))[0]
    return [tuple(encoded[id(a)] for a in sample) for sample in sources]


def _template_problems(name: str, text: str) -> list[str]:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as exc:
        return [f"{name} is not a format string: {exc}"]
    unknown = sorted(fields - {"prompt", "score_min", "score_max"})
    if unknown:
        return [f"{name} uses unknown fields {unknown} (known: prompt, score_min, score_max)"]
    return []


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
