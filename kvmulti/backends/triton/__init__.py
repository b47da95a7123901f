"""The TRITON backend: kernels in ``triton_kernels/`` (NVIDIA, AMD and Intel GPUs)."""

from .backend import TritonBackend, interpreting

__all__ = ["TritonBackend", "interpreting"]
