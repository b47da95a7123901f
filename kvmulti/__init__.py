"""kvmulti: one paged-attention API and KV-cache layout for HIP, SYCL, Triton and CPU.

``import kvmulti`` imports nothing else, so ``kvmulti --help`` and ``import kvmulti.settings`` stay
free of torch. The first use of any public name imports the library core (torch, and
``kvmulti.ops``, which registers the ``torch.ops.kvmulti`` custom ops) and the name's module; Triton,
the SYCL runtime and the HIP library load inside the backend that needs them.
"""

__version__ = "0.1.0"

__all__ = ["AttentionConfig", "AttentionSpec", "Backend", "BackendSelectionError", "CaptureBucket",
           "CommonAttentionMetadata",
           "FP8_DTYPES", "KVCacheConfig", "KVCacheLayout", "LayoutStrides", "ModelRunner", "ROLES", "SpeculativeRunner",
           "StepMetadata", "available_backends", "export_blocks", "import_blocks", "paged_attention", "prepare_step",
           "prepare_steps",
           "register_backend",
           "register_platform", "resolve_backend", "select_backend", "write_kv"]


#: every public name and the module that defines it, imported at first use
_LAZY = {"AttentionConfig": "kvmulti.backends", "Backend": "kvmulti.backends",
         "BackendSelectionError": "kvmulti.backends", "available_backends": "kvmulti.backends",
         "register_backend": "kvmulti.backends", "select_backend": "kvmulti.backends",
         "ROLES": "kvmulti.backends.registry", "FP8_DTYPES": "kvmulti.fp8",
         "CaptureBucket": "kvmulti.capture", "KVCacheLayout": "kvmulti.layout", "LayoutStrides": "kvmulti.layout",
         "CommonAttentionMetadata": "kvmulti.metadata", "StepMetadata": "kvmulti.backends.base",
         "paged_attention": "kvmulti.ops", "prepare_step": "kvmulti.ops",
         "prepare_steps": "kvmulti.ops", "resolve_backend": "kvmulti.ops",
         "write_kv": "kvmulti.ops", "register_platform": "kvmulti.platform",
         "SpeculativeRunner": "kvmulti.spec_decode.runner", "ModelRunner": "kvmulti.engine",
         "KVCacheConfig": "kvmulti.kv_cache", "AttentionSpec": "kvmulti.kv_cache",
         "export_blocks": "kvmulti.interchange", "import_blocks": "kvmulti.interchange"}


def __getattr__(name: str):
    import importlib
    import importlib.util
    if name in _LAZY:
        importlib.import_module("kvmulti.ops")          # the custom ops exist once kvmulti is used
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value                          # later lookups skip this function
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")     # a submodule, as eager imports made it
    raise AttributeError(f"module 'kvmulti' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
