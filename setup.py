"""Install hook: with KVMULTI_BUILD_HIP=1 the HIP library is built with the host's hipcc at install time.
The package list is found, not written down: a backend folder under kvmulti/backends/ ships without
editing any other file."""

import os
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithHip(build_py):
    def run(self) -> None:
        super().run()
        if os.environ.get("KVMULTI_BUILD_HIP") == "1":
            out = os.path.join(self.build_lib, "kvmulti", "hip_src", "_build")
            subprocess.check_call([sys.executable, os.path.join("hip", "build_rocm.py"), "--out", out])


#: kernel source folders, shipped as package data (pyproject.toml's package-dir and package-data)
KERNEL_SOURCES = ["kvmulti.triton_kernels", "kvmulti.hip_src", "kvmulti.sycl_src", "kvmulti.cpu_src"]

setup(cmdclass={"build_py": BuildPyWithHip},
      packages=find_packages(include=["kvmulti", "kvmulti.*"]) + KERNEL_SOURCES)
