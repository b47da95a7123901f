"""Builds of the HIP kernels (``hip/``, shipped as ``kvmulti.hip_src``), through
:mod:`kvmulti.native_build`:

* for the CPU harness: the unmodified kernels compiled with g++ against ``hip/cpu_harness`` (every
  GPU thread a fiber) into ``<cache>/hip_cpu/<key>/``;
* for ROCm: ``libkvmulti_hip.so`` built with the host's hipcc for ``PYTORCH_ROCM_ARCH`` (default:
  the host's GPUs) into ``<cache>/hip_rocm/<key>/``, or at install time (``KVMULTI_BUILD_HIP=1``),
  or named with ``KVMULTI_HIP_LIBRARY``;
* for NVIDIA (the device check only): the same sources with nvcc through ``hip/compat`` into
  ``<cache>/hip_nvidia/<key>/``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import torch

from ... import native_build, settings
from ...native_build import NativeBuildError

#: Sources that make up the libraries (hashed into the build key).
KERNEL_SOURCES = ("launcher.hip", "kvmulti_attention.hip", "kvmulti_prefill.hip", "kvmulti_prefill_fma.hip",
                  "kvmulti_common.h")
HARNESS_SOURCES = ("cpu_harness/kvcpu.h", "cpu_harness/kvcpu.ld", "cpu_harness/include/hip/hip_runtime.h",
                   "cpu_harness/include/hip/hip_fp16.h", "cpu_harness/include/hip/hip_bfloat16.h",
                   "cpu_harness/include/hip/hip_runtime_api.h")
CPU_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-fdata-sections",
             "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas")

HipBuildError = NativeBuildError


def source_dir() -> Path:
    """Directory holding the HIP sources: ``KVMULTI_HIP_SRC``, the installed ``kvmulti.hip_src``, else ``<repo>/hip``."""
    return native_build.source_dir("kvmulti.hip_src", "hip", "KVMULTI_HIP_SRC", "launcher.hip")


# ------------------------------------------------------------------------------------ CPU harness
def cpu_compiler() -> str | None:
    return native_build.cxx_compiler("KVMULTI_HIP_CPU_CXX")[1]


def cpu_harness_reasons() -> list[str]:
    """Why the CPU harness library cannot be built here (empty: it can)."""
    reasons = []
    src = source_dir()
    missing = [s for s in KERNEL_SOURCES + HARNESS_SOURCES if not (src / s).is_file()]
    if missing:
        reasons.append(f"HIP sources missing under {src}: {', '.join(missing)}")
    name, path = native_build.cxx_compiler("KVMULTI_HIP_CPU_CXX")
    if path is None:
        reasons.append(f"C++ compiler {name!r} not found: the HIP CPU harness needs g++ "
                       "(apt-get install g++, or set CXX / KVMULTI_HIP_CPU_CXX)")
    return reasons


def _harness_flags(extra_flags: tuple[str, ...]) -> tuple[str, ...]:
    # Sanitized (KVMULTI_SANITIZE=1), the harness is built at -O0: a quarter of -O1's compile time for the
    # instrumented kernels, and nothing optimised away before the sanitizers see it.
    sanitize = native_build.sanitizer_flags()
    return (*CPU_FLAGS, *sanitize, *(("-O0",) if sanitize else ()), *extra_flags)


#: launcher.hip's KVM_ATTENTION_PAIRS ((query, cache) pairs): the CPU harness library of the kernels is
#: built from one translation unit per pair plus the C ABI's, compiled in parallel
ATTENTION_UNITS = 15


def harness_library_path(main: Path, deps: list[Path], libname: str, extra_flags: tuple[str, ...] = (),
                         units: int = 0) -> Path:
    src = source_dir()
    cxx = cpu_compiler() or "g++"
    key = native_build.build_key([main, *deps, *[src / s for s in HARNESS_SOURCES]],
                                 [cxx, native_build.compiler_version(cxx), *_harness_flags(extra_flags),
                                  f"units={units}"])
    return native_build.cache_root() / "hip_cpu" / key / libname


def build_harness_library(main: Path, deps: list[Path], libname: str, what: str,
                          extra_flags: tuple[str, ...] = (), units: int = 0) -> Path:
    """Compile the HIP source ``main`` (+ headers ``deps``, hashed) with g++ against kvmulti's
    HIP-on-CPU harness into a cached shared library (once per build key). ``units`` > 0: ``main`` is
    launcher.hip-like -- compiled as ``units`` translation units (``-DKVM_ATTENTION_UNIT=i``) and the
    C ABI's (``-DKVM_ATTENTION_UNITS``), in parallel, then linked."""
    reasons = cpu_harness_reasons()
    if reasons:
        raise HipBuildError("cannot build the HIP CPU harness: " + "; ".join(reasons))
    src = source_dir()
    out = harness_library_path(main, deps, libname, extra_flags, units)
    flags = [*_harness_flags(extra_flags), "-I", str(src / "cpu_harness" / "include")]
    link = [f"-Wl,-T,{src / 'cpu_harness' / 'kvcpu.ld'}"]
    if not units:
        return native_build.locked_build(out, [cpu_compiler(), *flags, "-x", "c++", str(main), "-o", "{tmp}", *link],
                                         what)
    compiles = [[cpu_compiler(), *flags, define, "-c", "-x", "c++", str(main), "-o", "{obj}"]
                for define in ["-DKVM_ATTENTION_UNITS", *[f"-DKVM_ATTENTION_UNIT={i}" for i in range(units)]]]
    return native_build.locked_build(out, [cpu_compiler(), *flags, "{objs}", "-o", "{tmp}", *link], what,
                                     units=compiles)


def cpu_library_path() -> Path:
    src = source_dir()
    return harness_library_path(src / KERNEL_SOURCES[0], [src / s for s in KERNEL_SOURCES[1:]],
                                "libkvmulti_hip_cpu.so", units=ATTENTION_UNITS)


def build_cpu_library() -> Path:
    """Build (once; cached) the kvmulti HIP kernels against the CPU harness."""
    src = source_dir()
    return build_harness_library(src / KERNEL_SOURCES[0], [src / s for s in KERNEL_SOURCES[1:]],
                                 "libkvmulti_hip_cpu.so", "the HIP kernels for the CPU harness (g++)",
                                 units=ATTENTION_UNITS)


# ------------------------------------------------------------------------------------ ROCm
def device_arch(index: int | None = None) -> str:
    """gfx name of a ROCm device ('gfx90a:sramecc+:xnack-' -> 'gfx90a')."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return str(getattr(props, "gcnArchName", "")).split(":")[0]


def rocm_target_archs() -> list[str]:
    """``PYTORCH_ROCM_ARCH`` (';' or ',' or space separated), else the archs of this host's GPUs."""
    env = os.environ.get("PYTORCH_ROCM_ARCH", "").replace(",", ";").replace(" ", ";")
    archs = [a.strip() for a in env.split(";") if a.strip()]
    if not archs and torch.version.hip and torch.cuda.is_available():
        archs = sorted({device_arch(i) for i in range(torch.cuda.device_count())} - {""})
    if not archs and torch.version.hip:
        archs = _build_rocm_module().host_archs()
    return archs


def hipcc() -> str | None:
    """The host's hipcc (looked up by hip/build_rocm.py, the install-time builder, for everyone)."""
    return _build_rocm_module().hipcc()


def rocm_library_path(archs: list[str]) -> Path:
    src = source_dir()
    hipcc_ = hipcc() or "hipcc"
    key = native_build.build_key([src / s for s in (*KERNEL_SOURCES, "build_rocm.py")],
                                 [hipcc_, native_build.compiler_version(hipcc_), *archs])
    return native_build.cache_root() / "hip_rocm" / key / "libkvmulti_hip.so"


def prebuilt_rocm_library() -> Path | None:
    """A library named by KVMULTI_HIP_LIBRARY, or one built at install time next to the sources."""
    env = settings.get("KVMULTI_HIP_LIBRARY")
    if env:
        return Path(env)
    p = source_dir() / "_build" / "libkvmulti_hip.so"
    return p if p.exists() else None


def library_archs(lib: Path) -> list[str] | None:
    meta = lib.with_suffix(".json")
    if meta.exists():
        return json.loads(meta.read_text()).get("archs")
    return None


@functools.lru_cache(maxsize=None)
def _build_rocm_module():
    """hip/build_rocm.py (standalone: also the install-time builder), loaded from the sources."""
    path = source_dir() / "build_rocm.py"
    spec = importlib.util.spec_from_file_location("kvmulti_hip_build_rocm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_rocm_library(archs: list[str] | None = None, out: Path | None = None) -> Path:
    """Build the ROCm library with hipcc for ``archs`` (default: rocm_target_archs()), cached."""
    compiler = hipcc()
    if compiler is None:
        raise HipBuildError("hipcc not found (install ROCm's hipcc or set ROCM_PATH): cannot build the HIP kernels")
    archs = archs or rocm_target_archs()
    if not archs:
        raise HipBuildError("no target archs: set PYTORCH_ROCM_ARCH (e.g. 'gfx90a;gfx942') or run on a ROCm host "
                            "with visible GPUs")
    out = out or rocm_library_path(archs)
    cmd = _build_rocm_module().command(compiler, archs, Path("{tmp}"), source_dir() / "launcher.hip")
    native_build.locked_build(out, cmd, f"the HIP kernels with hipcc for {', '.join(archs)}",
                              env=dict(os.environ, HIP_PLATFORM="amd"))
    out.with_suffix(".json").write_text(json.dumps({"archs": archs}))
    return out


# ------------------------------------------------------------------------------------ NVIDIA (nvcc)
#: nvcc flags of the NVIDIA build: the same sources through kvmulti's HIP->CUDA compat headers
#: (``hip/compat``), one real target, the CUDA runtime linked statically.
NVIDIA_FLAGS = ("-x", "cu", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared")
COMPAT_SOURCES = ("compat/hip/hip_runtime.h", "compat/hip/hip_fp16.h", "compat/hip/hip_bfloat16.h")


def nvcc() -> str | None:
    """``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), else nvcc on PATH, else /usr/local/cuda's."""
    cuda = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda and (Path(cuda) / "bin" / "nvcc").exists():
        return str(Path(cuda) / "bin" / "nvcc")
    default = Path("/usr/local/cuda/bin/nvcc")
    return shutil.which("nvcc") or (str(default) if default.exists() else None)


def cuda_arch(index: int | None = None) -> str:
    """``sm_XY`` of a CUDA device from its compute capability (e.g. ``sm_90`` for H100 / H200)."""
    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device() if index is None else index)
    return f"sm_{major}{minor}"


def nvidia_command(compiler: str, arch: str, source: Path, out: Path | str) -> list[str]:
    """The nvcc command line building ``source`` into a shared library for ``arch`` (``sm_90``)."""
    return [compiler, *NVIDIA_FLAGS, f"-arch={arch}", "-I", str(source.parent / "compat"), str(source), "-o", str(out)]


def nvidia_library_path(arch: str) -> Path:
    src = source_dir()
    compiler = nvcc() or "nvcc"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout if nvcc() else ""
    key = native_build.build_key([src / s for s in (*KERNEL_SOURCES, *COMPAT_SOURCES)],
                                 [compiler, version, arch, *NVIDIA_FLAGS])
    return native_build.cache_root() / "hip_nvidia" / key / f"libkvmulti_hip_{arch}.so"


def build_nvidia_library(arch: str, out: Path | None = None) -> Path:
    """Build (once; cached) the HIP kernels with nvcc for the NVIDIA target ``arch`` (``sm_90``):
    the same ``launcher.hip`` C ABI, callable through :mod:`.library` on CUDA tensors (their
    ``data_ptr()``s and torch's current CUDA stream). Compiling needs nvcc only, no GPU. Used by the
    device check (``devtools/device_check.py``); the dispatcher never picks it."""
    compiler = nvcc()
    if compiler is None:
        raise HipBuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH): cannot build the HIP kernels "
                            "for an NVIDIA target")
    out = out or nvidia_library_path(arch)
    cmd = nvidia_command(compiler, arch, source_dir() / KERNEL_SOURCES[0], "{tmp}")
    return native_build.locked_build(out, cmd, f"the HIP kernels with nvcc for {arch}")
