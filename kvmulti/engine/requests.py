"""Request state of one runner: each request's tokens, and per-row lengths read vectorised by a step."""

from __future__ import annotations

from typing import Hashable

import numpy as np


class Request:
    """A request's state in one runner (read-only view: change it through the runner).

    Lengths live in the runner's per-row arrays, so a step reads them vectorised.
    """

    __slots__ = ("req_id", "row", "tokens", "_rows")

    def __init__(self, req_id: Hashable, row: int, tokens: list[int], rows: "RowArrays"):
        self.req_id, self.row, self.tokens, self._rows = req_id, row, tokens, rows

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V are in the cache."""
        return int(self._rows.computed[self.row])

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed

    def __repr__(self) -> str:
        return f"Request({self.req_id!r}, tokens={len(self.tokens)}, computed={self.num_computed})"


class RowArrays:
    """Per-row lengths of a runner's requests: computed tokens, known tokens, last token."""

    def __init__(self, rows: int = 8):
        self.computed = np.zeros(rows, dtype=np.int64)
        self.length = np.zeros(rows, dtype=np.int64)
        self.last_token = np.zeros(rows, dtype=np.int64)

    def ensure(self, row: int) -> None:
        if row >= len(self.computed):
            grow = max(row + 1, 2 * len(self.computed)) - len(self.computed)
            for name in ("computed", "length", "last_token"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(grow, dtype=np.int64)]))

    def set(self, row: int, tokens: list[int], computed: int) -> None:
        self.computed[row], self.length[row], self.last_token[row] = computed, len(tokens), tokens[-1]
