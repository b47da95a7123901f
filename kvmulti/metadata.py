"""Backend-agnostic attention metadata, built once per KV-cache group per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

#: Largest value of the int32 metadata tensors (positions, lengths, block ids).
INT32_MAX = 2**31 - 1


@dataclass
class CommonAttentionMetadata:
    """What every backend needs to run one step of paged attention for one KV-cache group.

    Request ``i``'s new tokens are rows ``query_start_loc[i]:query_start_loc[i+1]`` of the query
    and are the LAST ``query_len`` of its ``seq_lens[i]`` positions.

    Device tensors (on the model's device):
      query_start_loc: int32 [num_reqs + 1], cumulative query lengths, starts at 0.
      seq_lens:        int32 [num_reqs], context + new tokens per request.
      block_table:     int32 [num_reqs, max_blocks_per_req], this group's block ids.
      slot_mapping:    int64 [num_tokens], this group's slot per new token (-1 = padding, not written).
    Host copies (CPU, int32) so that launchers size their grids without a device sync:
      query_start_loc_cpu, seq_lens_cpu.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.query_start_loc_cpu is None:
            self.query_start_loc_cpu = self.query_start_loc.to("cpu", torch.int32)
        if self.seq_lens_cpu is None:
            self.seq_lens_cpu = self.seq_lens.to("cpu", torch.int32)

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @classmethod
    def from_lens(cls, query_lens: Sequence[int] | torch.Tensor, seq_lens: Sequence[int] | torch.Tensor,
                  block_table: torch.Tensor, block_size: int, device: torch.device | str | None = None,
                  causal: bool = True) -> "CommonAttentionMetadata":
        """Build metadata from per-request lengths and a block table.

        Computes ``query_start_loc`` and ``slot_mapping`` (slot = block_id * block_size + offset).
        Raises ValueError when a query_len exceeds its seq_len or the block table is too narrow
        for a seq_len, TypeError for a non-integer block table. ``device`` defaults to the block
        table's device.
        """
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
        if block_table.dtype.is_floating_point or block_table.dtype == torch.bool or block_table.dim() != 2:
            raise TypeError(f"block_table must be a 2-D integer tensor, got {block_table.dtype} "
                            f"with {block_table.dim()} dims")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        device = torch.device(device) if device is not None else block_table.device
        q = _as_int_list(query_lens, "query_lens")
        s = _as_int_list(seq_lens, "seq_lens")
        if len(q) != len(s):
            raise ValueError(f"query_lens has {len(q)} entries but seq_lens has {len(s)}: one of each per request")
        if block_table.shape[0] != len(q):
            raise ValueError(f"block_table has {block_table.shape[0]} rows for {len(q)} requests")
        if block_table.dtype != torch.int32 and block_table.numel():
            low, high = (int(v) for v in torch.aminmax(block_table))
            if low < -INT32_MAX - 1 or high > INT32_MAX:
                raise ValueError(f"block_table holds block id {high if high > INT32_MAX else low}, outside the int32 "
                                 "range of block ids")
        for i, (ql, sl) in enumerate(zip(q, s)):
            if ql < 0 or sl < 1:
                raise ValueError(f"request {i}: query_len must be >= 0 and seq_len >= 1, got {ql}, {sl}")
            if ql > sl:
                raise ValueError(f"request {i}: query_len {ql} exceeds seq_len {sl}")
            if sl > INT32_MAX:
                raise ValueError(f"request {i}: seq_len {sl} exceeds the int32 range of seq_lens ({INT32_MAX})")
        if sum(q) > INT32_MAX:
            raise ValueError(f"the query lengths add up to {sum(q)}, beyond the int32 range of query_start_loc")
        max_blocks_needed = max((-(-sl // block_size) for sl in s), default=0)
        if max_blocks_needed > block_table.shape[1]:
            raise ValueError(f"block_table has {block_table.shape[1]} columns but a seq_len of {max(s)} "
                             f"with block_size {block_size} needs {max_blocks_needed}")

        q_cpu = torch.tensor(q, dtype=torch.int64)
        s_cpu = torch.tensor(s, dtype=torch.int64)
        qsl_cpu = torch.zeros(len(q) + 1, dtype=torch.int32)
        torch.cumsum(q_cpu, 0, out=qsl_cpu[1:])
        num_tokens = int(qsl_cpu[-1])
        req_of_token = torch.repeat_interleave(torch.arange(len(q)), q_cpu)
        pos = (torch.arange(num_tokens) - qsl_cpu[:-1].long()[req_of_token]
               + (s_cpu - q_cpu)[req_of_token])
        bt_cpu = block_table.to("cpu", torch.int64)
        slot = bt_cpu[req_of_token, pos // block_size] * block_size + pos % block_size
        return cls(
            query_start_loc=qsl_cpu.to(device),
            seq_lens=s_cpu.to(torch.int32).to(device),
            block_table=block_table.to(device=device, dtype=torch.int32),
            slot_mapping=slot.to(device),
            num_reqs=len(q),
            num_actual_tokens=num_tokens,
            max_query_len=max(q, default=0),
            max_seq_len=max(s, default=0),
            causal=causal,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=s_cpu.to(torch.int32),
        )


def _as_int_list(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {values.dtype}")
        return [int(v) for v in values.tolist()]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must hold ints, got {type(v).__name__}")
        out.append(v)
    return out


def first_visible_position(context_len, sliding_window: int | None):
    """The earliest key position the FIRST new token of a request can see, given the request's
    context length (seq_len - query_len; the first new token sits at that position): 0 without a
    window, else max(0, context_len - sliding_window + 1). Later tokens of the request see no
    earlier key, so keys before it are never read. Works on ints, numpy arrays and torch tensors."""
    if sliding_window is None:
        return context_len * 0
    first = context_len - sliding_window + 1
    return max(first, 0) if isinstance(first, int) else first.clip(min=0)


def max_visible_span(max_seq_len: int, sliding_window: int | None) -> int:
    """The most keys one query row can see: the longest sequence, or the window when shorter."""
    return max_seq_len if not sliding_window else min(max_seq_len, sliding_window)
