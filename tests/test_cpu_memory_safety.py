"""The native CPU kernel never writes outside out / the cache, whatever the metadata says.

The backend object is called directly (bypassing kvmulti.ops' validation) with metadata built as a
plain CommonAttentionMetadata; query, out and the cache are views in the middle of larger guard
buffers whose margins hold a sentinel, and the margins (and, for attention, the whole cache) must be
untouched afterwards. Wrong numbers for invalid metadata are allowed; a stray write or a crash is not.
"""

import pytest
import torch

import kvmulti
from kvmulti.backends.cpu import native as cpu_native
from kvmulti.backends.registry import get_backend

MARGIN = 4096          # elements of guard on each side
SENTINEL = 1234.5      # exactly representable in fp32, fp16 and bf16
HKV, GROUP, HEAD = 2, 4, 64
NUM_BLOCKS, BLOCK = 6, 16


def attend(backend, query, cache, layout, md, scale, window, softcap, out):
    """The backend's per-step hook, then its kernel: the unvalidated path an engine's step takes."""
    backend.paged_attention(query, cache, backend.build_metadata(md, layout, query.shape[1], window), scale, softcap,
                            out)


@pytest.fixture(scope="module")
def backend():
    module, reason = cpu_native.status()
    if module is None:
        pytest.skip(f"native CPU kernel not available: {reason}")
    return get_backend("CPU")


class Guarded:
    """A tensor of `shape` / `strides` in the middle of a sentinel-filled buffer."""

    def __init__(self, shape, strides, dtype, fill=None):
        span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        self.buf = torch.full((span + 2 * MARGIN,), SENTINEL, dtype=dtype)
        self.span = span
        self.view = self.buf[MARGIN:MARGIN + span].as_strided(shape, strides)
        if fill is not None:
            self.view.copy_(fill)

    def margins_intact(self) -> bool:
        return bool((self.buf[:MARGIN] == SENTINEL).all() and (self.buf[MARGIN + self.span:] == SENTINEL).all())


def contiguous_strides(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def guarded_cache(order, dtype):
    layout = kvmulti.KVCacheLayout(num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=HKV, head_size=HEAD,
                                   dtype=dtype, order=order)
    s = layout.expected_strides()
    values = torch.randn(layout.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    return layout, Guarded(layout.shape, (s.block, s.token, s.head, 1), dtype, values)


def metadata(qsl, seq_lens, table):
    qsl = torch.tensor(qsl, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    rows = int(max(0, qsl.max().item())) if len(qsl) else 0
    return kvmulti.CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=seq, block_table=torch.tensor(table, dtype=torch.int32).reshape(len(table), -1),
        slot_mapping=torch.zeros(max(rows, 1), dtype=torch.int64), num_reqs=len(seq), num_actual_tokens=max(rows, 1),
        max_query_len=max(rows, 1), max_seq_len=int(max(seq_lens, default=1)))


BIG = 2**31 - 1
# (query_start_loc, seq_lens, block_table): each breaks the contract in one way.
BAD_METADATA = {
    "query_start_loc beyond the query rows": ([0, 1, 40], [20, 30], [[0, 1], [2, 3]]),
    "query_start_loc not monotonic": ([0, 3, 1, 4], [10, 5, 9], [[0], [1], [2]]),
    "query_start_loc negative": ([-5, 1, 2], [8, 8], [[0], [1]]),
    "seq_lens huge": ([0, 1, 2], [BIG, 2**30], [[0, 1], [2, 3]]),
    "seq_lens negative": ([0, 2, 3], [-7, -1], [[0], [1]]),
    "block table narrower than the context": ([0, 1, 2], [500, 70], [[0], [1]]),
    "fewer block-table rows than requests": ([0, 1, 2, 3], [20, 20, 20], [[0, 1]]),
    "block ids out of range": ([0, 1, 3], [40, 33], [[-1, NUM_BLOCKS, 2**30], [-(2**31), 5, NUM_BLOCKS + 1]]),
}


@pytest.mark.parametrize("partition_len", [0, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_attention_stays_inside_its_tensors(backend, monkeypatch, case, order, dtype, partition_len):
    monkeypatch.setattr(backend, "partition_size", partition_len or -1)
    qsl, seq_lens, table = BAD_METADATA[case]
    rows = 3
    layout, cache = guarded_cache(order, dtype)
    before = cache.buf.clone()
    qshape, oshape = (rows, HKV * GROUP, HEAD), (rows, HKV * GROUP, HEAD)
    query = Guarded(qshape, contiguous_strides(qshape), dtype, torch.randn(qshape).to(dtype))
    out = Guarded(oshape, contiguous_strides(oshape), dtype, torch.zeros(oshape, dtype=dtype))
    md = metadata(qsl, seq_lens, table)
    for window in (None, 7):
        attend(backend, query.view, cache.view, layout, md, HEAD ** -0.5, window, None, out.view)
    assert out.margins_intact(), f"{case}: write outside out"
    assert query.margins_intact(), f"{case}: write outside query"
    assert torch.equal(cache.buf, before), f"{case}: attention changed the cache or its margins"


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_valid_requests_beside_invalid_ones_are_still_right(backend, order):
    # A request whose rows fall outside the query is skipped; the valid request keeps its result.
    dtype = torch.float32
    layout, cache = guarded_cache(order, dtype)
    query = torch.randn(2, HKV * GROUP, HEAD)
    good = metadata([0, 1], [20], [[3, 4]])
    expected = torch.zeros(2, HKV * GROUP, HEAD)
    attend(backend, query, cache.view, layout, good, HEAD ** -0.5, None, None, expected)
    out = torch.zeros(2, HKV * GROUP, HEAD)
    attend(backend, query, cache.view, layout, metadata([0, 1, 9], [20, 30], [[3, 4], [0, 1]]),
                            HEAD ** -0.5, None, None, out)
    torch.testing.assert_close(out[0], expected[0])


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_write_kv_skips_slots_outside_the_cache(backend, order):
    dtype = torch.bfloat16
    layout, cache = guarded_cache(order, dtype)
    tokens = 6
    kshape = (tokens, HKV, HEAD)
    key = Guarded(kshape, contiguous_strides(kshape), dtype, torch.randn(kshape).to(dtype))
    value = Guarded(kshape, contiguous_strides(kshape), dtype, torch.randn(kshape).to(dtype))
    num_slots = NUM_BLOCKS * BLOCK
    # in range: 5 and num_slots - 1; the rest must be skipped; 8 slots for 6 key rows (the last 2 unread).
    slots = torch.tensor([5, num_slots, -1, -(2**40), 2**40, num_slots - 1, 7, 9], dtype=torch.int64)
    expected = cache.view.clone()
    for t, slot in enumerate(slots.tolist()[:tokens]):
        if 0 <= slot < num_slots:
            expected[slot // BLOCK, slot % BLOCK, :, :HEAD] = key.view[t]
            expected[slot // BLOCK, slot % BLOCK, :, HEAD:] = value.view[t]
    backend.write_kv(key.view, value.view, cache.view, layout, slots)
    assert cache.margins_intact(), "write outside the cache"
    assert torch.equal(cache.view, expected)
    assert key.margins_intact() and value.margins_intact()
