"""KV-cache groups, block pools and per-request block tables.

A model's attention layers are described by :class:`AttentionSpec` s; layers with EQUAL specs
share a :class:`KVCacheGroup` (one block size, one :class:`~kvmulti.layout.KVCacheLayout`, one
:class:`BlockPool`, one block table per request). A Gemma3-style model with sliding and full
layers therefore has two groups, and they may use different block sizes.

Each layer still has its OWN cache tensor (allocated from its group's layout); the layers of a
group share block ids, so one block table and one slot mapping per group serve all its layers.

Sliding-window groups give back, between steps, every block that lies entirely before the
earliest position a future query can see (``num_computed - window + 1``, minus an optional
rollback margin): a long request holds at most ``ceil((window + margin) / block_size) + 1``
blocks there. The freed entries of its block table are set to -1 and are never read (backends
skip blocks outside the window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import torch

from .layout import Allocator, KVCacheLayout, Order

#: Block-table value of a block that was never allocated or was given back (sliding window).
NO_BLOCK = -1


class OutOfBlocksError(RuntimeError):
    """A request needs more KV blocks than its group's pool has free.

    Nothing was allocated for the request in the failed call; other requests are untouched.
    """

    def __init__(self, req_id, group_id: int, needed: int, free: int, total: int):
        self.req_id, self.group_id, self.needed, self.free, self.total = req_id, group_id, needed, free, total
        super().__init__(f"request {req_id!r} needs {needed} more KV block(s) in group {group_id} but only "
                         f"{free} of {total} are free; finish or remove requests, or give the cache more "
                         "memory (num_blocks / memory budget)")


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer stores in its KV cache.

    ``sliding_window`` None is full attention; an int W keeps the last W positions (the query's
    own included). Equal specs (all fields) mean the layers can share a KV-cache group.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int | None = None
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AttentionSpec.{name} must be a positive int, got {value!r}")
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"AttentionSpec.sliding_window must be None or an int >= 1, got {w!r}")

    @property
    def kind(self) -> str:
        """``"full"`` or ``"sliding"``."""
        return "full" if self.sliding_window is None else "sliding"

    @property
    def value_size(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of ONE layer."""
        return (self.block_size * self.num_kv_heads * (self.head_size + self.value_size)
                * self.dtype.itemsize)

    def layout(self, num_blocks: int, order: Order = "NHD") -> KVCacheLayout:
        return KVCacheLayout(num_blocks=num_blocks, block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                             head_size=self.head_size, head_size_v=self.head_size_v, dtype=self.dtype,
                             order=order)

    def max_blocks_held(self, margin: int = 0) -> int | None:
        """Most blocks a decoding request holds in a group of this spec (None: unbounded)."""
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window + margin) // self.block_size) + 1


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec, one block pool and one block table per request."""

    group_id: int
    spec: AttentionSpec
    layer_names: tuple[str, ...]


def group_layers(layer_specs: Mapping[str, AttentionSpec]) -> tuple[KVCacheGroup, ...]:
    """Group layers with equal specs; groups are numbered in order of their first layer."""
    by_spec: dict[AttentionSpec, list[str]] = {}
    for name, spec in layer_specs.items():
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"layer {name!r}: expected an AttentionSpec, got {type(spec).__name__}")
        by_spec.setdefault(spec, []).append(name)
    return tuple(KVCacheGroup(i, spec, tuple(names)) for i, (spec, names) in enumerate(by_spec.items()))


@dataclass(frozen=True)
class KVCacheConfig:
    """The groups of one model, and one layout (hence one block count) per group."""

    groups: tuple[KVCacheGroup, ...]
    layouts: tuple[KVCacheLayout, ...]        # layouts[g] belongs to groups[g]

    @classmethod
    def build(cls, layer_specs: Mapping[str, AttentionSpec], num_blocks: int | Mapping[int, int] | None = None,
              memory_bytes: int | None = None, order: Order = "NHD") -> "KVCacheConfig":
        """Group ``layer_specs`` and size every group's pool.

        Give exactly one of ``num_blocks`` (an int for every group, or ``{group_id: n}``) and
        ``memory_bytes`` (a budget for ALL cache tensors of all layers: every group gets the
        same number of blocks, the largest that fits).
        """
        if not layer_specs:
            raise ValueError("a KV-cache config needs at least one attention layer")
        groups = group_layers(layer_specs)
        if (num_blocks is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_blocks and memory_bytes")
        if memory_bytes is not None:
            per_block = sum(g.spec.page_size_bytes * len(g.layer_names) for g in groups)
            n = int(memory_bytes) // per_block
            if n < 1:
                raise ValueError(f"memory budget of {memory_bytes} bytes is below one block per group "
                                 f"({per_block} bytes over {sum(len(g.layer_names) for g in groups)} layers)")
            counts = {g.group_id: n for g in groups}
        elif isinstance(num_blocks, Mapping):
            missing = [g.group_id for g in groups if g.group_id not in num_blocks]
            if missing:
                raise ValueError(f"num_blocks has no entry for group(s) {missing}")
            counts = {g.group_id: int(num_blocks[g.group_id]) for g in groups}
        else:
            counts = {g.group_id: int(num_blocks) for g in groups}
        layouts = tuple(g.spec.layout(counts[g.group_id], order) for g in groups)
        return cls(groups, layouts)

    def layer_to_group(self) -> dict[str, int]:
        return {name: g.group_id for g in self.groups for name in g.layer_names}

    def layer_layouts(self) -> dict[str, KVCacheLayout]:
        """Each layer's layout (its group's), e.g. for :func:`kvmulti.export_blocks`."""
        return {name: lay for g, lay in zip(self.groups, self.layouts) for name in g.layer_names}

    def memory_bytes(self) -> int:
        return sum(lay.page_size_bytes * lay.num_blocks * len(g.layer_names)
                   for g, lay in zip(self.groups, self.layouts))

    def allocate_caches(self, device: torch.device | str = "cpu",
                        allocators: Mapping[int, Allocator | None] | None = None) -> dict[str, torch.Tensor]:
        """One zeroed cache tensor per layer, from its group's layout (and the group's allocator,
        e.g. SYCL USM memory, when ``allocators`` names one)."""
        allocators = allocators or {}
        return {name: lay.allocate(device, allocators.get(g.group_id))
                for g, lay in zip(self.groups, self.layouts) for name in g.layer_names}

    def describe(self) -> str:
        lines = []
        for g, lay in zip(self.groups, self.layouts):
            w = f" window={g.spec.sliding_window}" if g.spec.sliding_window else ""
            lines.append(f"group {g.group_id}: {g.spec.kind}{w} block_size={lay.block_size} "
                         f"blocks={lay.num_blocks} kv_heads={lay.num_kv_heads} head_size={lay.head_size} "
                         f"layers={len(g.layer_names)}")
        return "\n".join(lines)


class BlockPool:
    """Free list of one group's block ids: O(1) allocate and free, double frees detected."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))     # a stack: pop() hands out 0, 1, 2, ...
        self._in_use = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` block ids; ValueError (nothing taken) if fewer are free."""
        if n > len(self._free):
            raise ValueError(f"{n} blocks requested, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._in_use[b] = 1
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b < 0 or b >= self.num_blocks or not self._in_use[b]:
                raise ValueError(f"block {b} is not allocated from this pool")
            self._in_use[b] = 0
            self._free.append(b)


class BlockTables:
    """Every request's block table for ONE group, in a persistent int32 array.

    Row ``r`` holds the logical blocks of the request in row ``r``; column ``j`` covers positions
    ``j * block_size .. (j + 1) * block_size - 1``. ``held[r]`` counts the leading columns that
    were ever allocated (entries freed by the sliding window are :data:`NO_BLOCK`); ``first[r]``
    is the first column still holding a block. Two derived arrays keep per-step checks
    vectorised: ``capacity[r] = held[r] * block_size`` (positions covered) and, for sliding
    groups, ``release_at[r]``: the computed length (before the rollback margin) from which
    column ``first[r]`` lies outside every future window.
    """

    def __init__(self, group: KVCacheGroup, pool: BlockPool, max_rows: int = 8, max_cols: int = 8):
        self.group, self.pool = group, pool
        self.block_size = group.spec.block_size
        self.window = group.spec.sliding_window
        self.table = np.full((max_rows, max_cols), NO_BLOCK, dtype=np.int32)
        self.held = np.zeros(max_rows, dtype=np.int64)
        self.first = np.zeros(max_rows, dtype=np.int64)
        self.capacity = np.zeros(max_rows, dtype=np.int64)
        self.release_at = np.zeros(max_rows, dtype=np.int64)

    def _set(self, row: int, held: int, first: int) -> None:
        self.held[row], self.first[row], self.capacity[row] = held, first, held * self.block_size
        if self.window is not None:
            self.release_at[row] = (first + 1) * self.block_size + self.window - 1

    def _grow(self, rows: int, cols: int) -> None:
        r, c = self.table.shape
        if rows <= r and cols <= c:
            return
        new = np.full((max(rows, 2 * r if rows > r else r), max(cols, 2 * c if cols > c else c)), NO_BLOCK,
                      dtype=np.int32)
        new[:r, :c] = self.table
        self.table = new
        extra = new.shape[0] - r
        if extra:
            for name in ("held", "first", "capacity", "release_at"):
                setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, dtype=np.int64)]))

    def add_row(self, row: int) -> None:
        """Make room for row ``row`` (a new request); it holds no blocks."""
        self._grow(row + 1, 1)
        self._set(row, 0, 0)

    def blocks_needed(self, row: int, num_tokens: int) -> int:
        """New blocks row ``row`` needs to hold positions 0 .. num_tokens - 1."""
        return max(0, -(-num_tokens // self.block_size) - int(self.held[row]))

    def ensure(self, row: int, num_tokens: int, req_id=None) -> None:
        """Allocate blocks so that row ``row`` covers ``num_tokens`` positions.

        OutOfBlocksError (nothing allocated) when the pool is short.
        """
        need = self.blocks_needed(row, num_tokens)
        if need == 0:
            return
        if need > self.pool.num_free:
            raise OutOfBlocksError(req_id, self.group.group_id, need, self.pool.num_free, self.pool.num_blocks)
        self.append_blocks(row, need)

    def append_blocks(self, row: int, n: int) -> None:
        """Give row ``row`` ``n`` more blocks from the pool (the pool's ValueError if it has fewer)."""
        start = int(self.held[row])
        end = start + n
        if row >= self.table.shape[0] or end > self.table.shape[1]:
            self._grow(row + 1, end)
        if n == 1:                                            # the per-step case: a scalar store
            self.table[row, start] = self.pool.allocate(1)[0]
        else:
            self.table[row, start:end] = self.pool.allocate(n)
        self.held[row], self.capacity[row] = end, end * self.block_size

    def release_out_of_window(self, row: int, num_computed: int, margin: int = 0) -> int:
        """Sliding groups: give back blocks entirely before ``num_computed - window + 1 - margin``.

        Those positions are outside every future query's window (queries start at
        ``num_computed``; ``margin`` keeps room for a rollback of that many tokens). Returns the
        number of blocks freed.
        """
        if self.window is None:
            return 0
        earliest = num_computed - self.window + 1 - margin
        last_free_col = min(earliest // self.block_size, int(self.held[row]))   # columns < this are invisible
        start = int(self.first[row])
        if last_free_col <= start:
            return 0
        self.pool.free(self.table[row, start:last_free_col].tolist())
        self.table[row, start:last_free_col] = NO_BLOCK
        self._set(row, int(self.held[row]), last_free_col)
        return last_free_col - start

    def rows_to_release(self, rows: np.ndarray, num_computed: np.ndarray, margin: int = 0) -> np.ndarray:
        """Indices into ``rows`` whose :meth:`release_out_of_window` may free something (vectorised)."""
        if self.window is None:
            return np.zeros(0, dtype=np.int64)
        return np.nonzero(num_computed - margin >= self.release_at[rows])[0]

    def visible_from(self, row: int) -> int:
        """First position whose block this row still holds."""
        return int(self.first[row]) * self.block_size

    def truncate(self, row: int, num_tokens: int) -> None:
        """Give back blocks past those covering ``num_tokens`` positions (rollback)."""
        keep = -(-num_tokens // self.block_size)
        held = int(self.held[row])
        if keep >= held:
            return
        start = max(keep, int(self.first[row]))
        self.pool.free(int(b) for b in self.table[row, start:held])
        self.table[row, keep:held] = NO_BLOCK
        self._set(row, keep, min(int(self.first[row]), keep))

    def release(self, row: int) -> None:
        """Give back every block of the row (request finished)."""
        held, start = int(self.held[row]), int(self.first[row])
        self.pool.free(int(b) for b in self.table[row, start:held])
        self.table[row, :held] = NO_BLOCK
        self._set(row, 0, 0)

    def num_held(self, row: int) -> int:
        return int(self.held[row] - self.first[row])

    def row_blocks(self, row: int) -> list[int]:
        return self.table[row, : int(self.held[row])].tolist()
