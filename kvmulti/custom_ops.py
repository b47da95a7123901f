"""The torch.compile custom ops ``kvmulti::write_kv`` and ``kvmulti::paged_attention``.

Eager calls of :func:`kvmulti.ops.write_kv` / :func:`kvmulti.ops.paged_attention` go straight to
the backends (no dispatcher overhead); under torch.compile they call these ops, whose fake
implementations give the tracer the output shapes.
"""

from __future__ import annotations

import functools

import torch

from .backends.base import StepMetadata
from .backends.registry import get_backend
from .layout import CROSS_LAYER_ORDERS, KVCacheLayout, token_order
from .metadata import CommonAttentionMetadata
from .step_cache import StepCache


def layout_args(layout: KVCacheLayout) -> tuple:
    """The layout as custom-op arguments; ``order`` is the cross-layer order where there is one."""
    return (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size, layout.value_size,
            layout.cross_layer_order or layout.order, layout.num_layers)


@functools.lru_cache(maxsize=256)
def layout_of_args(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, head_size_v: int,
                   order: str, num_layers: int, dtype: torch.dtype) -> KVCacheLayout:
    """The layout :func:`layout_args` gave (one object per arguments, so steps can key on it)."""
    if order in CROSS_LAYER_ORDERS:
        return KVCacheLayout(num_blocks, block_size, num_kv_heads, head_size, head_size_v, dtype, token_order(order),
                             order, num_layers)
    return KVCacheLayout(num_blocks, block_size, num_kv_heads, head_size, head_size_v, dtype, order)


def register_custom_ops() -> None:
    """Register both ops (once, when :mod:`kvmulti.ops` loads) over the implementations below, which
    run :mod:`kvmulti.ops`' eager paths; the attention op prepares one step per step's metadata."""
    write_op = torch.library.custom_op("kvmulti::write_kv", _write_kv_impl, mutates_args=("kv_cache",))

    @write_op.register_fake
    def _(key, value, kv_cache, slot_mapping, num_blocks, block_size, num_kv_heads, head_size, head_size_v,
          order, num_layers, backend, k_scale=None, v_scale=None) -> None:
        return None

    attention_op = torch.library.custom_op("kvmulti::paged_attention", _paged_attention_impl, mutates_args=())

    @attention_op.register_fake
    def _(query, kv_cache, query_start_loc, seq_lens, block_table, query_start_loc_cpu, seq_lens_cpu,
          num_actual_tokens, max_query_len, max_seq_len, causal, num_blocks, block_size, num_kv_heads, head_size,
          head_size_v, order, num_layers, scale, sliding_window, softcap, backend, k_scale=None,
          v_scale=None, sinks=None, alibi_slopes=None) -> torch.Tensor:
        return query.new_empty(query.shape[0], query.shape[1], head_size_v)


def _write_kv_impl(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, head_size_v: int,
                   order: str, num_layers: int, backend: str, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    from .ops import _write              # ops registers these implementations when it loads
    layout = layout_of_args(num_blocks, block_size, num_kv_heads, head_size, head_size_v, order, num_layers, kv_cache.dtype)
    _write(key, value, kv_cache, layout, slot_mapping, get_backend(backend), k_scale, v_scale)


def _paged_attention_impl(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                          seq_lens: torch.Tensor, block_table: torch.Tensor, query_start_loc_cpu: torch.Tensor,
                          seq_lens_cpu: torch.Tensor, num_actual_tokens: int, max_query_len: int,
                          max_seq_len: int, causal: bool, num_blocks: int, block_size: int, num_kv_heads: int,
                          head_size: int, head_size_v: int, order: str, num_layers: int, scale: float,
                          sliding_window: int | None, softcap: float | None, backend: str,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                          sinks: torch.Tensor | None = None,
                          alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    from .ops import _attend, prepare_step
    layout = layout_of_args(num_blocks, block_size, num_kv_heads, head_size, head_size_v, order, num_layers, kv_cache.dtype)

    def prepare() -> StepMetadata:
        metadata = CommonAttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
            slot_mapping=query_start_loc.new_empty(0, dtype=torch.int64), num_reqs=seq_lens.shape[0],
            num_actual_tokens=num_actual_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len,
            causal=causal, query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu)
        return prepare_step(metadata, layout, query.shape[1], num_query_rows=query.shape[0],
                            sliding_window=sliding_window, softcap=softcap, backend=backend, device=kv_cache.device,
                            sinks=sinks, alibi_slopes=alibi_slopes)

    step = _COMPILED_STEPS.get(
        (query_start_loc, seq_lens, block_table, query_start_loc_cpu, seq_lens_cpu),
        (layout, query.shape[0], query.shape[1], num_actual_tokens, max_query_len, max_seq_len, causal,
         sliding_window, bool(softcap), backend, sinks is not None, alibi_slopes is not None, kv_cache.device),
        prepare)
    return _attend(query, kv_cache, step, scale, softcap, None, k_scale, v_scale, sinks, alibi_slopes)


#: the torch.compile path's steps: one per step's metadata, shared by its layers
_COMPILED_STEPS = StepCache()
