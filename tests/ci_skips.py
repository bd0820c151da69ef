"""Under ``CI=true`` a test that skips for a dependency the test command installs fails the run.

The README's test command (what .ci/run runs on a fresh clone) installs the ``test`` extra,
tests/requirements-sglang.txt and ``sglang`` itself; a test that then skips because one of those
does not import is a broken install step, which a green run would hide (29 SGLang tests once
skipped on every fresh clone). Skips for what the command does not install stay skips: no
GPU ("needs CUDA"), cupy, wandb, a tmpfs that needs root.

A skip is a missing dependency when its message is ``pytest.importorskip``'s ("could not import
'X': ...") or names a missing module ("No module named 'X'"), and X's top-level package is one
the command installs (``TEST_COMMAND_INSTALLS``). tests/conftest.py calls the two hooks below.
"""
from __future__ import annotations

import os
import re

import pytest

#: Top-level modules the README's test command installs (pyproject's ``test`` extra and base
#: dependencies, tests/requirements-sglang.txt, sglang), by import name.
TEST_COMMAND_INSTALLS = frozenset({
    "sglang", "open_clip", "rapidocr_onnxruntime", "onnxruntime", "triton", "pytest_benchmark",
    "pytest_timeout", "torch", "torchvision", "diffusers", "transformers", "peft", "accelerate",
    "safetensors", "PIL", "numpy", "fastapi", "starlette", "uvicorn", "msgspec", "orjson",
    "pybase64", "zmq", "aiohttp", "httpx", "imageio", "imageio_ffmpeg", "tvm_ffi", "dill",
    "sentencepiece", "compressed_tensors", "gguf", "addict", "einops", "cache_dit", "openai",
    "partial_json_parser", "psutil", "IPython", "dateutil",
})

_MISSING = re.compile(r"could not import '([\w.]+)'|No module named '([\w.]+)'")


def ci_enabled() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing_dependency(message: str) -> str | None:
    """The module a skip message says is missing, when the test command installs it."""
    for match in _MISSING.finditer(message or ""):
        name = match.group(1) or match.group(2)
        if name.split(".")[0] in TEST_COMMAND_INSTALLS:
            return name
    return None


def _skip_message(excinfo) -> str | None:
    if excinfo is None or not excinfo.errisinstance(pytest.skip.Exception):
        return None
    return str(excinfo.value.msg if hasattr(excinfo.value, "msg") else excinfo.value)


def _as_failure(report, message: str, name: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"CI=true: skipped because {name!r} does not import, but the README's "
                       f"test command installs it (a broken install step, tests/ci_skips.py): "
                       f"{message}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    message = _skip_message(call.excinfo)
    if ci_enabled() and report.skipped and message is not None:
        name = missing_dependency(message)
        if name is not None:
            _as_failure(report, message, name)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module-level ``importorskip`` skips at collection."""
    outcome = yield
    report = outcome.get_result()
    if not (ci_enabled() and report.skipped):
        return
    message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    name = missing_dependency(message)
    if name is not None:
        _as_failure(report, message, name)
