"""Build (on first use) and load the native CPU attention kernel from ``kvmulti.cpu_src`` (cpu/).

The sources are compiled with :func:`torch.utils.cpp_extension.load` (ninja + the host C++
compiler, OpenMP) into a cache directory keyed by a hash of the sources, the flags and the torch
version, so a rebuild happens only when one of them changes:
``$KVMULTI_CACHE_DIR`` or ``$XDG_CACHE_HOME/kvmulti`` (default ``~/.cache/kvmulti``) ``/cpu/<name>``.
One binary holds every ISA variant (AVX-512 with bf16 dot products, AVX-512, AVX2, generic); the best one the CPU supports is
picked at run time (cpuid).

Environment:
  KVMULTI_CPU_NATIVE=0     never build or use the native kernel (the vectorised torch path runs)
  KVMULTI_CPU_ISA=avx512bf16|avx512|avx2|generic   use that variant (must be supported by this CPU)
  KVMULTI_CPU_VERBOSE=1    show the compiler's output while building
  KVMULTI_CPU_EXTRA_CFLAGS="-DKV_PREFETCH=0 ..."   extra compiler flags (part of the cache key), e.g.
                           the tuning macros at the top of cpu/attention_kernel.h

If anything is missing (no compiler, no ninja, a build error), :func:`status` returns the reason and
the CPU backend uses its vectorised torch path instead; ``kvmulti info`` shows which path is in use.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from . import native_build

ENV_NATIVE = "KVMULTI_CPU_NATIVE"
ENV_ISA = "KVMULTI_CPU_ISA"
ENV_VERBOSE = "KVMULTI_CPU_VERBOSE"
ENV_EXTRA_CFLAGS = "KVMULTI_CPU_EXTRA_CFLAGS"
ISAS = {"generic": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}

_SOURCES = ("paged_attention.cpp", "kernels_avx512bf16.cpp", "kernels_avx512.cpp", "kernels_avx2.cpp", "kernels_generic.cpp")
_HEADERS = ("kvmulti_cpu.h", "attention_kernel.h")
_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-Wno-maybe-uninitialized")
_LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state: tuple[ModuleType | None, str | None] | None = None


def source_dir() -> Path:
    """The folder holding the C++ sources (the ``kvmulti.cpu_src`` package, cpu/ in the repository)."""
    import kvmulti.cpu_src
    return Path(kvmulti.cpu_src.__file__).resolve().parent


def disabled_reason() -> str | None:
    value = os.environ.get(ENV_NATIVE, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return f"native kernel disabled by {ENV_NATIVE}={os.environ[ENV_NATIVE]}"
    return None


def cache_dir() -> Path:
    return native_build.cache_root()


def status() -> tuple[ModuleType | None, str | None]:
    """(module, None) when the native kernel is loaded, else (None, why not). Builds on first call."""
    global _state
    reason = disabled_reason()
    if reason:
        return None, reason
    if _state is None:
        with _lock:
            if _state is None:
                _state = _build()
    return _state


def load() -> ModuleType | None:
    """The native module, or None (see :func:`status` for the reason)."""
    return status()[0]


def selected_isa(module: ModuleType) -> str:
    """The ISA variant calls use: $KVMULTI_CPU_ISA if set (must be available), else the best one."""
    wanted = os.environ.get(ENV_ISA, "").strip().lower()
    if not wanted:
        return module.best_isa()
    if wanted not in ISAS:
        raise ValueError(f"{ENV_ISA}={wanted!r}: valid values are {', '.join(ISAS)}")
    if wanted not in module.available_isas():
        raise ValueError(f"{ENV_ISA}={wanted}: this CPU/build supports only {', '.join(module.available_isas())}")
    return wanted


def describe() -> str:
    module, reason = status()
    if module is None:
        return f"vectorised torch: {reason}"
    try:
        isa = selected_isa(module)
    except ValueError as exc:
        return f"native (unusable: {exc})"
    return f"native ({isa}, {torch.get_num_threads()} threads)"


def _build() -> tuple[ModuleType | None, str | None]:
    try:
        from torch.utils import cpp_extension
    except Exception as exc:  # pragma: no cover - torch always has it
        return None, f"torch.utils.cpp_extension unavailable: {exc}"
    try:
        src = source_dir()
    except Exception as exc:
        return None, f"kernel sources not found (kvmulti.cpu_src): {exc}"
    missing = [n for n in _SOURCES + _HEADERS if not (src / n).is_file()]
    if missing:
        return None, f"kernel sources missing from {src}: {', '.join(missing)}"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return None, f"no C++ compiler ({cxx!r} not found; set CXX or install g++)"
    if not cpp_extension.is_ninja_available():
        return None, "ninja not found (pip install ninja)"

    cflags = list(_CFLAGS) + os.environ.get(ENV_EXTRA_CFLAGS, "").split()
    digest = hashlib.sha256()
    for n in _SOURCES + _HEADERS:
        digest.update(n.encode() + b"\0" + (src / n).read_bytes())
    digest.update(" ".join(cflags + list(_LDFLAGS)).encode() + torch.__version__.encode() + sys.version.encode()
                  + cxx.encode())
    name = f"kvmulti_cpu_{digest.hexdigest()[:12]}"
    build_dir = cache_dir() / "cpu" / name
    verbose = os.environ.get(ENV_VERBOSE, "") not in ("", "0")
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        if not any(build_dir.glob(f"{name}*.so")):
            print(f"kvmulti: compiling the native CPU attention kernel into {build_dir} "
                  "(first use only; about a minute)...", file=sys.stderr, flush=True)
        module = cpp_extension.load(
            name=name, sources=[str(src / n) for n in _SOURCES], extra_cflags=cflags,
            extra_ldflags=list(_LDFLAGS), extra_include_paths=[str(src)], build_directory=str(build_dir),
            verbose=verbose)
    except Exception as exc:  # a compiler error, a missing header, ...
        lines = str(exc).splitlines()
        errors = [ln.strip() for ln in lines if "error" in ln.lower() and not ln.lstrip().startswith("[")]
        text = " | ".join(errors[:3]) if errors else " ".join(str(exc).split())
        return None, f"native build failed ({type(exc).__name__}: {text[:300]}); set {ENV_VERBOSE}=1 to see the log"
    return module, None
