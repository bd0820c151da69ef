"""Setup for the lab's tests, which run only by hand (`python -m pytest lab/tests`), never in CI.

The experiments in lab/toy/ are scripts, not a package: their folder goes on the import path so
that a test imports a script by its file name, as the scripts import each other; the repository
root goes before it so that `trainer` and `bench` load from this checkout. Like the product's
tests, nothing is downloaded and no row reaches bench/results.csv unless a test points
BENCH_RESULTS at a file of its own.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

LAB = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(LAB.parent), str(LAB / "toy")]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("BENCH_RESULTS", os.devnull)
