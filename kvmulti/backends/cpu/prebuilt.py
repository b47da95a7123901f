"""The CPU kernel a wheel carries: written at wheel build time, loaded instead of a JIT build when
it fits this interpreter exactly.

A wheel built where torch and a C++ compiler are importable / on PATH (``pip wheel
--no-build-isolation .``, ``pip install --no-build-isolation .``) holds
``kvmulti/_prebuilt/cpu/<module>.so`` and ``manifest.json``. The manifest's ``abi`` is the key the
binary was built for; the binary is loaded only when every entry equals this interpreter's:

- ``machine``: ``platform.machine()`` (the ISA family; its variants are chosen by cpuid at run time)
- ``ext_suffix``: Python's extension suffix (interpreter version, ABI flags, platform)
- ``torch``: ``torch.__version__``, exactly; ``cxx11_abi``: ``torch.compiled_with_cxx11_abi()``
- ``sources``: a hash of the kernel sources this installed package holds and the compiler flags
  (``KVMULTI_CPU_EXTRA_CFLAGS`` / ``KVMULTI_SANITIZE`` change the flags, so they always JIT-build)

Any difference, an unreadable manifest or a binary that fails to import is a reason, never an
error: :mod:`.native` then builds the kernel itself (the JIT fallback).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import platform
import shutil
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

MANIFEST = "manifest.json"


def prebuilt_dir() -> Path:
    """Where an installed wheel keeps its prebuilt CPU kernel: ``kvmulti/_prebuilt/cpu``."""
    return Path(__file__).resolve().parents[2] / "_prebuilt" / "cpu"


def sources_hash(files: list[Path], flags: list[str]) -> str:
    """16 hex digits over the files' names and contents and the compiler flags."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for flag in flags:
        h.update(flag.encode() + b"\0")
    return h.hexdigest()[:16]


def abi_key(sources: str) -> dict[str, object]:
    """The ABI key of this interpreter for kernel sources hashed to ``sources``."""
    return {"machine": platform.machine(), "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
            "torch": torch.__version__, "cxx11_abi": bool(torch.compiled_with_cxx11_abi()), "sources": sources}


def write(library: Path, module_name: str, sources: str, compiler: str, dest: Path) -> Path:
    """Copy the built ``library`` (Python module ``module_name``) to ``dest`` with its manifest."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / f"{module_name}.so"
    shutil.copy2(library, target)
    manifest = {"module": module_name, "file": target.name, "compiler": compiler, "abi": abi_key(sources)}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return target


def load(sources: str, directory: Path | None = None) -> tuple[ModuleType | None, str]:
    """(module, where it came from) when the prebuilt kernel fits; (None, why not) otherwise."""
    directory = prebuilt_dir() if directory is None else directory
    path = directory / MANIFEST
    if not path.is_file():
        return None, "no prebuilt kernel in this install"
    try:
        manifest = json.loads(path.read_text())
        built_for, name, library = manifest["abi"], manifest["module"], directory / manifest["file"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"prebuilt kernel's manifest is unreadable ({exc})"
    here = abi_key(sources)
    differ = [f"{k} {built_for.get(k)!r}, here {v!r}" for k, v in here.items() if built_for.get(k) != v]
    if differ:
        return None, f"prebuilt kernel does not fit ({'; '.join(differ)})"
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(library))
        spec = importlib.util.spec_from_file_location(name, str(library), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except Exception as exc:   # ImportError, undefined symbols, a missing libgomp, ...
        return None, f"prebuilt kernel failed to load ({type(exc).__name__}: {exc})"
    return module, f"prebuilt ({library})"
