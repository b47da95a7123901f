"""The plain-torch oracle: docs/design.md's semantics written literally, fp32 math, loops allowed.

Every backend is tested against these two functions. They favour obviousness over speed.
"""

from __future__ import annotations

import torch

from . import fp8
from .layout import KVCacheLayout
from .metadata import CommonAttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
             slot_mapping: torch.Tensor, k_scale: float | torch.Tensor | None = None,
             v_scale: float | torch.Tensor | None = None) -> None:
    """Write token t's K/V to slot ``slot_mapping[t]``; a slot of -1 is skipped. An fp8 cache
    stores ``fp8(x / scale)`` (kvmulti/fp8.py)."""
    keys = layout.keys(kv_cache)
    values = None if layout.is_latent else layout.values(kv_cache)
    if fp8.is_fp8(layout.dtype):
        key = fp8.quantize(key, _scale(k_scale, layout, key.device), layout.dtype)
        if values is not None:
            value = fp8.quantize(value, _scale(v_scale, layout, key.device), layout.dtype)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, layout.block_size)
        keys[block, offset] = key[t]
        if values is not None:
            values[block, offset] = value[t]


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                    metadata: CommonAttentionMetadata, scale: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    k_scale: float | torch.Tensor | None = None,
                    v_scale: float | torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None,
                    alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each new token over its request's context read from the paged cache.

    query [num_tokens, num_q_heads, head_size] -> out [num_tokens, num_q_heads, head_size_v]
    (query dtype; rows past num_actual_tokens are zero). An fp8 cache reads as
    ``float(k) * k_scale``, ``float(v) * v_scale``. ``sinks`` [num_q_heads]: head h's logit joins
    the softmax of each of its rows as one more (always visible) key whose value is zero.
    ``alibi_slopes`` [num_q_heads]: head h's score of the query at position q against the key at
    position k gains ``alibi_slopes[h] * (k - q)`` after scale and softcap.
    ``sliding_window`` w: a causal row at position q sees keys q - w < k <= q; a non-causal row
    (``metadata.causal`` False) sees |q - k| < w.
    """
    quantized = fp8.is_fp8(layout.dtype)
    k_scale = _scale(k_scale, layout, kv_cache.device) if quantized else None
    v_scale = _scale(k_scale if layout.is_latent else v_scale, layout, kv_cache.device) if quantized else None
    num_q_heads = query.shape[1]
    group = num_q_heads // layout.num_kv_heads
    scale = layout.head_size ** -0.5 if scale is None else scale
    keys = layout.keys(kv_cache)
    values = keys if layout.is_latent else layout.values(kv_cache)
    out = torch.zeros(query.shape[0], num_q_heads, layout.value_size, dtype=query.dtype, device=query.device)
    qsl = metadata.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        start, end = qsl[i], qsl[i + 1]
        query_len = end - start
        if query_len == 0:
            continue
        blocks = metadata.block_table[i].tolist()
        # Keys before `first` are outside every query's window: their table entries may be stale.
        first = lowest_visible_position(seq_len, query_len, sliding_window)
        k = torch.stack([keys[blocks[p // layout.block_size], p % layout.block_size] for p in range(first, seq_len)])
        v = torch.stack([values[blocks[p // layout.block_size], p % layout.block_size] for p in range(first, seq_len)])
        k = fp8.dequantize(k, k_scale).repeat_interleave(group, dim=1)            # [seq, Hq, D]
        v = fp8.dequantize(v, v_scale).repeat_interleave(group, dim=1)[..., : layout.value_size]
        q = query[start:end].float()                             # [qlen, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None and softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
        k_pos = torch.arange(first, seq_len).unsqueeze(0)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float().to(scores.device).view(-1, 1, 1) * (k_pos - q_pos).float()
        visible = torch.ones(query_len, seq_len - first, dtype=torch.bool)
        if metadata.causal:
            visible &= k_pos <= q_pos
        if sliding_window is not None:
            # Causal rows look back only; non-causal rows see the window on both sides (vLLM's rule).
            distance = q_pos - k_pos if metadata.causal else (q_pos - k_pos).abs()
            visible &= distance < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float().to(scores.device).view(-1, 1, 1).expand(-1, query_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def _scale(scale: float | torch.Tensor | None, layout: KVCacheLayout, device: torch.device) -> torch.Tensor:
    """A scale argument as fp32 [num_kv_heads] on ``device`` (None: 1.0)."""
    if isinstance(scale, torch.Tensor):
        return scale.detach().float().to(device).expand(layout.num_kv_heads).contiguous()
    return torch.full((layout.num_kv_heads,), 1.0 if scale is None else float(scale), device=device)


def lowest_visible_position(seq_len: int, query_len: int, sliding_window: int | None) -> int:
    """The first context position any of a request's queries can see (0 without a window)."""
    if sliding_window is None:
        return 0
    return max(0, seq_len - query_len - sliding_window + 1)
