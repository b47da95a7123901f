"""The EXAMPLE backend: kvmulti's layout read and written with torch indexing (no kvmulti kernel,
no kvmulti.reference); CPU tensors, 16/32-bit caches, causal attention with window and softcap."""

from __future__ import annotations

import torch
from kvmulti.backends import Backend


class ExampleBackend(Backend):
    name = "EXAMPLE"
    platforms = ("cpu", "toyplat")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)

    def describe(self) -> str:
        return "cpu (torch, out of tree)"

    def write_kv(self, key, value, kv_cache, layout, slot_mapping, k_scale=None, v_scale=None) -> None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        blocks, offsets = slots // layout.block_size, slots % layout.block_size
        layout.keys(kv_cache)[blocks, offsets] = key[keep].to(layout.dtype)
        layout.values(kv_cache)[blocks, offsets] = value[keep].to(layout.dtype)

    def paged_attention(self, query, kv_cache, step, scale, softcap, out, k_scale=None, v_scale=None) -> None:
        common, layout = step.common, step.layout
        keys, values = layout.keys(kv_cache), layout.values(kv_cache)
        group = query.shape[1] // layout.num_kv_heads
        starts = common.query_start_loc_cpu.tolist()
        for i, seq_len in enumerate(common.seq_lens_cpu.tolist()):
            begin, end = starts[i], starts[i + 1]
            if end == begin:
                continue
            positions = torch.arange(seq_len)
            table = common.block_table[i].long()
            slots = (table[positions // layout.block_size], positions % layout.block_size)
            k = keys[slots].float().repeat_interleave(group, dim=1)        # [seq, Hq, D]
            v = values[slots].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", query[begin:end].float(), k) * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            q_pos = torch.arange(seq_len - (end - begin), seq_len)[:, None]
            hidden = positions[None, :] > q_pos
            if step.sliding_window is not None:
                hidden |= q_pos - positions[None, :] >= step.sliding_window
            weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
            out[begin:end] = torch.einsum("hqk,khd->qhd", weights, v).to(out.dtype)
