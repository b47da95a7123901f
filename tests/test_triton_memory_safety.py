"""Memory safety of the Triton kernels under invalid metadata (Triton interpreter, CPU tensors).

Whatever the metadata values say, ``unified_attention`` and ``write_kv`` must not read or write
outside the query, output, cache and metadata tensors. The backend object is called directly
(bypassing ``kvmulti.ops`` validation) with ``CommonAttentionMetadata`` built by hand. Query, output
and cache are views in the middle of larger guard buffers whose margins hold NaN: a write there
changes the margin, a read there turns the output non-finite (the cache interior and the query are
finite, and a masked key contributes nothing). Wrong numbers for invalid metadata are acceptable,
so only the margins, the cache and the finiteness of single-pass outputs are asserted.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import kvmulti  # noqa: E402
from kvmulti.backends import get_backend  # noqa: E402
from kvmulti.backends import triton as triton_backend  # noqa: E402
from kvmulti.backends.triton import TritonBackend  # noqa: E402

MARGIN = 4096          # elements of guard on each side of every tensor the kernels touch
NUM_BLOCKS, BLOCK_SIZE, HKV, G, HS = 6, 16, 2, 2, 32

pytestmark = pytest.mark.skipif(not triton_backend.interpreting(), reason="runs the kernels under TRITON_INTERPRET=1")


def guarded(shape: tuple[int, ...], strides: tuple[int, ...] | None, dtype: torch.dtype, fill: torch.Tensor | None):
    """(view, buffer): a tensor of ``shape``/``strides`` at offset MARGIN of a NaN-filled buffer."""
    strides = strides or torch.empty(shape).stride()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    buf = torch.full((span + 2 * MARGIN,), float("nan"), dtype=dtype)
    view = torch.as_strided(buf, shape, strides, MARGIN)
    view.copy_(fill if fill is not None else torch.zeros(shape, dtype=dtype))
    return view, buf


def margins_untouched(buf: torch.Tensor) -> bool:
    return bool(torch.isnan(buf[:MARGIN]).all() and torch.isnan(buf[-MARGIN:]).all())


def make_cache(order: str, dtype: torch.dtype):
    layout = kvmulti.KVCacheLayout(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=HKV, head_size=HS,
                                   dtype=dtype, order=order)
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(layout.shape, generator=gen).to(dtype)
    cache, buf = guarded(layout.shape, tuple(layout.expected_strides()), dtype, data)
    return layout, cache, buf


def metadata(qsl, seq_lens, table, num_tokens, slots=None) -> kvmulti.CommonAttentionMetadata:
    qsl = torch.tensor(qsl, dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    table = torch.tensor(table, dtype=torch.int32).reshape(len(table), -1)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64) if slots is None else torch.tensor(slots)
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    return kvmulti.CommonAttentionMetadata(qsl, seq, table, slots, num_reqs=len(seq_lens), num_actual_tokens=num_tokens,
                                           max_query_len=max(max(q_lens), 1), max_seq_len=max(max(seq_lens), 1))


# (name, query_start_loc, seq_lens, block table rows, num_actual_tokens); the query has 6 rows.
BAD_METADATA = [
    ("block_ids_out_of_range", [0, 3, 4], [20, 40], [[0, 1, 99], [-1, 2, 6]], 4),
    ("seq_lens_huge_table_narrow", [0, 2, 3], [2 ** 31 - 1, 10 ** 6], [[0, 1], [2, 3]], 3),
    ("seq_lens_negative", [0, 2, 3], [-50, -1], [[0, 1], [2, 3]], 3),
    ("table_fewer_rows_than_requests", [0, 1, 2, 3], [30, 30, 30], [[0, 1]], 3),
    ("qsl_not_monotonic", [0, 5, 2, 6], [16, 40, 20], [[0, 1, 2], [3, 4, 5], [0, 1, 2]], 6),
    ("qsl_beyond_query_rows", [0, 4, 900], [20, 1000], [[0, 1, 2], [3, 4, 5]], 6),
    ("qsl_negative_start", [-7, 1, 2], [20, 20], [[0, 1], [2, 3]], 2),
    ("num_tokens_beyond_query", [0, 3, 40], [10, 50], [[0, 1, 2, 3], [4, 5, 0, 1]], 40),
]


@pytest.mark.parametrize("path", ["single", "split", "prefill_nvidia", "prefill_amd"])
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("name,qsl,seq_lens,table,num_tokens", BAD_METADATA, ids=[c[0] for c in BAD_METADATA])
def test_attention_stays_inside_its_tensors(name, qsl, seq_lens, table, num_tokens, order, path, monkeypatch):
    split = path == "split"
    if path.startswith("prefill"):
        # every step planned as prefill, with the tiles of that target family
        from kvmulti.backends.triton import launch
        monkeypatch.setattr(launch, "PREFILL_MIN_QUERY_LEN", 1)
        monkeypatch.setattr(launch, "device_family", lambda device: path.split("_")[1])
    backend = TritonBackend(partition_size=16 if split else 0)
    dtype = torch.float16
    layout, cache, cache_buf = make_cache(order, dtype)
    cache_before = cache_buf.clone()
    rows = 6
    query, query_buf = guarded((rows, HKV * G, HS), None, dtype, torch.randn(rows, HKV * G, HS).to(dtype))
    out, out_buf = guarded((rows, HKV * G, HS), None, dtype, None)
    md = metadata(qsl, seq_lens, table, num_tokens)
    step = backend.build_metadata(md, layout, HKV * G, None)     # the unvalidated per-step hook
    assert step.plan.prefill or not path.startswith("prefill")
    backend.paged_attention(query, cache, step, HS ** -0.5, None, out)
    assert margins_untouched(out_buf), "write outside the output"
    assert torch.equal(cache_buf.nan_to_num(7.0), cache_before.nan_to_num(7.0)), "attention changed the cache"
    assert margins_untouched(query_buf)
    if not split:   # the split path's unwritten workspace rows may reduce to anything: wrong numbers allowed
        assert torch.isfinite(out.float()).all(), "a NaN margin (outside query/cache) was read"


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_write_kv_skips_slots_outside_the_cache(order):
    dtype = torch.bfloat16
    layout, cache, cache_buf = make_cache(order, dtype)
    before = cache.clone()
    num_slots = NUM_BLOCKS * BLOCK_SIZE
    # token 1 -> slot 3 and token 4 -> the last slot are valid; token 7 is past key/value's 6 rows.
    slots = [-1, 3, num_slots, -5, num_slots - 1, 2 ** 40, num_slots + 17, 9]
    tokens = 6
    key, key_buf = guarded((tokens, HKV, HS), None, dtype, torch.randn(tokens, HKV, HS).to(dtype))
    value, value_buf = guarded((tokens, HKV, HS), None, dtype, torch.randn(tokens, HKV, HS).to(dtype))
    get_backend("TRITON").write_kv(key, value, cache, layout, torch.tensor(slots, dtype=torch.int64))
    assert margins_untouched(cache_buf), "write outside the cache"
    assert margins_untouched(key_buf) and margins_untouched(value_buf)
    changed = (cache != before).any(dim=-1).any(dim=-1).nonzero().tolist()
    assert changed == [[0, 3], [5, BLOCK_SIZE - 1]], changed
    for (blk, off), tok in (((0, 3), 1), ((5, BLOCK_SIZE - 1), 4)):
        assert torch.equal(layout.keys(cache)[blk, off], key[tok])
        assert torch.equal(layout.values(cache)[blk, off], value[tok])
