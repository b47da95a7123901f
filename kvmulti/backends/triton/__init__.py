"""The TRITON backend: kernels in ``triton_kernels/`` (NVIDIA, AMD and Intel GPUs)."""

from .backend import TritonBackend, interpreting

__all__ = ["TritonBackend", "interpreting"]


def register() -> None:
    """Add TRITON to kvmulti's registry: tried on every GPU platform; on CPU tensors (the interpreter) only when named."""
    from ..registry import register_backend
    register_backend("TRITON", TritonBackend, platforms=("cuda", "rocm", "xpu"), priority=10)
