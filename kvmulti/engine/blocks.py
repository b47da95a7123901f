"""Block allocation of a step: every scheduled request's new blocks in each KV-cache group, all or none."""

from __future__ import annotations

from typing import Hashable, Mapping

import numpy as np

from ..kv_cache import BlockTables, OutOfBlocksError


def allocate(tables: Mapping[int, BlockTables], req_ids: list[Hashable], rows: np.ndarray, seq: np.ndarray) -> None:
    """Allocate every scheduled request's new blocks, or raise for the first that cannot get
    them -- before allocating anything, so no request is changed by a failed step."""
    plans = []
    for gid, table in tables.items():
        if (seq <= table.capacity[rows]).all():
            continue                                      # the common decode case
        need = (seq + (table.block_size - 1)) // table.block_size - table.held[rows]
        np.maximum(need, 0, out=need)
        total = int(need.sum())
        if total > table.pool.num_free:
            i = int(np.nonzero(np.cumsum(need) > table.pool.num_free)[0][0])
            free = table.pool.num_free - int(need[:i].sum())
            raise OutOfBlocksError(req_ids[i], gid, int(need[i]), free, table.pool.num_blocks)
        plans.append((table, need))
    for table, need in plans:
        idx = np.flatnonzero(need)
        for row, n in zip(rows[idx].tolist(), need[idx].tolist()):
            table.append_blocks(row, n)
