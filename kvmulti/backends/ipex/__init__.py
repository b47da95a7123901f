"""IPEX backend: Intel Extension for PyTorch's paged-attention kernels on kvmulti's canonical layout."""

from .backend import IpexBackend
from .library import ipex_status

__all__ = ["IpexBackend", "ipex_status"]
