"""The HIP backend: kernels in ``hip/`` on ROCm, or on kvmulti's HIP-on-CPU harness when named."""

from .backend import HEAD_SIZES, HipBackend, HipPlan
from .build import (HipBuildError, build_cpu_library, build_harness_library, build_rocm_library, cpu_library_path,
                    harness_library_path, source_dir)
from .library import ABI_VERSION, load_cpu_library

__all__ = ["ABI_VERSION", "HEAD_SIZES", "HipBackend", "HipBuildError", "HipPlan", "build_cpu_library",
           "build_harness_library", "build_rocm_library", "cpu_library_path", "harness_library_path",
           "load_cpu_library", "source_dir"]


def register() -> None:
    """Add HIP to kvmulti's registry: tried on ROCm before TRITON; on CPU tensors (the harness) only when named."""
    from ..registry import register_backend
    register_backend("HIP", HipBackend, platforms=("rocm",), priority=20)
