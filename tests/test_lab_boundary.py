"""The lab stays out of the product: bench/ holds instruments, results and the reports' text;
experiments, sweeps, probe scripts and raw captures live in lab/, which is no package, is not
installed, and is neither imported by the product nor run by CI (lab/README.md)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("flowgrpo_kernels", "ipc", "trainer", "bench", "tests")


def test_bench_reports_hold_only_the_reports_text():
    stray = [str(p.relative_to(REPO)) for p in (REPO / "bench" / "reports").rglob("*")
             if p.is_file() and p.suffix != ".md"]
    assert stray == [], f"captures and probe scripts belong in lab/reports/: {stray}"


def test_bench_holds_no_studies_or_sweeps():
    studies = sorted(p.name for p in (REPO / "bench").glob("toy_*.py"))
    assert studies == [] and not (REPO / "bench" / "sweeps").exists()


def test_each_lab_capture_folder_belongs_to_a_report():
    folders = [p.name for p in (REPO / "lab" / "reports").iterdir() if p.is_dir()]
    orphans = [f for f in folders if not (REPO / "bench" / "reports" / f / "README.md").exists()]
    assert folders and orphans == []


def test_the_lab_is_no_package_and_ci_does_not_collect_it():
    assert list((REPO / "lab").rglob("__init__.py")) == []
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]
    included = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(name.startswith("lab") for name in included)


def test_no_product_code_or_ci_test_reaches_into_the_lab():
    # an import path, a sys.path entry or a script path naming lab/
    reach = re.compile(r"""(["'/]lab/|["']lab["']|^\s*(from|import)\s+lab\b)""", re.M)
    offenders = [str(p.relative_to(REPO)) for pkg in PRODUCT for p in (REPO / pkg).rglob("*.py")
                 if p != Path(__file__).resolve() and reach.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
