"""CPU backend: the native kernel (``cpu/``, loaded or built by :mod:`.native` when the backend is
constructed) with the vectorised torch path (:mod:`.torch_path`) as the fallback when it cannot be built.

Both read the canonical layout in place through its named strides; ``describe()`` says which path
runs and why (``kvmulti info``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import host_memory, settings
from ...layout import KVCacheLayout
from ...metadata import CommonAttentionMetadata
from ..base import ALL_DTYPES, FNUZ_FP8_DTYPES, FP8_DTYPES, Backend, StepMetadata
from . import native
from .torch_path import paged_attention_torch, write_kv_torch

#: partition_len the native kernel takes to mean "never split" (longer than any key range).
NEVER_SPLIT = 2**62


@dataclass(frozen=True)
class CPUPlan:
    """Host tensors the native kernel reads, made once per step (int32, contiguous)."""

    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    partition_len: int      # 0: the kernel decides; NEVER_SPLIT: one partition
    module: object          # the native module, or None: the torch path runs this step
    isa: int                # the native variant's code (native.ISAS)
    cache_args: tuple       # ((strides, sizes), window, causal) as the kernel takes them


def _contiguous_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` itself when it already is a contiguous ``dtype`` tensor (no per-call copies)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride()[-1] == 1 or t.shape[-1] <= 1 else t.contiguous()


class CPUBackend(Backend):
    name = "CPU"
    platforms = ("cpu",)
    #: fp8 FNUZ caches run on the torch path: the native kernel's fp8 loads decode the OCP formats
    dtypes = ALL_DTYPES + FP8_DTYPES
    supports_latent = True
    supports_non_causal = True
    supports_sinks = True
    supports_alibi = True

    def __init__(self, partition_size: int | None = None, native_kernel: bool | None = None,
                 isa: str | None = None):
        """``native_kernel``: use the native kernel when it builds (default ``KVMULTI_CPU_NATIVE``);
        False always takes the torch path. ``isa``: the native variant (default ``KVMULTI_CPU_ISA``,
        else the best this CPU runs). Read once, here: calls never consult the environment."""
        super().__init__(partition_size)
        self.native_kernel = settings.get("KVMULTI_CPU_NATIVE") if native_kernel is None else bool(native_kernel)
        self.isa = settings.get("KVMULTI_CPU_ISA") if isa is None else isa
        self._native_variant: tuple[object, int] | None = None
        if self.native_kernel:
            native.status()    # load (or build) now: never inside an attention call

    def module(self):
        """The loaded native module, or None when the torch path runs."""
        return native.load() if self.native_kernel else None

    def _variant(self) -> tuple[object, int]:
        """The native module and its ISA variant's code (native.ISAS), or (None, 0) on the torch
        path; the variant is looked up again only when `native.load()` hands back another module."""
        module = self.module()
        if module is None:
            return None, 0
        found = self._native_variant
        if found is None or found[0] is not module:
            found = self._native_variant = (module, native.ISAS[native.selected_isa(module, self.isa)])
        return found

    def describe(self) -> str:
        pages = "2 MiB pages" if host_memory.huge_pages_usable() else "4 KiB pages"
        path = (native.describe(self.isa) if self.native_kernel else
                "vectorised torch: native kernel disabled (KVMULTI_CPU_NATIVE=0 or native_kernel=False)")
        return (f"cpu: {path}; caches from layout.allocate() in {pages} "
                f"(transparent huge pages: {host_memory.transparent_huge_pages()})")

    def plan(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
             sliding_window: int | None) -> CPUPlan:
        part = {-1: 0, 0: NEVER_SPLIT}.get(self.partition_size, self.partition_size)
        module, isa = (None, 0) if layout.dtype in FNUZ_FP8_DTYPES else self._variant()
        s = layout.expected_strides()
        cache_args = (s.block, s.token, s.head, layout.head_size, layout.value_size, layout.num_kv_heads,
                      layout.block_size)
        return CPUPlan(_contiguous_as(common.block_table, torch.int32),
                       _contiguous_as(common.query_start_loc_cpu, torch.int32),
                       _contiguous_as(common.seq_lens_cpu, torch.int32), part, module, isa,
                       (cache_args, int(sliding_window or 0), bool(common.causal)))

    def prepared_calls(self, step: StepMetadata):
        """The native module's ``PreparedStep`` (cpu/prepared_step.cpp): a layer call's checks and
        kernel launch in one C++ call. None on the torch path and for fp8 and latent caches."""
        layout, plan = step.layout, step.plan
        if plan.module is None or layout.is_latent or layout.dtype in FP8_DTYPES:
            return None
        _, window, causal = plan.cache_args
        dtype, sizes, strides = layout._exact_signature
        return plan.module.PreparedStep(plan.block_table, plan.query_start_loc, plan.seq_lens, dtype, list(sizes),
                                        list(strides), layout.num_kv_heads, layout.head_size, layout.value_size,
                                        layout.block_size, step.num_query_heads, step.common.num_actual_tokens,
                                        window, causal, plan.partition_len, plan.isa)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                 layout: KVCacheLayout, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        module = None if layout.dtype in FNUZ_FP8_DTYPES else self.module()
        if module is None:
            write_kv_torch(key, value, kv_cache, layout, slot_mapping, k_scale, v_scale)
            return
        s = layout.expected_strides()
        key = _last_dim_contiguous(key)
        value = key if layout.is_latent or value is None else _last_dim_contiguous(value)
        args = (key, value, kv_cache, _contiguous_as(slot_mapping, torch.int64), s.block, s.token, s.head,
                layout.head_size, 0 if layout.is_latent else layout.value_size, layout.block_size)
        if k_scale is None:
            module.write_kv(*args)
        else:   # an fp8 cache: quantised in the native loop (kvmulti/fp8.py's rule)
            module.write_kv_fp8(*args, k_scale, k_scale if v_scale is None else v_scale)

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, step: StepMetadata, scale: float,
                        softcap: float | None, out: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> None:
        layout, common, plan = step.layout, step.common, step.plan
        if layout.is_latent or common.num_actual_tokens == 0:
            return
        module = plan.module
        if module is None:
            paged_attention_torch(query, kv_cache, layout, common, scale, step.sliding_window, softcap, out,
                                  k_scale, v_scale, sinks, alibi_slopes)
            return
        cache_args, window, causal = plan.cache_args
        target = out if out.stride()[-1] == 1 else torch.zeros_like(out, memory_format=torch.contiguous_format)
        module.paged_attention(_last_dim_contiguous(query), kv_cache, target, plan.block_table, plan.query_start_loc,
                               plan.seq_lens, *cache_args, float(scale), window, float(softcap or 0.0), causal,
                               plan.partition_len, plan.isa, k_scale, v_scale, sinks, alibi_slopes)
        if target is not out:
            out.copy_(target)
