"""IPEX backend: ``ipex.llm.modules.PagedAttention`` (IPEX 2.8) on kvmulti's canonical layout.

Zero copy: IPEX's paged kernels take K and V caches shaped [num_blocks, num_kv_heads, block_size,
head_size] and address them through ``stride(0/1/2)`` with a unit content stride, reading V with
K's strides. kvmulti's K and V views permuted to that shape meet this in BOTH orders (NHD and HND)
when ``head_size_v == head_size`` (so K and V share strides).

What IPEX 2.8's CPU kernels get wrong, and what this backend does about it (each one has a
regression test in tests/test_ipex_backend.py):

- ``reshape_and_cache`` writes a slot of -1 BEFORE the cache: slots outside [0, num_slots) are
  filtered out here and never reach it.
- ``single_query_cached_kv_attention(window_size=W)`` shows a query the keys with
  ``q_pos - k_pos < W``: kvmulti's window W, passed unchanged.
- without a window (``window_size=-1``) it raises "Sliding window unsupported" when a KV head has
  3 or more query heads and the batch's first four sequences share their first block (prefix
  sharing): "no window" is passed as a window longer than every sequence of the step, which sees
  every key; with softcap (where any window raises) such a batch goes to IPEX three sequences a call.
- a window together with softcap raises: that combination is refused by capability.
- ``flash_attn_varlen_func`` ignores the cache's token stride (wrong on every kvmulti view), so
  requests with more than one query (prefill, chunked prefill, verification) never go to IPEX: on
  CPU they run on kvmulti's own CPU kernel, in the same step, for that part of the batch only.
- block ids are never bounds-checked by IPEX: :meth:`IpexBackend.plan` refuses a table whose ids
  a request would read lie outside [0, num_blocks), and replaces the entries before a window
  (which may be stale) with a valid id.

XPU is not served: IPEX's XPU paged kernels use another cache shape contract and nothing here
could verify them on kvmulti's layout (no Intel GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...layout import KVCacheLayout
from ...metadata import CommonAttentionMetadata
from ..base import Backend, StepMetadata
from .library import ipex_status, paged_attention_module

#: cache dtypes IPEX 2.8's CPU paged kernels serve (its fp8 path is not wired here: see docs/backends.md).
IPEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DecodePart:
    """The requests with exactly one query, as IPEX's decode kernel takes them.

    rows: int64 [n], their query rows; block_tables: int32 [n, width], every entry a valid block id;
    context_lens: int32 [n]; max_context_len: int; window: kvmulti's window (None: none);
    first_four_share: the first four sequences share their first block (IPEX's failing no-window case).
    """

    rows: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_context_len: int
    window: int | None
    first_four_share: bool

    def ipex_window(self, softcap: bool) -> int:
        """The ``window_size`` IPEX gets: kvmulti's W unchanged; no window: one longer than every
        sequence (IPEX's -1 is broken, see the module doc), or -1 with softcap (any window raises)."""
        if self.window is not None:
            return self.window
        return -1 if softcap else self.max_context_len + 1

    def calls(self, softcap: bool, group: int) -> list[slice]:
        """Row ranges of the IPEX calls: one, or three sequences each where IPEX would raise."""
        n = self.rows.numel()
        if softcap and self.window is None and group >= 3 and self.first_four_share:
            return [slice(i, min(i + 3, n)) for i in range(0, n, 3)]
        return [slice(0, n)]


@dataclass(frozen=True)
class PrefillPart:
    """The requests with more than one query: their query rows (int64) and kvmulti's CPU step."""

    rows: torch.Tensor
    step: StepMetadata


@dataclass(frozen=True)
class IpexPlan:
    decode: DecodePart | None
    prefill: PrefillPart | None
    head_mapping: torch.Tensor      # int32 [num_query_heads]: query head -> kv head


class IpexBackend(Backend):
    name = "IPEX"
    platforms = ("cpu",)
    dtypes = IPEX_DTYPES

    def unavailable_reasons(self) -> list[str]:
        reason = ipex_status().reason
        return [reason] if reason else []

    def platform_reasons(self, platform: str) -> list[str]:
        if platform == "xpu":
            return ["IPEX's XPU paged kernels are not wired: their cache contract differs from the CPU kernels' "
                    "and could not be verified on kvmulti's layout without an Intel GPU"]
        return super().platform_reasons(platform)

    def describe(self) -> str:
        return f"cpu, by name only (slower than CPU here); {ipex_status().describe()}"

    def capability_reasons(self, config) -> list[str]:
        reasons = super().capability_reasons(config)
        if config.head_size_v not in (0, config.head_size):
            reasons.append(f"head_size_v {config.head_size_v} != head_size {config.head_size}: IPEX reads V with "
                           "K's strides and one head size")
        if config.sliding_window and config.softcap:
            reasons.append("sliding window together with softcap: IPEX 2.8's decode kernel raises on that pair")
        return reasons

    # -- per step --------------------------------------------------------------------------------
    def plan(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
             sliding_window: int | None) -> IpexPlan:
        """Split the step into its decode requests (IPEX) and its multi-query requests (kvmulti's CPU
        kernel); raise ValueError for block ids a request would read outside the cache."""
        qsl = common.query_start_loc_cpu[: common.num_reqs + 1].long()
        seq_lens = common.seq_lens_cpu[: common.num_reqs].long()
        query_lens = qsl[1:] - qsl[:-1]
        decode = torch.nonzero(query_lens == 1).flatten()
        multi = torch.nonzero(query_lens > 1).flatten()
        group = num_query_heads // layout.num_kv_heads
        head_mapping = torch.arange(layout.num_kv_heads, dtype=torch.int32).repeat_interleave(group)
        return IpexPlan(self._decode_part(common, layout, decode, qsl, seq_lens, sliding_window),
                        self._prefill_part(common, layout, num_query_heads, multi, qsl, seq_lens, sliding_window),
                        head_mapping)

    def _decode_part(self, common: CommonAttentionMetadata, layout: KVCacheLayout, requests: torch.Tensor,
                     qsl: torch.Tensor, seq_lens: torch.Tensor, sliding_window: int | None) -> DecodePart | None:
        if requests.numel() == 0:
            return None
        context_lens = seq_lens[requests]
        if bool((context_lens < 1).any()):
            raise ValueError(f"metadata.seq_lens[{int(requests[context_lens < 1][0])}] < 1 for a request with a query")
        table = common.block_table.to("cpu")[requests].long()
        tables = safe_block_tables(table, context_lens, layout, sliding_window)
        first_four_share = requests.numel() >= 4 and bool((tables[:4, 0] == tables[0, 0]).all())
        return DecodePart(qsl[requests], tables.to(torch.int32).contiguous(),
                          context_lens.to(torch.int32).contiguous(), int(context_lens.max()), sliding_window,
                          first_four_share)

    def _prefill_part(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
                      requests: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor,
                      sliding_window: int | None) -> PrefillPart | None:
        if requests.numel() == 0:
            return None
        if common.device.type != "cpu":
            raise ValueError("IPEX serves multi-query requests (prefill, verification) with kvmulti's CPU kernel, "
                             "which runs on CPU tensors only")
        from ..registry import get_backend
        lens = (qsl[1:] - qsl[:-1])[requests]
        rows = torch.cat([torch.arange(int(qsl[r]), int(qsl[r + 1])) for r in requests.tolist()])
        starts = torch.zeros(requests.numel() + 1, dtype=torch.int32)
        starts[1:] = torch.cumsum(lens, 0)
        sub_seq_lens = seq_lens[requests].to(torch.int32)
        sub = CommonAttentionMetadata(
            query_start_loc=starts, seq_lens=sub_seq_lens,
            block_table=common.block_table.to("cpu")[requests].to(torch.int32).contiguous(),
            slot_mapping=torch.full((rows.numel(),), -1, dtype=torch.int64), num_reqs=int(requests.numel()),
            num_actual_tokens=int(rows.numel()), max_query_len=int(lens.max()),
            max_seq_len=int(sub_seq_lens.max()), causal=common.causal)
        cpu = get_backend("CPU")
        return PrefillPart(rows, cpu.build_metadata(sub, layout, num_query_heads, sliding_window))

    # -- kernels ---------------------------------------------------------------------------------
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 layout: KVCacheLayout, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """IPEX's ``reshape_and_cache`` for the tokens whose slot lies in [0, num_slots); the others
        (-1 padding, and any out-of-range slot) are dropped before IPEX sees them."""
        keep = (slot_mapping >= 0) & (slot_mapping < layout.num_slots)
        slots = slot_mapping.long()
        if not bool(keep.all()):
            key, value, slots = key[keep], value[keep], slots[keep]
        if slots.numel() == 0:
            return
        key_cache, value_cache = ipex_views(kv_cache, layout)
        paged_attention_module().reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache,
                                                   slots.contiguous())

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, step: StepMetadata, scale: float,
                        softcap: float | None, out: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        plan: IpexPlan = step.plan
        if plan.decode is not None:
            self._decode(query, kv_cache, step.layout, plan, scale, softcap, out)
        if plan.prefill is not None:
            part = plan.prefill
            sub_out = torch.zeros((part.rows.numel(),) + tuple(out.shape[1:]), dtype=out.dtype, device=out.device)
            part.step.backend.paged_attention(query.index_select(0, part.rows), kv_cache, part.step, scale, softcap,
                                              sub_out)
            out.index_copy_(0, part.rows, sub_out)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout, plan: IpexPlan,
                scale: float, softcap: float | None, out: torch.Tensor) -> None:
        part = plan.decode
        q = query.index_select(0, part.rows)
        result = torch.empty_like(q)
        key_cache, value_cache = ipex_views(kv_cache, layout)
        capped = bool(softcap and softcap > 0)
        kernel = paged_attention_module().single_query_cached_kv_attention
        for rows in part.calls(capped, plan.head_mapping.numel() // layout.num_kv_heads):
            tables, lens = part.block_tables[rows], part.context_lens[rows]
            kernel(result[rows], q[rows], key_cache, value_cache, plan.head_mapping, float(scale), tables, lens,
                   layout.block_size, int(lens.max()), None, window_size=part.ipex_window(capped),
                   softcap=float(softcap) if capped else -1.0)
        out.index_copy_(0, part.rows, result)


def ipex_views(kv_cache: torch.Tensor, layout: KVCacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-copy K and V views [num_blocks, num_kv_heads, block_size, head_size] of a canonical cache
    (equal strides, unit content stride), the shape IPEX's paged kernels take."""
    return layout.keys(kv_cache).permute(0, 2, 1, 3), layout.values(kv_cache).permute(0, 2, 1, 3)


def safe_block_tables(table: torch.Tensor, context_lens: torch.Tensor, layout: KVCacheLayout,
                      sliding_window: int | None) -> torch.Tensor:
    """``table`` (int64 [n, width], a copy) made safe for a kernel that trusts it: entries before a
    request's first visible block (may be stale) and past its last one become a valid id (0); a
    request longer than its table, or a needed id outside [0, num_blocks), is a ValueError."""
    n, width = table.shape
    bs = layout.block_size
    needed = (context_lens + bs - 1) // bs
    if bool((needed > width).any()):
        raise ValueError(f"metadata.seq_lens needs up to {int(needed.max())} blocks, metadata.block_table has "
                         f"{width} columns")
    first = torch.zeros_like(context_lens)
    if sliding_window is not None:
        first = (context_lens - sliding_window).clamp(min=0) // bs
    column = torch.arange(width).unsqueeze(0)
    used = (column >= first.unsqueeze(1)) & (column < needed.unsqueeze(1))
    bad = used & ((table < 0) | (table >= layout.num_blocks))
    if bool(bad.any()):
        r, c = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"metadata.block_table[{r}, {c}] = {int(table[r, c])} is not a block id in "
                         f"[0, {layout.num_blocks})")
    return torch.where(used, table, torch.zeros_like(table))
