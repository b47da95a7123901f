"""The engine on top of the library: one model's requests (:mod:`.requests`), their block allocation
(:mod:`.blocks`), the inputs of a step (:mod:`.batch`) and the runner that prepares and runs steps
(:mod:`.runner`), built on kvmulti's public ops. The library never imports this package."""

from .batch import StepBatch
from .requests import Request
from .runner import (DEFAULT_KV_MEMORY_BYTES, KV_CACHE_DTYPES, ModelRunner, OutOfBlocksError,
                     resolve_kv_cache_dtype)

__all__ = ["DEFAULT_KV_MEMORY_BYTES", "KV_CACHE_DTYPES", "ModelRunner", "OutOfBlocksError", "Request", "StepBatch",
           "resolve_kv_cache_dtype"]
