"""Build hook for the optional native extension in cmake/.

The extension (a multi-tensor copy + checksum kernel for ipc/) is built only when a CUDA
toolchain (nvcc and cmake) is present and FLOWGRPO_NO_NATIVE is unset. It must never fail an
install: any build error is reported and the pure-Python/Triton fallback is used instead.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _cuda_toolchain() -> bool:
    if os.environ.get("FLOWGRPO_NO_NATIVE"):
        return False
    return shutil.which("cmake") is not None and (
        shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
    )


class BuildWithNative(build_py):
    def run(self):
        super().run()
        if not _cuda_toolchain() or not (ROOT / "cmake" / "CMakeLists.txt").exists():
            return
        build_dir = ROOT / "build" / "native"
        out_dir = Path(self.build_lib) / "ipc" / "_native"
        try:
            build_dir.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["cmake", "-S", str(ROOT / "cmake"), "-B", str(build_dir),
                 f"-DFLOWGRPO_OUT_DIR={out_dir}", "-DCMAKE_BUILD_TYPE=Release"],
                check=True)
            subprocess.run(["cmake", "--build", str(build_dir), "-j"], check=True)
        except (subprocess.CalledProcessError, OSError) as exc:  # never fail an install
            print(f"[flowgrpo] native extension not built ({exc}); using the fallback",
                  file=sys.stderr)


setup(cmdclass={"build_py": BuildWithNative})
