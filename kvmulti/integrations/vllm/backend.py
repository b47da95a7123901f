"""kvmulti as a vLLM attention backend: backend class, metadata builder and layer implementation.

Imported by vLLM (through :data:`kvmulti.integrations.vllm.BACKEND_PATH`), never by kvmulti itself.

* :class:`KvmultiMetadataBuilder` maps vLLM's ``CommonAttentionMetadata`` onto kvmulti's once per
  step per KV-cache group (:class:`KvmultiStepMetadata`); the first layer of the group prepares
  kvmulti's per-step hook (:func:`kvmulti.prepare_step`: validation, backend, plan) and every
  later layer reuses it.
* :class:`KvmultiAttentionImpl` serves a layer: ``forward`` writes the new keys and values and
  fills vLLM's ``output`` buffer in place (``out=``): one call per layer, so vLLM makes no separate
  cache-update call (``forward_includes_kv_cache_update``).
* vLLM hands every layer its cache as a logical ``[num_blocks, H, N, C]`` view (RFC #42082);
  kvmulti's logical order is ``[num_blocks, N, H, C]``, so a layer's cache is read through
  ``transpose(1, 2)``: zero copy, whatever vLLM layout the engine resolved
  (:func:`layout_for_cache` names kvmulti's layout from the view's strides).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionLayer, AttentionMetadataBuilder,
                                       AttentionType, CommonAttentionMetadata as VllmCommonAttentionMetadata,
                                       MultipleOf)
from vllm.v1.kv_cache_layout import KVCacheLayout as VllmKVCacheLayout

from ... import ops
from ...backends.base import Backend, StepMetadata
from ...backends.registry import construct_for
from ...layout import KVCacheLayout
from ...metadata import CommonAttentionMetadata
from . import BACKEND_NAME
from .encoder_only import scratch_step

#: Every vLLM KV-cache layout, all served in place, most preferred first: per-layer before
#: cross-layer, HND interiors (a head's tokens adjacent: the CPU kernel's fastest order) first.
SUPPORTED_VLLM_LAYOUTS: tuple[VllmKVCacheLayout, ...] = (
    VllmKVCacheLayout.LBHNC, VllmKVCacheLayout.LBNHC, VllmKVCacheLayout.BLHNC, VllmKVCacheLayout.BLNHC,
    VllmKVCacheLayout.BHLNC, VllmKVCacheLayout.LHBNC)


#: vLLM's fp8 ``kv_cache_dtype`` names and the cache dtype kvmulti reads them as ("fp8" is e4m3, as
#: on vLLM's CUDA and CPU platforms). vLLM allocates such caches as uint8: kvmulti views the bytes.
FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                                               "fp8_e5m2": torch.float8_e5m2}


def fp8_cache_dtype(kv_cache_dtype: str, fp8_fnuz: bool) -> torch.dtype | None:
    """The cache dtype kvmulti reads vLLM's ``kv_cache_dtype`` as (None: not an fp8 cache).
    ``fp8_fnuz``: vLLM's ``current_platform.is_fp8_fnuz()`` (gfx94x, MI300), where vLLM stores
    "fp8" / "fp8_e4m3" as e4m3fnuz and has already doubled a checkpoint's e4m3fn k/v scales when
    loading them (``vllm/model_executor/layers/quantization/kv_cache.py``): kvmulti then reads
    e4m3fnuz with the layer's scales as they are."""
    dtype = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
    return torch.float8_e4m3fnuz if fp8_fnuz and dtype == torch.float8_e4m3fn else dtype


#: vLLM attention types served: decoder layers over the paged cache, and encoder-only layers
#: (non-causal over the step's own tokens, :mod:`.encoder_only`). ENCODER and ENCODER_DECODER
#: (cross-attention to encoder outputs vLLM keeps outside the paged cache) are not.
SERVED_ATTN_TYPES: tuple[str, ...] = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)


class KvmultiAttentionBackend(AttentionBackend):
    """vLLM's view of kvmulti: which caches and features it serves, and its builder / impl."""

    forward_includes_kv_cache_update: bool = True       # forward writes the step's keys and values first
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_KV_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]                      # kvmulti serves any block size

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[VllmKVCacheLayout, ...]:
        return SUPPORTED_VLLM_LAYOUTS

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True         # every layer's backend is chosen among those serving sinks (gpt-oss)

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in SERVED_ATTN_TYPES

    @staticmethod
    def get_impl_cls() -> type["KvmultiAttentionImpl"]:
        return KvmultiAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["KvmultiMetadataBuilder"]:
        return KvmultiMetadataBuilder


@dataclass
class KvmultiStepMetadata:
    """One step of one KV-cache group: kvmulti's common metadata, and the prepared per-step hook
    of each (layout, query heads, window, backend) its layers ask for (usually exactly one)."""

    common: CommonAttentionMetadata
    prepared: dict = field(default_factory=dict)
    #: The step's slots [num_actual_tokens] (vLLM's slot_mapping may carry padding rows past them).
    slot_mapping: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.slot_mapping = _rows(self.common.slot_mapping, self.common.num_actual_tokens)

    @property
    def num_actual_tokens(self) -> int:
        return self.common.num_actual_tokens

    def step_for(self, layout: KVCacheLayout, num_query_heads: int, sliding_window: int | None,
                 backend: Backend, sinks: bool = False, alibi: bool = False) -> StepMetadata:
        """The prepared step for a layer: built by the group's first such layer, then reused.
        ``sinks`` / ``alibi``: the layer passes attention sinks / ALiBi slopes."""
        key = (layout, num_query_heads, sliding_window, backend.name, sinks, alibi)
        step = self.prepared.get(key)
        if step is None:
            step = ops.prepare_step(self.common, layout, num_query_heads, sliding_window=sliding_window,
                                    backend=backend, check_values=False,     # vLLM's scheduler made the ids
                                    sinks=sinks, alibi_slopes=alibi)
            self.prepared[key] = step
        return step


def _rows(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """``tensor[:n]``, without a new view when it has exactly ``n`` rows (the usual case on CPU)."""
    return tensor if tensor.shape[0] == n else tensor[:n]


def to_kvmulti_metadata(common: VllmCommonAttentionMetadata) -> CommonAttentionMetadata:
    """kvmulti's metadata for vLLM's (zero copy on CPU). vLLM's ``max_seq_len`` may be an upper
    bound, which kvmulti accepts; kvmulti needs an exact host copy of ``seq_lens``: the tensor itself
    on CPU, else one device-to-host copy per step (vLLM keeps no exact host copy on GPU platforms)."""
    if isinstance(common.causal, torch.Tensor):
        raise NotImplementedError("kvmulti: per-request (dynamic) causal masks are not supported")
    seq_lens = common.seq_lens
    seq_lens_cpu = seq_lens if seq_lens.device.type == "cpu" else seq_lens.to("cpu")
    return CommonAttentionMetadata(
        query_start_loc=common.query_start_loc, seq_lens=seq_lens, block_table=common.block_table_tensor,
        slot_mapping=common.slot_mapping, num_reqs=common.num_reqs, num_actual_tokens=common.num_actual_tokens,
        max_query_len=common.max_query_len, max_seq_len=common.max_seq_len, causal=bool(common.causal),
        query_start_loc_cpu=common.query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu)


class KvmultiMetadataBuilder(AttentionMetadataBuilder[KvmultiStepMetadata]):
    """Builds one :class:`KvmultiStepMetadata` per step per KV-cache group (drafts included:
    vLLM's ``build_for_drafting`` calls :meth:`build`)."""

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: VllmCommonAttentionMetadata,
              fast_build: bool = False) -> KvmultiStepMetadata:
        return KvmultiStepMetadata(to_kvmulti_metadata(common_attn_metadata))


def layout_for_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, KVCacheLayout]:
    """kvmulti's view ``[num_blocks, N, H, C]`` of vLLM's per-layer cache ``[num_blocks, H, N, C]``
    (C = head_size + head_size_v) and the layout that names its strides: a per-layer NHD / HND
    layout, or one layer of a cross-layer allocation (BLHNC, BLNHC, BHLNC; LHBNC). Raises
    ValueError for a view whose strides no kvmulti layout describes."""
    view = kv_cache.transpose(1, 2)
    return view, KVCacheLayout.of_view(view, head_size)


#: One layout object per distinct layout, so the layers of a group hand kvmulti the very object
#: their step was prepared with (its fast paths compare layouts by identity).
_LAYOUTS: dict[KVCacheLayout, KVCacheLayout] = {}


class KvmultiAttentionImpl(AttentionImpl):
    """One attention layer on kvmulti. The kvmulti backend is resolved at the layer's first call
    (platform priority, or ``KVMULTI_ATTENTION_BACKEND``), and its cache view once per cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        fp8 = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        unsupported = [what for what, present in ((f"kv_cache_dtype={kv_cache_dtype}", kv_cache_dtype != "auto" and not fp8),
                                                  (f"attn_type {getattr(attn_type, 'name', attn_type)} (served: DECODER, ENCODER_ONLY)",
                                                   attn_type not in SERVED_ATTN_TYPES),
                                                  ("ALiBi on encoder-only layers",
                                                   attn_type == AttentionType.ENCODER_ONLY and alibi_slopes is not None))
                       if present]
        if unsupported:
            raise NotImplementedError(f"kvmulti's vLLM backend does not support {', '.join(unsupported)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.kv_cache_dtype = kv_cache_dtype
        from vllm.platforms import current_platform
        self._fp8_dtype = fp8_cache_dtype(kv_cache_dtype, current_platform.is_fp8_fnuz())
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        #: the layer's attention-sink logits [num_heads] (gpt-oss; loaded in place after construction)
        self.sinks = sinks
        #: the layer's ALiBi slopes fp32 [num_heads] (this rank's heads), moved to the cache's device once
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        self._backend: Backend | None = None
        # the backends this layer may dispatch to are constructed now, at model construction (engine
        # start-up): a native build happens here, with its message, never in the first forward
        construct_for(torch.device(current_platform.device_type))
        self._cache_key: tuple | None = None
        self._cache_view: tuple[torch.Tensor, KVCacheLayout] | None = None

    def _view(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, KVCacheLayout]:
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        if key != self._cache_key:
            if self._fp8_dtype is not None and kv_cache.dtype != self._fp8_dtype:
                kv_cache = kv_cache.view(self._fp8_dtype)          # vLLM's uint8 bytes, reinterpreted
            view, layout = layout_for_cache(kv_cache, self.head_size)
            self._cache_view = view, _LAYOUTS.setdefault(layout, layout)
            self._cache_key = key
        return self._cache_view

    def _kvmulti_backend(self, layout: KVCacheLayout, device: torch.device) -> Backend:
        if self._backend is None:
            self._backend = ops.resolve_backend(layout, device, sliding_window=self.sliding_window,
                                                softcap=self.logits_soft_cap, sinks=self.sinks is not None,
                                                causal=self.attn_type != AttentionType.ENCODER_ONLY,
                                                alibi=self.alibi_slopes is not None)
        return self._backend

    def _forward_encoder_only(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attn_metadata: "KvmultiStepMetadata", output: torch.Tensor) -> torch.Tensor:
        """An encoder-only layer: the step's keys and values into the step's scratch cache, then
        non-causal attention of each request's tokens over its own (:mod:`.encoder_only`); a sliding
        window W keeps |query position - key position| < W (CPU_ATTN's rule)."""
        n = attn_metadata.num_actual_tokens
        cache, step = scratch_step(attn_metadata.prepared, attn_metadata.common, self.num_kv_heads, self.head_size,
                                   query.dtype, self.num_heads, self.logits_soft_cap, self._kvmulti_backend,
                                   self.sliding_window)
        layout = step.layout
        ops.write_kv(_rows(key, n), _rows(value, n), cache, layout, step.common.slot_mapping, step=step)
        query = _rows(query, n).view(n, self.num_heads, self.head_size)
        out = _rows(output, n).view(n, self.num_heads, layout.value_size)
        ops.paged_attention(query, cache, layout, step, self.scale, self.sliding_window, self.logits_soft_cap,
                            out=out)
        return output

    def _scales(self, layer: torch.nn.Module) -> dict:
        """fp8 caches: the layer's per-tensor scales (vLLM's ``_k_scale_float``; 1.0 unless
        calibrated); nothing for other caches (kvmulti refuses scales there)."""
        if self._fp8_dtype is None:
            return {}
        return dict(k_scale=layer._k_scale_float, v_scale=layer._v_scale_float)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KvmultiStepMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``key`` / ``value`` [T, Hkv, head_size] rows [:num_actual_tokens] at the step's
        ``slot_mapping`` (-1 skips; not for a layer sharing another layer's cache), then fill
        ``output`` [T, Hq, head_size_v] (or [T, Hq * head_size_v]) with paged attention over the
        cache; rows past ``num_actual_tokens`` are left as they are (vLLM's padding)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvmulti: fused output quantization is not supported")
        if attn_metadata is None:                    # vLLM's memory profiling run
            return output
        if self.attn_type == AttentionType.ENCODER_ONLY:
            return self._forward_encoder_only(query, key, value, attn_metadata, output)
        view, layout = self._view(kv_cache)
        # a plain tensor (a Parameter would miss the prepared calls' gate); no copy when fp32 already
        sinks = None if self.sinks is None else self.sinks.detach().to(torch.float32)
        alibi = self.alibi_slopes
        if alibi is not None and alibi.device != kv_cache.device:
            alibi = self.alibi_slopes = alibi.to(kv_cache.device)
        step = attn_metadata.step_for(layout, self.num_heads, self.sliding_window,
                                      self._kvmulti_backend(layout, kv_cache.device), sinks is not None,
                                      alibi is not None)
        n = attn_metadata.num_actual_tokens
        scales = self._scales(layer)
        if key is not None and value is not None and self.kv_sharing_target_layer_name is None:
            ops.write_kv(_rows(key, n), _rows(value, n), view, layout, attn_metadata.slot_mapping, step=step,
                         **scales)
        query = _rows(query, n).view(n, self.num_heads, self.head_size)
        out = _rows(output, n).view(n, self.num_heads, layout.value_size)
        ops.paged_attention(query, view, layout, step, self.scale, self.sliding_window, self.logits_soft_cap,
                            out=out, sinks=sinks, alibi_slopes=alibi, **scales)
        return output
