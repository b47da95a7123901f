"""The SYCL backend: kernels in ``sycl/`` compiled at run time for the device that runs them."""

from .backend import Plan, SyclBackend, SyclStep, check_cache_alignment, plan_attention
from .kernel_config import RB, ROWS, SG, WG, choose_wg, kernel_options, lm_floats, prefill_lm_floats, vector_bytes
from .runtime import (SyclBuildError, SyclError, default_session, find_runtime, get_runtime, kernel_source,
                      list_devices, runtime_reasons, source_dir)
from .usm import usm_allocator, usm_empty

__all__ = ["RB", "ROWS", "SG", "WG", "Plan", "SyclBackend", "SyclBuildError", "SyclError", "SyclStep", "check_cache_alignment",
           "choose_wg", "vector_bytes",
           "default_session", "find_runtime", "get_runtime", "kernel_options", "kernel_source", "list_devices",
           "lm_floats", "plan_attention", "prefill_lm_floats", "runtime_reasons", "source_dir", "usm_allocator", "usm_empty"]


def register() -> None:
    """Add SYCL to kvmulti's registry: tried on Intel GPUs before TRITON; on CPU tensors (OpenCL CPU device) only when named."""
    from ..registry import register_backend
    register_backend("SYCL", SyclBackend, platforms=("xpu",), priority=20)
