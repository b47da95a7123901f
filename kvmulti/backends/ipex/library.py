"""Finding Intel Extension for PyTorch (IPEX): installed?, importable?, which torch it needs.

IPEX is imported lazily and at most once per process: importing it is slow (it loads its kernels)
and fails when the installed torch is not the release it was built for.
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass

import torch

DISTRIBUTION = "intel-extension-for-pytorch"


@dataclass(frozen=True)
class IpexStatus:
    """What this host has: ``version`` (None: not installed), ``needs_torch`` (the torch release
    series that IPEX release requires, e.g. ``2.8.*``) and, when it cannot be used, ``reason``."""

    version: str | None
    needs_torch: str | None
    reason: str | None

    def describe(self) -> str:
        """One line for ``kvmulti info``."""
        if self.version is None:
            return f"{DISTRIBUTION} not installed (the IPEX venv: scripts/setup.sh --test makes .venv-ipex)"
        state = "importable" if self.reason is None else "not importable"
        return (f"{DISTRIBUTION} {self.version} {state}; it needs torch {self.needs_torch}, "
                f"this torch is {torch.__version__}")


def required_torch_series(ipex_version: str) -> str:
    """IPEX release X.Y.* is built against torch X.Y.* and refuses any other torch at import."""
    major, minor = ipex_version.split("+")[0].split(".")[:2]
    return f"{major}.{minor}.*"


def torch_matches(ipex_version: str, torch_version: str = torch.__version__) -> bool:
    return torch_version.split("+")[0].split(".")[:2] == ipex_version.split("+")[0].split(".")[:2]


@functools.lru_cache(maxsize=None)
def ipex_status() -> IpexStatus:
    """Whether IPEX can be used in this process (imports it once when the versions match)."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return IpexStatus(None, None, f"{DISTRIBUTION} is not installed here; the IPEX backend runs in the "
                                      "venv scripts/setup.sh --test makes (.venv-ipex: torch 2.8 + IPEX 2.8)")
    needs = required_torch_series(version)
    if not torch_matches(version):
        return IpexStatus(version, needs, f"{DISTRIBUTION} {version} needs torch {needs}, this torch is "
                                          f"{torch.__version__}")
    try:
        paged_attention_module()
    except Exception as exc:   # ImportError, or IPEX's own check of the CPU / torch build
        return IpexStatus(version, needs, f"importing {DISTRIBUTION} {version} failed "
                                          f"({type(exc).__name__}: {str(exc).strip()[:200]})")
    return IpexStatus(version, needs, None)


@functools.lru_cache(maxsize=None)
def paged_attention_module():
    """``intel_extension_for_pytorch.llm.modules.PagedAttention`` (imports IPEX)."""
    from intel_extension_for_pytorch.llm.modules import PagedAttention
    return PagedAttention
