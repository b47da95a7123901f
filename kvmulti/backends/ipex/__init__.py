"""IPEX backend: Intel Extension for PyTorch's paged-attention kernels on kvmulti's canonical layout."""

from .backend import IpexBackend
from .library import ipex_status

__all__ = ["IpexBackend", "ipex_status"]


def register() -> None:
    """Add IPEX to kvmulti's registry: tried only when named (slower than CPU on the hosts measured; XPU not served)."""
    from ..registry import register_backend
    register_backend("IPEX", IpexBackend)
