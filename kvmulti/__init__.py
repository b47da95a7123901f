"""kvmulti: one paged-attention API and KV-cache layout for HIP, SYCL, Triton and CPU.

``import kvmulti`` needs only torch: Triton, the SYCL runtime and the HIP library load lazily
inside the backend that needs them.
"""

from .backends import AttentionConfig, Backend, BackendSelectionError, available_backends, register_backend, select_backend
from .backends.registry import ROLES
from .fp8 import FP8_DTYPES
from .layout import KVCacheLayout, LayoutStrides
from .metadata import CommonAttentionMetadata
from .backends.base import StepMetadata
from .ops import paged_attention, prepare_step, resolve_backend, write_kv
from .platform import register_platform

__version__ = "0.1.0"

__all__ = ["AttentionConfig", "AttentionSpec", "Backend", "BackendSelectionError", "CommonAttentionMetadata",
           "FP8_DTYPES", "KVCacheConfig", "KVCacheLayout", "LayoutStrides", "ModelRunner", "ROLES", "SpeculativeRunner",
           "StepMetadata", "available_backends", "paged_attention", "prepare_step", "register_backend",
           "register_platform", "resolve_backend", "select_backend", "write_kv"]


_LAZY = {"SpeculativeRunner": "kvmulti.spec_decode.runner", "ModelRunner": "kvmulti.engine",
         "KVCacheConfig": "kvmulti.kv_cache", "AttentionSpec": "kvmulti.kv_cache"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvmulti' has no attribute {name!r}")
