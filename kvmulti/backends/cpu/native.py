"""Build (on first use) and load the native CPU attention kernel from ``kvmulti.cpu_src`` (cpu/).

The sources are compiled with :func:`torch.utils.cpp_extension.load` (ninja + the host C++
compiler, OpenMP) into ``<cache>/cpu/<name>``, where the name hashes everything that goes into the
build (:func:`kvmulti.native_build.build_key`: sources, flags, compiler, Python/torch versions and
install paths). One binary holds every ISA variant (AVX-512 with bf16 dot products, AVX-512, AVX2,
generic); the best one the CPU supports is picked at run time (cpuid). Its variables are
declared in :mod:`kvmulti.settings`.

If anything is missing (no compiler, no ninja, a build error), :func:`status` returns the reason and
the CPU backend uses its vectorised torch path instead; ``kvmulti info`` and ``kvmulti generate``
say which path is in use.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import ModuleType

import torch

from ... import native_build, settings

ENV_ISA = "KVMULTI_CPU_ISA"
ISAS = {"generic": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}

_SOURCES = ("paged_attention.cpp", "prepared_step.cpp", "kernels_avx512bf16.cpp", "kernels_avx512.cpp", "kernels_avx2.cpp", "kernels_generic.cpp")
_HEADERS = ("kvmulti_cpu.h", "attention_kernel.h", "prefill_tiles.h", "torch_ops.h")
_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-Wno-maybe-uninitialized")
_LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_state: tuple[ModuleType | None, str | None] | None = None


def source_dir() -> Path:
    """The folder holding the C++ sources: the installed ``kvmulti.cpu_src`` package, else ``<repo>/cpu``."""
    return native_build.source_dir("kvmulti.cpu_src", "cpu", None, "attention_kernel.h")


def status() -> tuple[ModuleType | None, str | None]:
    """(module, None) when the native kernel is loaded, else (None, why not). Builds on first call."""
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _build()
    return _state


def load() -> ModuleType | None:
    """The native module, or None (see :func:`status` for the reason)."""
    return status()[0]


def selected_isa(module: ModuleType, wanted: str | None) -> str:
    """The ISA variant calls use: ``wanted`` (``KVMULTI_CPU_ISA``; must be available), else the best one."""
    if not wanted:
        return module.best_isa()
    if wanted not in module.available_isas():
        raise ValueError(f"{ENV_ISA}={wanted}: this CPU/build supports only {', '.join(module.available_isas())}")
    return wanted


def describe(wanted_isa: str | None) -> str:
    module, reason = status()
    if module is None:
        return f"vectorised torch: {reason}"
    try:
        isa = selected_isa(module, wanted_isa)
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
    cxx, cxx_path = native_build.cxx_compiler()
    if cxx_path is None:
        return None, f"no C++ compiler ({cxx!r} not found; set CXX or install g++)"
    if not cpp_extension.is_ninja_available():
        return None, "ninja not found (pip install ninja)"

    sanitize = native_build.sanitizer_flags()
    cflags = [*_CFLAGS, *sanitize, *settings.get("KVMULTI_CPU_EXTRA_CFLAGS").split()]
    ldflags = [*_LDFLAGS, *sanitize]
    key = native_build.build_key([src / n for n in _SOURCES + _HEADERS],
                                 [*cflags, *ldflags, cxx_path, native_build.compiler_version(cxx_path)])
    name = f"kvmulti_cpu_{key}"
    build_dir = native_build.cache_root() / "cpu" / name
    verbose = bool(settings.get("KVMULTI_CPU_VERBOSE"))
    try:
        with native_build.build_lock(build_dir):
            if not any(build_dir.glob(f"{name}*.so")):
                native_build.announce("the native CPU attention kernel (about a minute)", build_dir)
            module = cpp_extension.load(
                name=name, sources=[str(src / n) for n in _SOURCES], extra_cflags=cflags,
                extra_ldflags=ldflags, extra_include_paths=[str(src)], build_directory=str(build_dir),
                verbose=verbose)
    except Exception as exc:  # a compiler error, a missing header, ...
        lines = str(exc).splitlines()
        errors = [ln.strip() for ln in lines if "error" in ln.lower() and not ln.lstrip().startswith("[")]
        text = " | ".join(errors[:3]) if errors else " ".join(str(exc).split())
        return None, f"native build failed ({type(exc).__name__}: {text[:300]}); set KVMULTI_CPU_VERBOSE=1 to see the log"
    return module, None
