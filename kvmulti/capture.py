"""What a step prepared for graph capture (CUDA graphs, HIP graphs) is fixed to: its batch bucket.

A captured graph replays the very launches it recorded: the same grid, the same scalar arguments,
the same buffers. A step prepared with ``prepare_step(..., capture=CaptureBucket(...))`` therefore
launches for the bucket's maxima instead of the batch at hand, reads every length from the
metadata's device tensors (programs beyond a request's rows or keys exit early), and owns its
workspaces, so an engine can capture its layer calls once and replay them while the batch inside
the bucket changes (docs/design.md, "Steps prepared for graph capture").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CaptureBucket:
    """The maxima a captured step launches for; every replay's batch must lie within them.

    ``max_num_seqs``: requests (the metadata's ``num_reqs``: its device tensors hold this many
    entries, requests past the real ones padded with query length 0); ``max_num_tokens``: query
    rows of every layer call (the query, key, value, ``out`` and slot tensors have exactly this
    many rows); ``max_query_len``: new tokens of the longest request (1: a decode bucket);
    ``max_seq_len``: keys of the longest request (a replay beyond it stays correct, at the cost of
    the split-KV partitions planned for it).
    """

    max_num_seqs: int
    max_num_tokens: int
    max_query_len: int
    max_seq_len: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_tokens", "max_query_len", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CaptureBucket.{name} must be an int >= 1, got {value!r}")
        if self.max_query_len > self.max_num_tokens:
            raise ValueError(f"CaptureBucket.max_query_len {self.max_query_len} exceeds max_num_tokens "
                             f"{self.max_num_tokens}")
