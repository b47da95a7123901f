"""KV-cache specs, groups, configs, block pools and per-request block tables."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from kvmulti.kv_cache import (NO_BLOCK, AttentionSpec, BlockPool, BlockTables, KVCacheConfig, KVCacheGroup,
                              OutOfBlocksError, group_layers)

FULL = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
SLIDING = AttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=100)


def test_spec_validation_and_sizes():
    assert FULL.kind == "full" and SLIDING.kind == "sliding"
    assert FULL.page_size_bytes == 16 * 2 * 128 * 2
    assert AttentionSpec(4, 1, 8, head_size_v=0).value_size == 0
    assert SLIDING.max_blocks_held() == 5 and SLIDING.max_blocks_held(margin=5) == 5 and FULL.max_blocks_held() is None
    for bad in (dict(block_size=0), dict(num_kv_heads=-1), dict(head_size=1.5), dict(sliding_window=0)):
        with pytest.raises(ValueError):
            AttentionSpec(**{**dict(block_size=4, num_kv_heads=1, head_size=8), **bad})


def test_equal_specs_form_groups():
    specs = {"l0": SLIDING, "l1": FULL, "l2": SLIDING, "l3": SLIDING, "l4": FULL}
    groups = group_layers(specs)
    assert groups == (KVCacheGroup(0, SLIDING, ("l0", "l2", "l3")), KVCacheGroup(1, FULL, ("l1", "l4")))
    with pytest.raises(TypeError):
        group_layers({"l0": "full"})


def test_config_from_explicit_blocks_and_budget():
    specs = {"l0": SLIDING, "l1": FULL, "l2": SLIDING}
    cfg = KVCacheConfig.build(specs, num_blocks=10)
    assert [lay.num_blocks for lay in cfg.layouts] == [10, 10]
    assert [lay.block_size for lay in cfg.layouts] == [32, 16]          # different block sizes per group
    assert cfg.layer_to_group() == {"l0": 0, "l2": 0, "l1": 1}
    cfg = KVCacheConfig.build(specs, num_blocks={0: 3, 1: 7}, order="HND")
    assert [(lay.num_blocks, lay.order) for lay in cfg.layouts] == [(3, "HND"), (7, "HND")]
    caches = cfg.allocate_caches()
    assert set(caches) == {"l0", "l1", "l2"} and caches["l0"].data_ptr() != caches["l2"].data_ptr()
    for name, cache in caches.items():
        cfg.layouts[cfg.layer_to_group()[name]].validate(cache)

    per_block = 2 * SLIDING.page_size_bytes + FULL.page_size_bytes
    budget = 50 * per_block + per_block - 1
    cfg = KVCacheConfig.build(specs, memory_bytes=budget)
    assert [lay.num_blocks for lay in cfg.layouts] == [50, 50]
    assert cfg.memory_bytes() <= budget < cfg.memory_bytes() + per_block
    with pytest.raises(ValueError, match="below one block"):
        KVCacheConfig.build(specs, memory_bytes=per_block - 1)
    with pytest.raises(ValueError, match="exactly one"):
        KVCacheConfig.build(specs)
    with pytest.raises(ValueError, match="exactly one"):
        KVCacheConfig.build(specs, num_blocks=4, memory_bytes=10**6)
    with pytest.raises(ValueError, match="no entry for group"):
        KVCacheConfig.build(specs, num_blocks={0: 3})


def test_block_pool_allocate_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(ValueError, match="3 blocks requested, 1 free"):
        pool.allocate(3)
    assert pool.num_free == 1                                  # a failed allocation takes nothing
    pool.free([a[1]])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[1]])                                      # double free
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([7])
    assert sorted(pool.allocate(2)) == sorted([a[1], 3])


@settings(max_examples=examples(40))
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_block_pool_never_hands_out_a_block_twice(ops):
    pool, held = BlockPool(12), []
    for alloc, n in ops:
        if alloc and n <= pool.num_free:
            got = pool.allocate(n)
            assert not set(got) & set(held)
            held += got
        elif held:
            pool.free(held[:n])
            held = held[n:]
        assert pool.num_free + len(held) == 12


def test_block_table_growth_rollback_and_release():
    group = KVCacheGroup(0, AttentionSpec(4, 1, 8), ("l0",))
    pool = BlockPool(10)
    tables = BlockTables(group, pool, max_rows=1, max_cols=1)
    tables.add_row(2)
    tables.ensure(2, 9)                                        # 9 positions -> 3 blocks, arrays grow
    assert tables.num_held(2) == 3 and pool.num_free == 7
    tables.ensure(2, 12)
    assert tables.num_held(2) == 3                             # still fits
    tables.ensure(0, 28)                                       # 7 blocks: the pool is empty now
    assert pool.num_free == 0
    with pytest.raises(OutOfBlocksError, match="request 'r1' needs 1 more KV block.* 0 of 10 are free"):
        tables.ensure(1, 1, req_id="r1")
    assert tables.num_held(1) == 0
    tables.release(0)
    with pytest.raises(OutOfBlocksError, match="request 'big' needs 11 more KV block"):
        tables.ensure(0, 44, req_id="big")
    assert pool.num_free == 7 and tables.num_held(0) == 0      # nothing taken
    tables.truncate(2, 5)                                      # keep ceil(5 / 4) = 2 blocks
    assert tables.num_held(2) == 2 and pool.num_free == 8
    assert tables.table[2, 2] == NO_BLOCK
    tables.release(2)
    assert pool.num_free == 10


def test_sliding_window_releases_blocks_outside_the_window():
    window, bs = 10, 4
    group = KVCacheGroup(0, AttentionSpec(bs, 1, 8, sliding_window=window), ("l0",))
    pool = BlockPool(6)
    tables = BlockTables(group, pool)
    tables.add_row(0)
    bound = group.spec.max_blocks_held()                       # ceil(10 / 4) + 1 = 4
    for computed in range(1, 400):                             # decode: one new position per step
        tables.ensure(0, computed)
        assert tables.num_held(0) <= bound
        tables.release_out_of_window(0, computed)
        earliest = max(0, computed - window + 1)               # what the next query still sees
        assert tables.visible_from(0) <= earliest
        blocks = tables.row_blocks(0)
        assert all(b == NO_BLOCK for b in blocks[: earliest // bs])
        assert all(b != NO_BLOCK for b in blocks[earliest // bs:])
    assert pool.num_free + tables.num_held(0) == 6


def test_sliding_window_margin_keeps_rollback_room():
    window, bs, margin = 10, 4, 5
    spec = AttentionSpec(bs, 1, 8, sliding_window=window)
    tables = BlockTables(KVCacheGroup(0, spec, ("l0",)), BlockPool(8))
    tables.add_row(0)
    for computed in range(1, 100):
        tables.ensure(0, computed)
        assert tables.num_held(0) <= spec.max_blocks_held(margin)
        tables.release_out_of_window(0, computed, margin)
        assert tables.visible_from(0) <= max(0, computed - margin - window + 1)
