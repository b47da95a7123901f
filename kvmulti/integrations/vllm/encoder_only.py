"""vLLM's encoder-only attention layers (``AttentionType.ENCODER_ONLY``, BERT-style embedding
models) on kvmulti.

vLLM gives such layers no KV cache (their ``kv_cache`` is an empty tensor) and a placeholder block
table and slot mapping; its builder wrapper marks the step non-causal. Every request's tokens
arrive in one step (``query_len == seq_len``) and attend to each other only. kvmulti attends
through a paged cache, so :func:`scratch_step` lays the step's tokens out in a scratch cache of its
own (request after request, consecutive blocks), made once per step for each (layout, backend)
and shared by the step's layers: each layer writes its keys and values there, then attends
non-causally over them. A layer's sliding window W keeps the keys with |query position - key
position| < W, as vLLM's CPU_ATTN does for these layers (vLLM's model code hands the backend that W:
ModernBERT's local attention of half-width h arrives as W = h + 1).
"""

from __future__ import annotations

import torch

from ... import ops
from ...backends.base import Backend, StepMetadata
from ...layout import KVCacheLayout
from ...metadata import CommonAttentionMetadata

#: Block size of the scratch caches (any size works; 16 keeps the table short and every backend's
#: block-size bounds met).
SCRATCH_BLOCK_SIZE = 16


def scratch_metadata(common: CommonAttentionMetadata) -> CommonAttentionMetadata:
    """The step's non-causal metadata over a scratch cache: request i's blocks follow request i-1's.
    Raises NotImplementedError when a request has tokens before this step (a cached prefix: an
    encoder-only layer keeps no cache between steps)."""
    query_lens = (common.query_start_loc_cpu[1:common.num_reqs + 1] - common.query_start_loc_cpu[:common.num_reqs])
    seq_lens = common.seq_lens_cpu[:common.num_reqs]
    if not torch.equal(query_lens.to(seq_lens.dtype), seq_lens):
        raise NotImplementedError("kvmulti: encoder-only attention needs each request's whole sequence in one step "
                                  f"(query lens {query_lens.tolist()}, seq lens {seq_lens.tolist()})")
    blocks = (seq_lens + SCRATCH_BLOCK_SIZE - 1) // SCRATCH_BLOCK_SIZE
    first = torch.cumsum(blocks, 0) - blocks
    width = max(1, int(blocks.max()) if len(blocks) else 1)
    table = (first[:, None] + torch.arange(width)[None, :]).to(torch.int32)
    return CommonAttentionMetadata.from_lens(query_lens, seq_lens, table, SCRATCH_BLOCK_SIZE,
                                             device=common.query_start_loc.device, causal=False)


def scratch_step(prepared: dict, common: CommonAttentionMetadata, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, num_query_heads: int, softcap: float | None,
                 backend_for: "callable", sliding_window: int | None = None) -> tuple[torch.Tensor, StepMetadata]:
    """(scratch cache, prepared step) of this step for a layer of these shapes and ``sliding_window``,
    made by the first such layer and cached in ``prepared``; ``backend_for(layout, device)`` resolves
    the kvmulti backend."""
    key = ("encoder-only", num_kv_heads, head_size, dtype, num_query_heads, sliding_window)
    found = prepared.get(key)
    if found is None:
        metadata = prepared.get("encoder-only metadata")
        if metadata is None:
            metadata = prepared["encoder-only metadata"] = scratch_metadata(common)
        num_blocks = int(metadata.block_table.max()) + 1 if metadata.num_reqs else 1
        layout = KVCacheLayout(num_blocks=num_blocks, block_size=SCRATCH_BLOCK_SIZE, num_kv_heads=num_kv_heads,
                               head_size=head_size, dtype=dtype, order="NHD")
        device = common.query_start_loc.device
        backend: Backend = backend_for(layout, device)
        step = ops.prepare_step(metadata, layout, num_query_heads, sliding_window=sliding_window, softcap=softcap,
                                backend=backend, check_values=False)
        found = prepared[key] = (layout.allocate(device, zero=False), step)
    return found
