"""Imported first by the scripts tests/test_vllm_engine.py runs in vLLM's venv: points that venv's
editable mapping of kvmulti and its kernel folders (``kvmulti.cpu_src`` and the others, which name
the lead's checkout) at the checkout this file lives in, for the running process only, so the
kernels under test are built from the sources next to it. :func:`sources` says where they came from."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kvmulti": "kvmulti", "kvmulti.cpu_src": "cpu", "kvmulti.hip_src": "hip", "kvmulti.sycl_src": "sycl",
           "kvmulti.triton_kernels": "triton_kernels"}

for _name, _module in list(sys.modules.items()):
    if _name.startswith("__editable___kvmulti") and isinstance(getattr(_module, "MAPPING", None), dict):
        _module.MAPPING.update({package: str(ROOT / folder) for package, folder in FOLDERS.items()})


def sources() -> dict:
    """{"kvmulti": its __init__ file, "cpu_src": its folders}; SystemExit when not from this checkout."""
    import kvmulti
    import kvmulti.cpu_src
    found = {"kvmulti": kvmulti.__file__, "cpu_src": list(kvmulti.cpu_src.__path__)}
    if not all(str(p).startswith(str(ROOT)) for p in (found["kvmulti"], *found["cpu_src"])):
        raise SystemExit(f"kvmulti not imported from {ROOT}: {found}")
    return found
