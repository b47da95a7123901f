"""TRITON backend: the kernels in ``kvmulti.triton_kernels`` (NVIDIA, AMD and Intel GPUs).

Triton is imported lazily: importing this module on a host without triton works, and the
backend then reports why it is unusable. On a CPU-only host it runs only under Triton's
interpreter (``TRITON_INTERPRET=1``, for verification), and only when named explicitly: the
``cpu`` priority list holds just CPU.

Path choice: ``KVMULTI_TRITON_SPLIT_KV`` = ``1`` forces the split-KV decode path, ``0`` the
single pass; unset or ``auto`` uses the heuristic in ``kvmulti.triton_kernels.launch``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

import torch

from ..layout import KVCacheLayout
from ..metadata import CommonAttentionMetadata
from .base import Backend

ENV_SPLIT_KV = "KVMULTI_TRITON_SPLIT_KV"
#: Key positions per split-KV partition (a power of two >= 16); tests lower it.
PARTITION_SIZE = 512


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def _import_reasons() -> tuple[str, ...]:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return (f"triton is not importable ({type(exc).__name__}: {exc}); pip install 'kvmulti[triton]'",)
    return ()


@functools.lru_cache(maxsize=None)
def _driver_reasons() -> tuple[str, ...]:
    try:
        from triton.runtime import driver
        driver.active.get_current_target()
    except Exception as exc:
        return (f"triton has no active GPU driver ({type(exc).__name__}: {str(exc).strip()[:200]}); "
                "set TRITON_INTERPRET=1 to run the kernels on CPU tensors",)
    return ()


def _mode_reasons() -> list[str]:
    """The kernels are interpreted or compiled as TRITON_INTERPRET said when they were imported;
    a later change of the variable cannot take effect in this process."""
    module = sys.modules.get("kvmulti.triton_kernels.unified_attention")
    if module is None:
        return []
    interpreted = type(module.unified_attention_kernel).__name__ == "InterpretedFunction"
    if interpreted == interpreting():
        return []
    was, now = ("set", "unset") if interpreted else ("unset", "set")
    return [f"the Triton kernels were loaded with TRITON_INTERPRET {was} and it is now {now}; set it before "
            "the first TRITON call (ideally before starting Python)"]


def split_kv_override() -> bool | None:
    value = os.environ.get(ENV_SPLIT_KV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "split", "on"):
        return True
    if value in ("0", "false", "single", "off"):
        return False
    raise ValueError(f"{ENV_SPLIT_KV}={value!r}: expected 1 (split-KV), 0 (single pass) or auto")


def _kernels():
    return importlib.import_module("kvmulti.triton_kernels.launch")


class TritonBackend(Backend):
    name = "TRITON"
    platforms = ("cuda", "rocm", "xpu")
    max_head_size = 256          # any head size up to 256 (padded to a power of two in the kernel)
    last_plan = None             # the AttentionPlan (tiles, path) of the latest attention call

    def unavailable_reasons(self) -> list[str]:
        reasons = list(_import_reasons())
        if reasons:
            return reasons
        if not interpreting():
            reasons += _driver_reasons()
        return reasons + _mode_reasons()

    def platform_reasons(self, platform: str) -> list[str]:
        if platform == "cpu":
            if interpreting():
                return []
            return ["TRITON runs on CPU tensors only under the Triton interpreter (set TRITON_INTERPRET=1)"]
        return super().platform_reasons(platform)

    def describe(self) -> str:
        version = ""
        if not _import_reasons():
            import triton
            version = f"triton {triton.__version__}: "
        if interpreting():
            return version + "interpreter (TRITON_INTERPRET=1): CPU tensors, for verification"
        return version + ", ".join(self.platforms)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                 slot_mapping: torch.Tensor) -> None:
        s = layout.strides(kv_cache)
        _kernels().write_kv(key, value, kv_cache, slot_mapping, cache_strides=(s.block, s.token, s.head),
                            block_size=layout.block_size, num_kv_heads=layout.num_kv_heads,
                            head_size=layout.head_size, head_size_v=layout.value_size)

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                        metadata: CommonAttentionMetadata, scale: float, sliding_window: int | None,
                        softcap: float | None, out: torch.Tensor, split_kv: bool | None = None) -> None:
        s = layout.strides(kv_cache)
        self.last_plan = _kernels().unified_attention(
            query, kv_cache, out, metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
            cache_strides=(s.block, s.token, s.head), block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads, head_size=layout.head_size, head_size_v=layout.value_size,
            num_reqs=metadata.num_reqs, num_tokens=metadata.num_actual_tokens,
            max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len, scale=scale,
            sliding_window=sliding_window, softcap=softcap,
            split_kv=split_kv_override() if split_kv is None else split_kv, partition_size=PARTITION_SIZE)
