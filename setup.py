"""Install hook: with KVMULTI_BUILD_HIP=1 the HIP library is built with the host's hipcc at install time."""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithHip(build_py):
    def run(self) -> None:
        super().run()
        if os.environ.get("KVMULTI_BUILD_HIP") == "1":
            out = os.path.join(self.build_lib, "kvmulti", "hip_src", "_build")
            subprocess.check_call([sys.executable, os.path.join("hip", "build_rocm.py"), "--out", out])


setup(cmdclass={"build_py": BuildPyWithHip})
