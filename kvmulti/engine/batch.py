"""The inputs of one forward, as the runner prepares them from a schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .. import CommonAttentionMetadata, StepMetadata


@dataclass
class StepBatch:
    """The inputs of one forward: packed tokens, positions, per-group metadata, logits rows."""

    req_ids: list
    query_lens: np.ndarray                          # int64 [R]
    rows: np.ndarray                                # int64 [R], the requests' block-table rows
    input_ids: torch.Tensor                         # int64 [T]
    positions: torch.Tensor                         # int64 [T]
    metadata: dict[int, CommonAttentionMetadata]    # group id -> metadata
    steps: dict[int, StepMetadata]                  # group id -> what its backend prepared from it
    logits_indices: torch.Tensor                    # int64 [L], rows of the packed tokens
    logits_all_rows: bool = False                   # logits_indices is 0..T-1 (pure decode)
    num_logits: list[int] = field(default_factory=list)
