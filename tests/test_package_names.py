"""Each top-level package of ours owns its import name in the environment.

Two distributions that install the same top-level name shadow each other by sys.path order:
whichever comes first is imported for both. Hugging Face's ``kernels`` distribution (which
transformers requires and imports when present) is why the math package is
``flowgrpo_kernels`` and not ``kernels``.
"""
from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = "flowgrpo-trainer"


def _our_packages() -> list[str]:
    import tomllib
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(p.rstrip("*") for p in include)


def _clashes(owners: dict[str, list[str]]) -> dict[str, list[str]]:
    found = {pkg: sorted({d for d in owners.get(pkg, []) if d.lower() != OURS})
             for pkg in _our_packages()}
    return {pkg: dists for pkg, dists in found.items() if dists}


def test_the_clash_check_sees_another_distribution_shipping_one_of_our_names():
    owners = {"flowgrpo_kernels": [OURS], "ipc": ["someone-else"], "kernels": ["kernels"]}
    assert _clashes(owners) == {"ipc": ["someone-else"]}


def test_our_packages_are_the_ones_pyproject_ships():
    assert _our_packages() == ["bench", "flowgrpo_kernels", "ipc", "trainer"]
    for pkg in _our_packages():
        assert (ROOT / pkg / "__init__.py").is_file(), pkg


def test_no_installed_distribution_ships_a_top_level_name_of_ours():
    clashes = _clashes(metadata.packages_distributions())
    assert not clashes, "installed distributions shadow our packages: " + "; ".join(
        f"{pkg} (also shipped by {', '.join(d)})" for pkg, d in clashes.items())


def test_transformers_imports_its_hub_kernels_integration_beside_ours():
    """transformers imports ``kernels`` at import time when Hugging Face's is installed."""
    pytest.importorskip("transformers")
    import transformers.integrations.hub_kernels as hub_kernels
    import flowgrpo_kernels
    assert Path(flowgrpo_kernels.__file__).resolve().parent == ROOT / "flowgrpo_kernels"
    assert hub_kernels.__name__ == "transformers.integrations.hub_kernels"
