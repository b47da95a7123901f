"""CPU backend: the native kernel (cpu/*.cpp, built on first use) with the vectorised torch path as
the fallback when it cannot be built (no compiler, KVMULTI_CPU_NATIVE=0, ...).

Both read the canonical layout in place through its named strides; ``describe()`` says which path
runs and why (``kvmulti info``).
"""

from __future__ import annotations

import torch

from .. import cpu_native, host_memory
from ..layout import KVCacheLayout
from ..metadata import CommonAttentionMetadata
from .base import Backend

#: Bytes of fp32 scores one vectorised chunk of requests may hold (torch path).
SCORE_BUDGET_BYTES = 256 * 2**20

#: Keys per context partition of the native kernel; 0 = automatic (tests set small values to
#: force the partitioned path and its log-sum-exp merge).
NATIVE_PARTITION_LEN = 0


class CPUBackend(Backend):
    name = "CPU"
    platforms = ("cpu",)
    supports_latent = True
    supports_non_causal = True

    def describe(self) -> str:
        pages = "2 MiB pages" if host_memory.huge_pages_usable() else "4 KiB pages"
        return (f"cpu: {cpu_native.describe()}; caches from layout.allocate() in {pages} "
                f"(transparent huge pages: {host_memory.transparent_huge_pages()})")

    def native(self):
        """The loaded native module, or None when the torch path is in use."""
        return cpu_native.load()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                 layout: KVCacheLayout, slot_mapping: torch.Tensor) -> None:
        module = cpu_native.load()
        if module is None:
            write_kv_torch(key, value, kv_cache, layout, slot_mapping)
            return
        write_kv_native(module, key, value, kv_cache, layout, slot_mapping)

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                        metadata: CommonAttentionMetadata, scale: float, sliding_window: int | None,
                        softcap: float | None, out: torch.Tensor) -> None:
        module = cpu_native.load()
        if module is None:
            paged_attention_torch(query, kv_cache, layout, metadata, scale, sliding_window, softcap, out)
            return
        paged_attention_native(module, query, kv_cache, layout, metadata, scale, sliding_window, softcap, out)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _contiguous_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` itself when it already is a contiguous ``dtype`` tensor (no per-call copies)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def write_kv_native(module, key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                    layout: KVCacheLayout, slot_mapping: torch.Tensor) -> None:
    """Native scatter of K/V rows into their slots through the named strides; slot -1 is skipped."""
    s = layout.expected_strides()
    key = _last_dim_contiguous(key)
    value = key if layout.is_latent or value is None else _last_dim_contiguous(value)
    slots = _contiguous_as(slot_mapping, torch.int64)
    module.write_kv(key, value, kv_cache, slots, s.block, s.token, s.head, layout.head_size,
                    0 if layout.is_latent else layout.value_size, layout.block_size)


def paged_attention_native(module, query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                           metadata: CommonAttentionMetadata, scale: float, sliding_window: int | None,
                           softcap: float | None, out: torch.Tensor, partition_len: int | None = None,
                           isa: str | None = None) -> None:
    """The native kernel: the cache is read in place through ``layout``'s named strides."""
    if layout.is_latent or metadata.num_actual_tokens == 0:
        return
    s = layout.expected_strides()
    query = _last_dim_contiguous(query)
    table = metadata.block_table
    if table.dtype != torch.int32 or (table.shape[1] > 1 and table.stride(1) != 1):
        table = table.to(torch.int32).contiguous()
    qsl = _contiguous_as(metadata.query_start_loc_cpu, torch.int32)
    seq = _contiguous_as(metadata.seq_lens_cpu, torch.int32)
    target = out if out.stride(-1) == 1 else torch.zeros_like(out, memory_format=torch.contiguous_format)
    isa_name = isa or cpu_native.selected_isa(module)
    module.paged_attention(query, kv_cache, target, table, qsl, seq, s.block, s.token, s.head, layout.head_size,
                           layout.value_size, layout.num_kv_heads, layout.block_size, float(scale),
                           int(sliding_window or 0), float(softcap or 0.0), bool(metadata.causal),
                           int(NATIVE_PARTITION_LEN if partition_len is None else partition_len),
                           cpu_native.ISAS[isa_name])
    if target is not out:
        out.copy_(target)


def write_kv_torch(key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                   layout: KVCacheLayout, slot_mapping: torch.Tensor) -> None:
    """Scatter K/V rows into their slots through the strided cache view; slot -1 is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // layout.block_size, slots % layout.block_size
    kv_cache[blocks, offsets, :, : layout.head_size] = key[keep]
    if not layout.is_latent:
        kv_cache[blocks, offsets, :, layout.head_size:] = value[keep]


def paged_attention_torch(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                          metadata: CommonAttentionMetadata, scale: float, sliding_window: int | None,
                          softcap: float | None, out: torch.Tensor) -> None:
    """Padded-batch attention over chunks of requests, each chunk one set of batched matmuls.

    For a chunk the context of each request (only the part some query can see) is gathered from
    the paged cache into [R, span, Hkv, D], queries are padded to [R, max_q, Hq, D], and the
    causal / window mask is built from positions. Memory per chunk is bounded by SCORE_BUDGET_BYTES.
    """
    if layout.is_latent or metadata.num_actual_tokens == 0:
        return
    qsl = metadata.query_start_loc_cpu.long()
    seq_lens = metadata.seq_lens_cpu.long()
    query_lens = qsl[1:] - qsl[:-1]
    first = seq_lens - query_lens
    if sliding_window is not None:
        first = (first - sliding_window + 1).clamp(min=0)     # earliest position any query sees
    else:
        first = torch.zeros_like(first)
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
                      torch.arange(start, end), qsl, seq_lens, query_lens, first)
        start = end


def _attend_chunk(query, kv_cache, layout, metadata, scale, sliding_window, softcap, out,
                  reqs, qsl, seq_lens, query_lens, first) -> None:
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
    k = context[..., :hs].permute(0, 2, 3, 1)                                 # [R, Hkv, D, span]
    v = context[..., hs:].transpose(1, 2)                                     # [R, Hkv, span, Dv]

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
    if sliding_window is not None:
        visible &= (q_pos[:, :, None] - k_pos[:, None, :]) < sliding_window
    visible &= q_valid[:, :, None]
    visible = visible.to(device)[:, None, None]                               # [R, 1, 1, max_q, span]
    scores = scores.view(len(reqs), hkv, group, max_q, span).masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)                   # padded rows are all -inf
    o = torch.matmul(probs.view(len(reqs), hkv, group * max_q, span), v)      # [R, Hkv, G*max_q, Dv]
    o = o.view(len(reqs), hkv, group, max_q, -1).permute(0, 3, 1, 2, 4).reshape(len(reqs), max_q, hkv * group, -1)
    out[q_idx[q_valid].to(device)] = o[q_valid.to(device)].to(out.dtype)
