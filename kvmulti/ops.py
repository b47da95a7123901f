"""The public ops: ``kvmulti.write_kv`` and ``kvmulti.paged_attention``.

Both validate their inputs (see :mod:`kvmulti.validation`), pick a backend (named, else the
environment, else platform priority) and run it through a ``torch.library`` custom op
(``kvmulti::write_kv`` mutates the cache, ``kvmulti::paged_attention`` returns a new tensor), so
``torch.compile(fullgraph=True)`` traces calls to them.
"""

from __future__ import annotations

import functools

import torch

from .backends.registry import get_backend, select_backend_for_layout
from .layout import KVCacheLayout
from .metadata import CommonAttentionMetadata
from .validation import check_attention, check_metadata_values, check_slot_values, check_write


def write_kv(key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor, layout: KVCacheLayout,
             slot_mapping: torch.Tensor, backend: str | None = None, role: str = "target") -> None:
    """Write key [T, Hkv, head_size] and value [T, Hkv, head_size_v] into ``kv_cache`` at
    ``slot_mapping`` [T] (int32/int64; slot = block * block_size + offset; -1 = skip).

    ``backend`` names one of HIP/SYCL/TRITON/CPU; None dispatches (env var for ``role``, then
    platform priority). Raises TypeError/ValueError naming the bad argument; the cache is untouched then.
    """
    check_write(key, value, kv_cache, layout, slot_mapping)
    name = select_backend_for_layout(layout, kv_cache.device, False, False, role, backend)
    if value is None:
        value = key.new_empty((key.shape[0], layout.num_kv_heads, 0))
    if torch.compiler.is_compiling():
        torch.ops.kvmulti.write_kv(key, value, kv_cache, slot_mapping, *_layout_args(layout), name)
    else:
        _write(key, value, kv_cache, layout, slot_mapping, name)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                    metadata: CommonAttentionMetadata, scale: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    backend: str | None = None, role: str = "target") -> torch.Tensor:
    """Paged attention for a mixed batch (prefill, chunked prefill, decode, verification).

    query [T, Hq, head_size] (cache dtype) -> out [T, Hq, head_size_v], same dtype; rows past
    ``metadata.num_actual_tokens`` are zero. ``scale`` defaults to head_size ** -0.5;
    ``sliding_window`` W keeps keys with q_pos - k_pos < W; ``softcap`` c > 0 applies
    c * tanh(score / c) after scaling (0 or None: off).
    """
    check_attention(query, kv_cache, layout, metadata, scale, sliding_window, softcap)
    softcap = float(softcap) if softcap else None
    name = select_backend_for_layout(layout, kv_cache.device, sliding_window is not None, softcap is not None,
                                     role, backend)
    if not metadata.causal and not get_backend(name).supports_non_causal:
        raise ValueError(f"backend {name} supports causal attention only (metadata.causal is False)")
    scale = float(layout.head_size ** -0.5 if scale is None else scale)
    if not torch.compiler.is_compiling():
        return _attend(query, kv_cache, layout, metadata, scale, sliding_window, softcap, name)
    return torch.ops.kvmulti.paged_attention(
        query, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
        metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.num_actual_tokens,
        metadata.max_query_len, metadata.max_seq_len, metadata.causal, *_layout_args(layout),
        scale, sliding_window, softcap, name)


def _layout_args(layout: KVCacheLayout) -> tuple:
    return (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size, layout.value_size,
            layout.order)


@functools.lru_cache(maxsize=256)
def _layout(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, head_size_v: int,
            order: str, dtype: torch.dtype) -> KVCacheLayout:
    return KVCacheLayout(num_blocks, block_size, num_kv_heads, head_size, head_size_v, dtype, order)


def _write_kv_impl(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, head_size_v: int,
                 order: str, backend: str) -> None:
    layout = _layout(num_blocks, block_size, num_kv_heads, head_size, head_size_v, order, kv_cache.dtype)
    _write(key, value, kv_cache, layout, slot_mapping, backend)


def _write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
           slot_mapping: torch.Tensor, backend: str) -> None:
    check_slot_values(slot_mapping, layout)
    get_backend(backend).write_kv(key, None if layout.is_latent else value, kv_cache, layout, slot_mapping)


def _attend(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout, metadata: CommonAttentionMetadata,
            scale: float, sliding_window: int | None, softcap: float | None, backend: str) -> torch.Tensor:
    check_metadata_values(metadata, layout, sliding_window)
    out = torch.zeros(query.shape[0], query.shape[1], layout.value_size, dtype=query.dtype, device=query.device)
    get_backend(backend).paged_attention(query, kv_cache, layout, metadata, scale, sliding_window, softcap, out)
    return out


# Eager calls go straight to _write / _attend (no dispatcher overhead and no metadata rebuilt on
# the per-layer hot path); torch.compile traces the custom ops, whose fake implementations give
# it shapes.
_write_kv_op = torch.library.custom_op("kvmulti::write_kv", _write_kv_impl, mutates_args=("kv_cache",))


@_write_kv_op.register_fake
def _(key, value, kv_cache, slot_mapping, num_blocks, block_size, num_kv_heads, head_size, head_size_v,
      order, backend) -> None:
    return None


def _paged_attention_impl(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_table: torch.Tensor, query_start_loc_cpu: torch.Tensor,
                        seq_lens_cpu: torch.Tensor, num_actual_tokens: int, max_query_len: int,
                        max_seq_len: int, causal: bool, num_blocks: int, block_size: int, num_kv_heads: int,
                        head_size: int, head_size_v: int, order: str, scale: float,
                        sliding_window: int | None, softcap: float | None, backend: str) -> torch.Tensor:
    layout = _layout(num_blocks, block_size, num_kv_heads, head_size, head_size_v, order, kv_cache.dtype)
    metadata = CommonAttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
        slot_mapping=query_start_loc.new_empty(0, dtype=torch.int64), num_reqs=seq_lens.shape[0],
        num_actual_tokens=num_actual_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len,
        causal=causal, query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu)
    return _attend(query, kv_cache, layout, metadata, scale, sliding_window, softcap, backend)


_paged_attention_op = torch.library.custom_op("kvmulti::paged_attention", _paged_attention_impl, mutates_args=())


@_paged_attention_op.register_fake
def _(query, kv_cache, query_start_loc, seq_lens, block_table, query_start_loc_cpu, seq_lens_cpu,
      num_actual_tokens, max_query_len, max_seq_len, causal, num_blocks, block_size, num_kv_heads, head_size,
      head_size_v, order, scale, sliding_window, softcap, backend) -> torch.Tensor:
    return query.new_empty(query.shape[0], query.shape[1], head_size_v)
