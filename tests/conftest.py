"""Shared pytest fixtures. Keep this small and generic; helpers live in their own modules.

- Offline Hugging Face hubs for every test: nothing may be downloaded, and a missing local
  file must fail instead of silently fetching (or silently returning a broken tokenizer).
- ``tiny_model_dir``: session-cached tiny random model directories (tests/tiny_models.py).
- Under ``CI=true`` a skip for a missing dependency that the README's test command installs
  fails the run (tests/ci_skips.py); GPU-only skips stay skips.
- ``torch_single_thread``: one intra-op thread for the duration of a test. NOTE: on a shared
  machine under load, OpenMP workers spinning against other processes made a tiny forward far
  slower with two threads than with one (figures:
  bench/reports/2026-12-04_cpu-h200_comment-figures.md); tiny models gain nothing from intra-op
  parallelism.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 (hooks)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# bench scripts run by tests append their rows here, never to bench/results.csv (bench/results.py)
os.environ.setdefault("BENCH_RESULTS", os.devnull)


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


# Without a GPU the Triton kernels run in the interpreter; this must be set before anything
# imports triton, so it lives here rather than in a test module.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model_dir(family) -> Path``: built once per session per family, then reused."""
    from tiny_models import build_tiny_model_dir

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_model_dir(family, tmp_path_factory.mktemp(f"tiny_{family}"))
        return built[family]

    return get


@pytest.fixture
def torch_single_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
