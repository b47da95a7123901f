"""TRITON backend: the kernels in ``kvmulti.triton_kernels`` (NVIDIA, AMD and Intel GPUs).

Triton is imported lazily: importing this module on a host without triton works, and the backend
then reports why it is unusable. On a CPU-only host it runs only under Triton's interpreter
(``TRITON_INTERPRET=1``, for verification), and only when named: the ``cpu`` priority list holds
just CPU.

Split-KV (the shared ``partition_size`` contract): -1 uses the heuristic of
``kvmulti.backends.triton.launch.plan_attention`` with partitions of
``settings.DEFAULT_PARTITION_SIZE`` keys, 0 never splits, N (a power of two >= 16) always splits.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

import torch

from ... import settings
from ...capture import CaptureBucket
from ...layout import KVCacheLayout
from ...metadata import CommonAttentionMetadata
from ..base import ALL_DTYPES, FP8_DTYPES, Backend, StepMetadata


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


def _kernels():
    return importlib.import_module("kvmulti.backends.triton.launch")


class TritonBackend(Backend):
    name = "TRITON"
    platforms = ("cuda", "rocm", "xpu")
    dtypes = ALL_DTYPES + FP8_DTYPES    # fp8 caches, OCP and FNUZ: triton_kernels/fp8.py
    max_head_size = 256          # any head size up to 256 (padded to a power of two in the kernel)
    supports_sinks = True        # added where a row is normalised (triton_kernels/unified_attention.py)
    supports_non_causal = True   # every row sees its request's seq_len keys (encoder-only attention)
    supports_alibi = True        # added where scores are formed (triton_kernels/unified_attention.py)
    supports_capture = True      # fixed launches per bucket, lengths read on the device (prepared.py)

    def __init__(self, partition_size: int | None = None):
        super().__init__(partition_size)
        p = self.partition_size
        if p > 0 and (p < 16 or p & (p - 1)):
            raise ValueError(f"TRITON needs a split-KV partition size that is a power of two >= 16, got {p} "
                             "(KVMULTI_PARTITION_SIZE)")

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

    def _split(self) -> tuple[bool | None, int]:
        """(split_kv, partition size) of the launch code for this backend's ``partition_size``."""
        if self.partition_size < 0:
            return None, settings.DEFAULT_PARTITION_SIZE
        if self.partition_size == 0:
            return False, settings.DEFAULT_PARTITION_SIZE
        return True, self.partition_size

    def plan(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
             sliding_window: int | None):
        return self._plan(common, layout, num_query_heads, sliding_window, common.num_reqs, common.max_query_len,
                          common.max_seq_len)

    def capture_plan(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
                     sliding_window: int | None, capture: CaptureBucket):
        """The plan for the bucket's maxima: its requests, longest query and longest sequence (split-KV
        partitions cover the bucket's max_seq_len). Every cache TRITON serves (fp8 ones included: the
        layer's scales are launch arguments of its step calls) but a latent one, which has no step calls."""
        if layout.is_latent:
            raise ValueError("TRITON prepares steps for graph capture over fp32 / fp16 / bf16 / fp8 caches, not a "
                             "latent cache")
        return self._plan(common, layout, num_query_heads, sliding_window, capture.max_num_seqs,
                          capture.max_query_len, capture.max_seq_len)

    def _plan(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
              sliding_window: int | None, num_reqs: int, max_query_len: int, max_seq_len: int):
        launch = _kernels()
        split_kv, partition = self._split()
        # keys past the table's width are never read (the kernel stops there)
        max_seq_len = max(0, min(max_seq_len, common.block_table.shape[1] * layout.block_size))
        return launch.plan_attention(
            num_reqs=num_reqs, num_kv_heads=layout.num_kv_heads,
            num_qpk=num_query_heads // layout.num_kv_heads, max_query_len=max_query_len,
            max_seq_len=max_seq_len, head_size=layout.head_size, head_size_v=layout.value_size,
            dtype=layout.dtype, num_compute_units=launch.num_compute_units(common.device),
            block_size=layout.block_size, split_kv=split_kv,
            partition_size=partition, family=launch.device_family(common.device), sliding_window=sliding_window,
            arch=launch.device_arch(common.device))

    def prepared_calls(self, step: StepMetadata):
        """The step's launches (prepared.py): a layer call's checks and kernel launches with the
        argument lists, grids and split-KV workspace made once per step (an fp8 cache's scales are
        per-layer launch arguments). None for latent caches, which take :meth:`paged_attention`'s
        launches per call."""
        if step.layout.is_latent:
            return None
        return importlib.import_module("kvmulti.backends.triton.prepared").TritonStepCalls(step, step.common.device)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                 slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        s = layout.strides(kv_cache)
        _kernels().write_kv(key, value, kv_cache, slot_mapping, cache_strides=(s.block, s.token, s.head),
                            block_size=layout.block_size, num_kv_heads=layout.num_kv_heads,
                            head_size=layout.head_size, head_size_v=layout.value_size, k_scale=k_scale,
                            v_scale=v_scale)

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, step: StepMetadata, scale: float,
                        softcap: float | None, out: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> None:
        if step.calls is not None:
            # the step's own launches (for a step prepared for capture: the bucket's)
            step.calls.run_attention(query, kv_cache, out, scale, softcap or 0.0, sinks, alibi_slopes, k_scale,
                                     v_scale)
            return
        if step.capture is not None:
            raise ValueError("a step prepared for graph capture launches through its own calls (StepMetadata.calls)")
        layout, common = step.layout, step.common
        s = layout.strides(kv_cache)
        _kernels().unified_attention(
            query, kv_cache, out, common.query_start_loc, common.seq_lens, common.block_table,
            cache_strides=(s.block, s.token, s.head), block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads, head_size=layout.head_size, head_size_v=layout.value_size,
            num_reqs=common.num_reqs, num_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len, max_seq_len=common.max_seq_len, scale=scale,
            sliding_window=step.sliding_window, softcap=softcap, plan=step.plan, k_scale=k_scale, v_scale=v_scale,
            sinks=sinks, alibi_slopes=alibi_slopes, causal=common.causal)
