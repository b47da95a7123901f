"""kvmulti: one paged-attention API and KV-cache layout for HIP, SYCL, Triton and CPU.

``import kvmulti`` imports nothing else: each public name loads its module (and torch) at first
use; Triton, the SYCL runtime and the HIP library load inside the backend that needs them.
"""

__version__ = "0.1.0"

__all__ = ["AttentionConfig", "AttentionSpec", "BackendSelectionError", "CommonAttentionMetadata", "KVCacheConfig",
           "KVCacheLayout", "LayoutStrides", "ModelRunner", "SpeculativeRunner", "StepMetadata", "available_backends", "paged_attention", "prepare_step",
           "register_backend", "register_platform", "select_backend", "write_kv"]


#: every public name and the module that defines it, imported at first use (``kvmulti --help``
#: and ``import kvmulti.settings`` stay free of torch)
_LAZY = {"AttentionConfig": "kvmulti.backends", "BackendSelectionError": "kvmulti.backends",
         "available_backends": "kvmulti.backends", "register_backend": "kvmulti.backends",
         "select_backend": "kvmulti.backends", "KVCacheLayout": "kvmulti.layout", "LayoutStrides": "kvmulti.layout",
         "CommonAttentionMetadata": "kvmulti.metadata", "StepMetadata": "kvmulti.backends.base",
         "paged_attention": "kvmulti.ops", "prepare_step": "kvmulti.ops", "write_kv": "kvmulti.ops",
         "register_platform": "kvmulti.platform",
         "SpeculativeRunner": "kvmulti.spec_decode.runner", "ModelRunner": "kvmulti.engine",
         "KVCacheConfig": "kvmulti.kv_cache", "AttentionSpec": "kvmulti.kv_cache"}


def __getattr__(name: str):
    import importlib
    import importlib.util
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")     # a submodule, as eager imports made it
    raise AttributeError(f"module 'kvmulti' has no attribute {name!r}")
