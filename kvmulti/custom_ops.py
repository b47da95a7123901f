"""The torch.compile custom ops ``kvmulti::write_kv`` and ``kvmulti::paged_attention``.

Eager calls of :func:`kvmulti.ops.write_kv` / :func:`kvmulti.ops.paged_attention` go straight to
the backends (no dispatcher overhead); under torch.compile they call these ops, whose fake
implementations give the tracer the output shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def register_custom_ops(write_kv_impl: Callable[..., None], paged_attention_impl: Callable[..., torch.Tensor]) -> None:
    """Register both ops over :mod:`kvmulti.ops`' implementations (once, when that module loads)."""
    write_op = torch.library.custom_op("kvmulti::write_kv", write_kv_impl, mutates_args=("kv_cache",))

    @write_op.register_fake
    def _(key, value, kv_cache, slot_mapping, num_blocks, block_size, num_kv_heads, head_size, head_size_v,
          order, num_layers, backend, k_scale=None, v_scale=None) -> None:
        return None

    attention_op = torch.library.custom_op("kvmulti::paged_attention", paged_attention_impl, mutates_args=())

    @attention_op.register_fake
    def _(query, kv_cache, query_start_loc, seq_lens, block_table, query_start_loc_cpu, seq_lens_cpu,
          num_actual_tokens, max_query_len, max_seq_len, causal, num_blocks, block_size, num_kv_heads, head_size,
          head_size_v, order, num_layers, scale, sliding_window, softcap, backend, k_scale=None,
          v_scale=None, sinks=None, alibi_slopes=None) -> torch.Tensor:
        return query.new_empty(query.shape[0], query.shape[1], head_size_v)
