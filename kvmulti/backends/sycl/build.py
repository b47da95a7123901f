"""Building and finding what the SYCL backend runs on: the kernel sources, the SYCL runtime from
PyPI (or ``KVMULTI_SYCL_ROOT``), the environment it reads at load time, and the g++-built host shim
(``sycl/shim.cpp``), cached per build key under ``<kvmulti cache>/sycl``."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from ... import native_build, settings

#: Bumped when the C ABI of shim.cpp changes (part of the shim's cache key).
SHIM_ABI = 4
SHIM_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING", "-w")


class SyclError(RuntimeError):
    """The SYCL runtime, the shim or a launch failed; the message says why."""


class SyclBuildError(SyclError):
    """Compiling SYCL kernel source failed; ``log`` holds the compiler's output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


# ------------------------------------------------------------------------------------ paths
def source_dir() -> Path:
    """Directory with shim.cpp / kernels.cpp: ``KVMULTI_SYCL_SRC``, the installed ``kvmulti.sycl_src``
    package, else ``<repo>/sycl``."""
    return native_build.source_dir("kvmulti.sycl_src", "sycl", "KVMULTI_SYCL_SRC", "kernels.cpp")


def cache_root() -> Path:
    return native_build.cache_root() / "sycl"


def kernel_source() -> str:
    """The text of sycl/kernels.cpp (read once per process)."""
    return _read_text(str(source_dir() / "kernels.cpp"))


@functools.lru_cache(maxsize=8)
def _read_text(path: str) -> str:
    return Path(path).read_text()


def runtime_candidates() -> list[Path]:
    named = settings.get("KVMULTI_SYCL_ROOT")
    if named:                     # a named runtime is the only candidate: no silent fallback
        return [Path(named)]
    out = []
    for c in (sys.prefix, os.environ.get("CMPLR_ROOT")):
        if c and Path(c) not in out:
            out.append(Path(c))
    return out


def find_runtime() -> tuple[Path | None, list[str]]:
    """The prefix holding ``include/sycl/sycl.hpp`` and ``lib/libsycl.so`` (+ reasons if none)."""
    looked = []
    for root in runtime_candidates():
        if (root / "include" / "sycl" / "sycl.hpp").is_file() and (root / "lib" / "libsycl.so").exists():
            return root, []
        looked.append(str(root))
    return None, [f"SYCL runtime not found (looked for include/sycl/sycl.hpp and lib/libsycl.so in "
                  f"{', '.join(looked)}): pip install 'kvmulti[sycl]' (intel-sycl-rt, intel-opencl-rt) "
                  "or set KVMULTI_SYCL_ROOT"]


def runtime_version() -> str:
    try:
        from importlib.metadata import version
        return "intel-sycl-rt " + version("intel-sycl-rt")
    except Exception:  # noqa: BLE001 - a oneAPI install has no wheel metadata
        return "unknown version"


def configure_environment(root: Path) -> None:
    """Set what the runtime reads at load time, unless the user already set it.

    OCL_ICD_FILENAMES: the intel-opencl-rt wheel's .icd file holds a placeholder path, so the OpenCL
    loader is pointed at the CPU runtime directly. SYCL_CACHE_PERSISTENT / SYCL_CACHE_DIR: keep
    compiled kernels across processes. ONEAPI_DEVICE_SELECTOR is never touched.
    """
    ocl = root / "lib" / "libintelocl.so"
    if ocl.exists() and not os.environ.get("OCL_ICD_FILENAMES"):
        os.environ["OCL_ICD_FILENAMES"] = str(ocl)
    os.environ.setdefault("SYCL_CACHE_PERSISTENT", "1")
    if not os.environ.get("SYCL_CACHE_DIR"):
        os.environ["SYCL_CACHE_DIR"] = str(cache_root() / "kernels")


# ------------------------------------------------------------------------------------ shim build
def compiler() -> str | None:
    return native_build.cxx_compiler("KVMULTI_SYCL_CXX")[1]


def _shim_flags() -> tuple[str, ...]:
    return (*SHIM_FLAGS, *native_build.sanitizer_flags())


def shim_command(root: Path, out: str) -> list[str]:
    lib = root / "lib"
    return [compiler() or "g++", *_shim_flags(), f"-I{root / 'include'}", str(source_dir() / "shim.cpp"),
            f"-L{lib}", "-lsycl", f"-Wl,-rpath,{lib}", "-o", out]


def shim_path(root: Path) -> Path:
    cxx = compiler() or ""
    key = native_build.build_key([source_dir() / "shim.cpp"],
                                 [str(SHIM_ABI), str(root), os.path.realpath(root / "lib" / "libsycl.so"), cxx,
                                  native_build.compiler_version(cxx) if cxx else "", *_shim_flags()])
    return cache_root() / f"shim-{key}" / "libkvmulti_sycl_shim.so"


def build_shim(root: Path) -> Path:
    """Build (once per build key of source, runtime and flags) the host shim; return its path."""
    out = shim_path(root)
    if out.exists():
        return out
    if compiler() is None:
        raise SyclError(f"C++ compiler {settings.get('KVMULTI_SYCL_CXX') or 'g++'!r} not found: the SYCL host shim "
                        "is built with g++ on first use (apt-get install g++, or set KVMULTI_SYCL_CXX)")
    try:
        return native_build.locked_build(out, shim_command(root, "{tmp}"), "the SYCL host shim")
    except native_build.NativeBuildError as e:
        raise SyclError(str(e)) from e
