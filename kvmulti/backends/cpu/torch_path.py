"""The CPU backend's fallback: vectorised torch over the canonical layout (no compiler needed).

Runs when the native kernel cannot be built or is disabled (``KVMULTI_CPU_NATIVE=0``); reads the
cache in place through its strided K/V views, never repacks it.
"""

from __future__ import annotations

import torch

from ... import fp8
from ...layout import KVCacheLayout
from ...metadata import CommonAttentionMetadata, first_visible_position

#: Bytes of fp32 scores one vectorised chunk of requests may hold.
SCORE_BUDGET_BYTES = 256 * 2**20


def write_kv_torch(key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                   layout: KVCacheLayout, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Scatter K/V rows into their slots through the strided cache view; slot -1 is skipped. An fp8
    cache (``k_scale`` / ``v_scale``: fp32 [Hkv]) stores the rows quantised by kvmulti/fp8.py's rule."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // layout.block_size, slots % layout.block_size
    key = key[keep]
    if k_scale is not None:
        key = fp8.quantize(key, k_scale, layout.dtype)
    kv_cache[blocks, offsets, :, : layout.head_size] = key
    if not layout.is_latent:
        value = value[keep]
        if v_scale is not None:
            value = fp8.quantize(value, v_scale, layout.dtype)
        kv_cache[blocks, offsets, :, layout.head_size:] = value


def paged_attention_torch(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                          metadata: CommonAttentionMetadata, scale: float, sliding_window: int | None,
                          softcap: float | None, out: torch.Tensor, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                          alibi_slopes: torch.Tensor | None = None) -> None:
    """Padded-batch attention over chunks of requests, each chunk one set of batched matmuls.

    For a chunk the context of each request (only the part some query can see) is gathered from
    the paged cache into [R, span, Hkv, D], queries are padded to [R, max_q, Hq, D], and the
    causal / window mask is built from positions. Memory per chunk is bounded by SCORE_BUDGET_BYTES.
    An fp8 cache is read as ``float(k) * k_scale``, ``float(v) * v_scale`` (fp32 [Hkv] each).
    ``sinks`` fp32 [Hq]: one more logit per query head in each row's softmax, with no value.
    ``alibi_slopes`` fp32 [Hq]: head h's scores gain ``slope[h] * (k_pos - q_pos)`` after softcap.
    """
    if layout.is_latent or metadata.num_actual_tokens == 0:
        return
    qsl = metadata.query_start_loc_cpu.long()
    seq_lens = metadata.seq_lens_cpu.long()
    query_lens = qsl[1:] - qsl[:-1]
    first = first_visible_position(seq_lens - query_lens, sliding_window)   # earliest position any query sees
    spans = seq_lens - first
    heads = query.shape[1]
    start = 0
    while start < metadata.num_reqs:
        end = start + 1
        while end < metadata.num_reqs:
            rows = end + 1 - start
            need = rows * heads * int(query_lens[start:end + 1].max()) * int(spans[start:end + 1].max()) * 4
            if need > SCORE_BUDGET_BYTES:
                break
            end += 1
        _attend_chunk(query, kv_cache, layout, metadata, scale, sliding_window, softcap, out,
                      torch.arange(start, end), qsl, seq_lens, query_lens, first, k_scale, v_scale, sinks,
                      alibi_slopes)
        start = end


def _attend_chunk(query, kv_cache, layout, metadata, scale, sliding_window, softcap, out,
                  reqs, qsl, seq_lens, query_lens, first, k_scale=None, v_scale=None, sinks=None,
                  alibi_slopes=None) -> None:
    qlen, seq, lo = query_lens[reqs], seq_lens[reqs], first[reqs]
    max_q, span = int(qlen.max()), int((seq - lo).max())
    if max_q == 0:
        return
    hkv, bs, hs = layout.num_kv_heads, layout.block_size, layout.head_size
    group = query.shape[1] // hkv
    device = kv_cache.device

    # Gather the visible context: positions lo .. seq-1 per request, padded to `span`.
    k_pos = lo[:, None] + torch.arange(span)[None, :]                         # [R, span]
    k_valid = k_pos < seq[:, None]
    k_pos = torch.where(k_valid, k_pos, lo[:, None])
    block_table = metadata.block_table[reqs.to(device)].long()
    blocks = torch.gather(block_table, 1, (k_pos // bs).to(device))
    context = kv_cache[blocks, (k_pos % bs).to(device)].float()              # [R, span, Hkv, E]
    k, v = context[..., :hs], context[..., hs:]
    if k_scale is not None:                                                   # fp8: float(x) * scale
        k, v = fp8.dequantize(k, k_scale), fp8.dequantize(v, v_scale)
    k = k.permute(0, 2, 3, 1)                                                 # [R, Hkv, D, span]
    v = v.transpose(1, 2)                                                     # [R, Hkv, span, Dv]

    # Pad queries to [R, max_q, Hq, D]; padded rows point at row 0 and are dropped later.
    q_idx = qsl[reqs][:, None] + torch.arange(max_q)[None, :]                 # [R, max_q]
    q_valid = torch.arange(max_q)[None, :] < qlen[:, None]
    q_idx = torch.where(q_valid, q_idx, 0)
    q = query[q_idx.to(device)].float()                                       # [R, max_q, Hq, D]
    q = q.view(len(reqs), max_q, hkv, group, hs).permute(0, 2, 3, 1, 4).reshape(len(reqs), hkv, group * max_q, hs)

    scores = torch.matmul(q, k).mul_(scale)                                   # [R, Hkv, G*max_q, span]
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    q_pos = (seq - qlen)[:, None] + torch.arange(max_q)[None, :]              # [R, max_q]
    visible = k_valid[:, None, :].clone()                                     # [R, 1, span] -> [R, max_q, span]
    visible = visible.expand(-1, max_q, -1).clone()
    if metadata.causal:
        visible &= k_pos[:, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:   # non-causal rows: the window on both sides
        distance = q_pos[:, :, None] - k_pos[:, None, :]
        visible &= (distance if metadata.causal else distance.abs()) < sliding_window
    visible &= q_valid[:, :, None]
    visible = visible.to(device)[:, None, None]                               # [R, 1, 1, max_q, span]
    scores = scores.view(len(reqs), hkv, group, max_q, span)
    if alibi_slopes is not None:                                              # slope x (k_pos - q_pos)
        distance = (k_pos[:, None, :] - q_pos[:, :, None]).to(device=device, dtype=scores.dtype)
        scores += alibi_slopes.view(1, hkv, group, 1, 1) * distance[:, None, None]
    scores.masked_fill_(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)                                 # a NaN query row stays NaN
    else:                                                                     # the sink: a last column, dropped
        sink = sinks.view(1, hkv, group, 1, 1).expand(len(reqs), -1, -1, max_q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :span]
    probs.masked_fill_(~visible.any(-1, keepdim=True), 0.0)                  # padded rows: all -inf
    o = torch.matmul(probs.view(len(reqs), hkv, group * max_q, span), v)      # [R, Hkv, G*max_q, Dv]
    o = o.view(len(reqs), hkv, group, max_q, -1).permute(0, 3, 1, 2, 4).reshape(len(reqs), max_q, hkv * group, -1)
    out[q_idx[q_valid].to(device)] = o[q_valid.to(device)].to(out.dtype)
