"""Load the native CPU attention kernel: the one a wheel carries (:mod:`.prebuilt`) when it fits
this interpreter, else built from ``kvmulti.cpu_src`` (cpu/) and cached (the JIT fallback).
:class:`~.backend.CPUBackend` loads it when it is constructed, never inside an attention call.

The ISA variants (torch-free) are compiled once into a static archive shared by every Python
environment (:func:`build_variants`); the torch bindings with :func:`torch.utils.cpp_extension.load`
(ninja + the host C++ compiler, OpenMP) into ``<cache>/cpu/<name>``, linked with that archive, where
the name hashes everything that goes into the build (:func:`kvmulti.native_build.build_key`:
sources, flags, compiler, Python/torch versions and install paths). A wheel's binary holds every
ISA variant (AVX-512 with bf16 dot products, AVX-512, AVX2, generic); a JIT build holds the
generic one and those this CPU can run (:func:`host_isas`). The best one the CPU supports is picked
at run time (cpuid). Its variables are declared in
:mod:`kvmulti.settings`.

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
from . import prebuilt

ENV_ISA = "KVMULTI_CPU_ISA"
ISAS = {"generic": 0, "avx2": 1, "avx512": 2, "avx512bf16": 3}

#: the torch-free translation units: one per ISA variant, built once per cache for every Python
#: environment (:func:`build_variants`)
_VARIANT_SOURCES = ("kernels_avx512bf16.cpp", "kernels_avx512.cpp", "kernels_avx2.cpp", "kernels_generic.cpp")
_VARIANT_HEADERS = ("kvmulti_cpu.h", "attention_kernel.h", "prefill_tiles.h")
#: the torch bindings, built per Python environment and linked with the variants
_BINDING_SOURCES = ("paged_attention.cpp", "prepared_step.cpp")
_SOURCES = (*_BINDING_SOURCES, *_VARIANT_SOURCES)
_HEADERS = (*_VARIANT_HEADERS, "torch_ops.h")
_VARIANT_STD = "-std=c++17"
_CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-Wno-maybe-uninitialized")
_LDFLAGS = ("-fopenmp",)

#: the macro that leaves a variant's translation unit empty (its kernel then reports itself unusable)
SKIP_MACROS = {"avx2": "KV_SKIP_AVX2", "avx512": "KV_SKIP_AVX512", "avx512bf16": "KV_SKIP_AVX512BF16"}

_lock = threading.Lock()
_state: tuple[ModuleType | None, str | None] | None = None
_origin: str | None = None


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
    where = "prebuilt" if (_origin or "").startswith("prebuilt") else "JIT-built"
    return f"native ({isa}, {torch.get_num_threads()} threads, {where})"


def skip_flags(keep: "set[str] | list[str] | tuple[str, ...]") -> str:
    """Compiler flags (for ``KVMULTI_CPU_EXTRA_CFLAGS``) that build only the variants in ``keep`` and
    the generic one, which is always built: a build for a test or a host that runs only those."""
    return " ".join(f"-D{macro}" for isa, macro in SKIP_MACROS.items() if isa not in keep)


#: The CPU features each variant needs, as /proc/cpuinfo spells them: the kernel's own cpuid test
#: (``cpu_has`` in cpu/paged_attention.cpp).
_CPU_FLAGS = {
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}),
    "avx512bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx512_bf16",
                             "avx512vbmi"}),
}


def host_isas(cpuinfo: str | None = None) -> tuple[str, ...] | None:
    """The vector variants this CPU can run, from the ``flags`` line of ``cpuinfo`` (default: the
    text of /proc/cpuinfo), best first; None where there is no such line to read (another OS or
    processor: then every variant is built and the kernel's cpuid test decides at run time)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    line = next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), None)
    if line is None:
        return None
    flags = set(line.partition(":")[2].split())
    return tuple(isa for isa in ("avx512bf16", "avx512", "avx2") if _CPU_FLAGS[isa] <= flags)


def host_skip_flags() -> str:
    """:func:`skip_flags` keeping the variants this CPU can run (:func:`host_isas`): the flags of a
    build for this host only, which the JIT build adds by itself. Empty where the CPU's features
    cannot be read."""
    isas = host_isas()
    return "" if isas is None else skip_flags(isas)


def host_only_extra_cflags(extra: str = "") -> str:
    """``extra`` (a ``KVMULTI_CPU_EXTRA_CFLAGS`` value) with :func:`host_skip_flags` appended: the
    value that makes a build outside the JIT (a wheel, a sanitizer build) compile only the variants
    this host runs, under the same key as the JIT build."""
    return " ".join([extra, host_skip_flags()]).strip()


def build_inputs(src: Path | None = None) -> tuple[Path, list[Path], list[str], list[str]]:
    """(source folder, files hashed, cflags, ldflags) of the kernel build; ``src`` defaults to
    :func:`source_dir`. FileNotFoundError when a source is missing."""
    src = source_dir() if src is None else src
    missing = [n for n in _SOURCES + _HEADERS if not (src / n).is_file()]
    if missing:
        raise FileNotFoundError(f"kernel sources missing from {src}: {', '.join(missing)}")
    sanitize = native_build.sanitizer_flags()
    cflags = [*_CFLAGS, *sanitize, *settings.get("KVMULTI_CPU_EXTRA_CFLAGS").split()]
    return src, [src / n for n in _SOURCES + _HEADERS], cflags, [*_LDFLAGS, *sanitize]


def origin() -> str | None:
    """Where the loaded kernel came from (``prebuilt (...)`` or ``JIT build ...``); None when none is."""
    status()
    return _origin


def _build() -> tuple[ModuleType | None, str | None]:
    global _origin
    try:
        src, files, cflags, ldflags = build_inputs()
    except Exception as exc:
        return None, f"kernel sources not found (kvmulti.cpu_src): {exc}"
    module, note = prebuilt.load(prebuilt.sources_hash(files, cflags + ldflags))
    wanted = settings.get(ENV_ISA)
    if module is not None and wanted and wanted not in module.available_isas():
        module, note = None, f"prebuilt kernel has no usable {wanted} variant"
    if module is not None:
        _origin = note
        return module, None
    # A JIT build runs where it was built: the variants this CPU cannot run are left out (a wheel's
    # build, build_for_wheel, keeps them all).
    host_only = [flag for flag in host_skip_flags().split() if flag not in cflags]
    module, reason, build_dir = build_jit(src, files, [*cflags, *host_only], ldflags)
    if module is not None:
        _origin = f"JIT build in {build_dir} ({note})"
    return module, reason


def build_jit(src: Path, files: list[Path], cflags: list[str], ldflags: list[str],
              cache: Path | None = None) -> tuple[ModuleType | None, str | None, Path | None]:
    """Build (or reuse from ``cache``, default the kvmulti cache) and load the kernel:
    (module, None, build folder) or (None, why not, None)."""
    try:
        from torch.utils import cpp_extension
    except Exception as exc:  # pragma: no cover - torch always has it
        return None, f"torch.utils.cpp_extension unavailable: {exc}", None
    cxx, cxx_path = native_build.cxx_compiler()
    if cxx_path is None:
        return None, f"no C++ compiler ({cxx!r} not found; set CXX or install g++)", None
    if not cpp_extension.is_ninja_available():
        return None, "ninja not found (pip install ninja)", None
    # ninja as torch will run it (first on PATH): two ninja versions sharing a build folder rewrite
    # each other's log format, and each switch rebuilds every object
    ninja = native_build.find_compiler("ninja") or "ninja"
    key = native_build.build_key(files, [*cflags, *ldflags, cxx_path, native_build.compiler_version(cxx_path),
                                         ninja, native_build.compiler_version(ninja)])
    name = f"kvmulti_cpu_{key}"
    root = native_build.cache_root() if cache is None else cache
    build_dir = root / "cpu" / name
    verbose = bool(settings.get("KVMULTI_CPU_VERBOSE"))
    try:
        variants = build_variants(src, cflags, cxx_path, root)
        with native_build.build_lock(build_dir):
            if not any(build_dir.glob(f"{name}*.so")):
                native_build.announce("the native CPU attention kernel's torch bindings", build_dir)
            module = cpp_extension.load(
                name=name, sources=[str(src / n) for n in _BINDING_SOURCES], extra_cflags=list(cflags),
                # copies: load() appends torch's libraries to them
                extra_ldflags=["-Wl,--whole-archive", str(variants), "-Wl,--no-whole-archive", *ldflags],
                extra_include_paths=[str(src)], build_directory=str(build_dir),
                verbose=verbose)
    except Exception as exc:  # a compiler error, a missing header, ...
        lines = str(exc).splitlines()
        errors = [ln.strip() for ln in lines if "error" in ln.lower() and not ln.lstrip().startswith("[")]
        text = " | ".join(errors[:3]) if errors else " ".join(str(exc).split())
        return (None, f"native build failed ({type(exc).__name__}: {text[:300]}); "
                      "set KVMULTI_CPU_VERBOSE=1 to see the log", None)
    return module, None, build_dir


def build_variants(src: Path, cflags: list[str], cxx_path: str, root: Path) -> Path:
    """The ISA variants' translation units (:data:`_VARIANT_SOURCES`: no torch or Python header) compiled
    with ``cflags`` by ``cxx_path`` into one static archive under ``root/cpu/variants_<key>/``, built in
    parallel once and then shared by every Python environment's bindings (the key has no environment
    in it). Raises NativeBuildError when a compile fails or ``ar`` is missing."""
    ar = native_build.find_compiler("gcc-ar", "ar")
    if ar is None:
        raise native_build.NativeBuildError("no archiver (ar) on PATH: install binutils")
    flags = [_VARIANT_STD, "-fPIC", *cflags]
    files = [src / n for n in (*_VARIANT_SOURCES, *_VARIANT_HEADERS)]
    # the sources' contents are in the key, not their folder: two installs of one release share it
    key = native_build.build_key(files, [*flags, cxx_path, native_build.compiler_version(cxx_path)],
                                 environment=False)
    out = root / "cpu" / f"variants_{key}" / "libkvmulti_cpu_variants.a"
    units = [[cxx_path, *flags, "-I", str(src), "-c", str(src / n), "-o", "{obj}"] for n in _VARIANT_SOURCES]
    return native_build.locked_build(out, [ar, "rcs", "{tmp}", "{objs}"],
                                     "the native CPU attention kernel's ISA variants (about a minute)", units=units)


def build_for_wheel(src: Path, dest: Path) -> tuple[Path | None, str]:
    """Build the kernel from ``src`` (the tree a wheel is made from) and put it with its manifest
    into ``dest`` (the wheel's ``kvmulti/_prebuilt/cpu``): (library, what happened); (None, why not)."""
    try:
        src, files, cflags, ldflags = build_inputs(src)
    except FileNotFoundError as exc:
        return None, str(exc)
    sources = prebuilt.sources_hash(files, cflags + ldflags)
    module, reason, _ = build_jit(src, files, cflags, ldflags)
    if module is None:
        return None, reason or "no module"
    cxx_path = native_build.cxx_compiler()[1] or ""
    target = prebuilt.write(Path(module.__file__), module.__name__, sources, native_build.compiler_version(cxx_path),
                            dest)
    return target, f"CPU kernel {module.__name__} ({', '.join(module.available_isas())} usable here) -> {target}"
