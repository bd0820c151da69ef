"""tests/ci_skips.py: under CI=true a skip for a dependency the test command installs fails the
run; other skips (no GPU, what the command does not install) and every skip outside CI stay
skips. Runs a small suite (pytester, in-process) with the same hooks as tests/conftest.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from ci_skips import missing_dependency

pytest_plugins = ["pytester"]

SUITE = {
    "conftest.py": "from ci_skips import pytest_make_collect_report, pytest_runtest_makereport\n",
    "test_sglang_like.py": (
        "import pytest\n"
        "def test_needs_sglang():\n"
        "    pytest.skip(\"could not import 'sglang.multimodal_gen': No module named 'IPython'\")\n"
        "def test_needs_cuda():\n"
        "    pytest.skip('needs a CUDA device')\n"
        "def test_needs_wandb():\n"
        "    pytest.importorskip('wandb_not_installed_here')\n"
        "def test_runs():\n"
        "    assert True\n"),
    "test_module_level.py": (
        "import pytest\n"
        "pytest.skip(\"could not import 'open_clip': No module named 'open_clip'\", "
        "allow_module_level=True)\n"
        "def test_never():\n"
        "    pass\n"),
}


def _run(pytester, monkeypatch, ci: str | None):
    pytester.makepyfile(**{Path(n).stem: body for n, body in SUITE.items()})
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs",
                                        "--continue-on-collection-errors")


def test_ci_fails_skips_for_what_the_test_command_installs(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "true")
    result.assert_outcomes(passed=1, skipped=2, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_needs_sglang*", "*'sglang.multimodal_gen' does not import*"])
    assert result.ret != 0


def test_skips_stay_skips_outside_ci(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, None)
    result.assert_outcomes(passed=1, skipped=4)
    assert result.ret == 0


def test_missing_dependency_names_only_what_the_command_installs():
    assert missing_dependency("could not import 'rapidocr_onnxruntime': boom") == \
        "rapidocr_onnxruntime"
    assert missing_dependency("could not import 'sglang.multimodal_gen': No module named "
                              "'IPython'") == "sglang.multimodal_gen"
    assert missing_dependency("No module named 'dateutil'") == "dateutil"
    assert missing_dependency("could not import 'cupy': no CUDA") is None
    assert missing_dependency("needs a CUDA device") is None
