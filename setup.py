"""Build hooks. A wheel (``pip wheel`` / ``pip install`` / ``python -m build``, not an editable
install) carries the CPU kernel compiled ahead of time when torch is importable in the build
environment (``--no-build-isolation``) and a C++ compiler is on PATH; such a wheel is tagged for this
interpreter and platform. With KVMULTI_BUILD_HIP=1 the HIP library is built with the host's hipcc.
The package list is found, not written down: a backend folder under kvmulti/backends/ ships without
editing any other file."""

import os
import subprocess
import sys

from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def prebuild_cpu_kernel(build_lib: str) -> None:
    """Compile the CPU kernel from this tree into the wheel's kvmulti/_prebuilt/cpu (a reason on stderr if not)."""
    if not torch_importable():
        print("kvmulti: torch is not importable in this build environment (build isolation), so the wheel "
              "carries no prebuilt CPU kernel; build with --no-build-isolation, or run `kvmulti build` after "
              "installing", file=sys.stderr)
        return
    sys.path.insert(0, str(HERE))
    from kvmulti.backends.cpu import native
    print("kvmulti: compiling the CPU kernel for the wheel (a few minutes) ...", file=sys.stderr, flush=True)
    library, what = native.build_for_wheel(HERE / "cpu", Path(build_lib) / "kvmulti" / "_prebuilt" / "cpu")
    print(f"kvmulti: prebuilt {what}" if library else f"kvmulti: no prebuilt CPU kernel: {what}", file=sys.stderr)


class BinaryWhenTorchIsHere(Distribution):
    """A wheel that may carry a compiled kernel is tagged for this interpreter and platform."""

    def has_ext_modules(self) -> bool:
        return torch_importable()


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            prebuild_cpu_kernel(self.build_lib)
        if os.environ.get("KVMULTI_BUILD_HIP") == "1":
            out = os.path.join(self.build_lib, "kvmulti", "hip_src", "_build")
            subprocess.check_call([sys.executable, os.path.join("hip", "build_rocm.py"), "--out", out])


#: kernel source folders, shipped as package data (pyproject.toml's package-dir and package-data)
KERNEL_SOURCES = ["kvmulti.triton_kernels", "kvmulti.hip_src", "kvmulti.sycl_src", "kvmulti.cpu_src"]

setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=BinaryWhenTorchIsHere,
      packages=find_packages(include=["kvmulti", "kvmulti.*"]) + KERNEL_SOURCES)
