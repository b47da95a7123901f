"""``kvmulti build [--backend NAME | --all]``: build (or load) now the native code this host can
run, with a line per step, so that no later call waits on a compiler."""

from __future__ import annotations

import argparse
import time
from typing import Callable


def _cpu() -> tuple[bool, str]:
    from . import settings
    from .backends.cpu import native
    if not settings.get("KVMULTI_CPU_NATIVE"):
        return False, "not built: KVMULTI_CPU_NATIVE=0"
    module, reason = native.status()
    if module is None:
        return False, f"not built: {reason}"
    return True, f"native kernel, {native.origin()}; variants usable here: {', '.join(module.available_isas())}"


def _hip() -> tuple[bool, str]:
    import torch

    from .backends.hip import build
    if torch.version.hip:
        if build.hipcc() is None:
            return False, "not built: hipcc not found"
        return True, f"ROCm library {build.build_rocm_library()}"
    reasons = build.cpu_harness_reasons()
    if reasons:
        return False, "not built (no ROCm torch; CPU harness: " + "; ".join(reasons) + ")"
    return True, f"CPU harness (emulator; no ROCm torch here) {build.build_cpu_library()}"


def _sycl() -> tuple[bool, str]:
    from .backends.sycl import runtime
    root, reasons = runtime.find_runtime()
    if root is None:
        return False, "not built: " + "; ".join(reasons)
    if runtime.compiler() is None:
        return False, "not built: no C++ compiler for the SYCL host shim"
    return True, f"SYCL host shim {runtime.build_shim(root)} (kernels compile per shape at first use, cached)"


BUILDERS: dict[str, Callable[[], tuple[bool, str]]] = {"CPU": _cpu, "HIP": _hip, "SYCL": _sycl}
NOTHING_TO_BUILD = {"TRITON": "nothing to build ahead (Triton compiles a kernel at its first launch and caches it)",
                    "IPEX": "nothing to build (Intel's prebuilt extension)"}


def add_build_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build now the native kernels this host can run (default: all)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--backend", metavar="NAME", help="one backend (a name `kvmulti info` lists)")
    group.add_argument("--all", action="store_true", help="every backend (the default)")
    p.set_defaults(func=cmd_build)


def cmd_build(args: argparse.Namespace) -> int:
    """Exit 0 when every named backend was built or had nothing to build; 1 when the one named
    with ``--backend`` could not be built. ``--all`` reports each and exits 0."""
    from .backends.registry import backend_names, canonical_name
    names = [canonical_name(args.backend)] if args.backend else list(backend_names())
    failed = False
    for name in names:
        print(f"kvmulti build: {name} ...", flush=True)
        start = time.perf_counter()
        if name in BUILDERS:
            try:
                ok, what = BUILDERS[name]()
            except Exception as error:   # a compiler error: reported, the next backend still builds
                ok, what = False, f"build failed: {type(error).__name__}: {' '.join(str(error).split())[:300]}"
        else:
            ok, what = True, NOTHING_TO_BUILD.get(name, "nothing kvmulti knows how to build ahead")
        failed |= not ok
        print(f"kvmulti build: {name}: {what} [{time.perf_counter() - start:.1f} s]", flush=True)
    return 1 if failed and args.backend else 0
