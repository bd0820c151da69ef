"""pytest set-up of the benchmark suite, which the default test run leaves out (testpaths = tests).

    python -m pytest bench/ --benchmark-enable                 # every bench_*.py module
    python -m pytest bench/bench_kernels.py --benchmark-enable  # one of them

Benchmark modules are named ``bench_*.py`` so that they also run as plain scripts; this file
makes pytest collect them when given the directory. Without CUDA, Triton kernels run under
TRITON_INTERPRET=1 (set here before any kernel module is imported).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collect_file(parent, file_path):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
