"""The SYCL backend: kernels in ``sycl/`` compiled at run time for the device that runs them."""

from .backend import ROWS, WG, Plan, SyclBackend, SyclStep, choose_kc, kernel_options, lm_floats, plan_attention
from .runtime import (SyclBuildError, SyclError, default_session, find_runtime, get_runtime, kernel_source,
                      list_devices, runtime_reasons, source_dir, usm_allocator, usm_empty)

__all__ = ["ROWS", "WG", "Plan", "SyclBackend", "SyclBuildError", "SyclError", "SyclStep", "choose_kc",
           "default_session", "find_runtime", "get_runtime", "kernel_options", "kernel_source", "list_devices",
           "lm_floats", "plan_attention", "runtime_reasons", "source_dir", "usm_allocator", "usm_empty"]
