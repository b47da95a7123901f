"""Property-based fuzzing of the metadata every kernel reads.

* valid metadata built directly as ``CommonAttentionMetadata(...)`` (as an engine does) equals the
  oracle on every backend that runs here;
* corrupted metadata through the public ops is a TypeError/ValueError naming a field, and the
  cache is unchanged;
* corrupted metadata handed to a backend object directly (the unvalidated path an accelerator takes
  without ``KVMULTI_VALIDATE=1``; named corruptions and arbitrary int32 values in any index field)
  never crashes and never writes outside ``out``: the tensors sit inside guard buffers whose
  margins are checked, and the cache is not written by attention.

Seeds that found bugs stay below as ``@example`` s.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

import kvmulti
from kvmulti import reference
from kvmulti.backends.registry import available_backends, get_backend

from batches import assert_close_to_reference

SENTINEL = 1234.5
BACKENDS = [name for name, reasons in available_backends("cpu").items() if not reasons]
warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)


def guarded(shape: tuple[int, ...], dtype: torch.dtype, fill: torch.Tensor | None = None,
            margin: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): a contiguous view of ``shape`` in the middle of a sentinel-filled buffer."""
    numel = 1
    for n in shape:
        numel *= n
    buffer = torch.full((numel + 2 * margin,), SENTINEL, dtype=dtype)
    view = buffer[margin:margin + numel].view(shape)
    if fill is not None:
        view.copy_(fill)
    return buffer, view


def margins_intact(buffer: torch.Tensor, view: torch.Tensor, margin: int = 64) -> bool:
    return bool((buffer[:margin] == SENTINEL).all() and (buffer[margin + view.numel():] == SENTINEL).all())


@st.composite
def batches(draw):
    """A small valid batch: layout, cache contents, query, and per-request lengths / table."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    head_size = 64
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    order = draw(st.sampled_from(["NHD", "HND"]))
    num_reqs = draw(st.integers(1, 4))
    query_lens = draw(st.lists(st.integers(0, 6), min_size=num_reqs, max_size=num_reqs))
    contexts = draw(st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs))
    seq_lens = [q + c if q + c > 0 else 1 for q, c in zip(query_lens, contexts)]
    width = max(-(-s // block_size) for s in seq_lens)
    num_blocks = num_reqs * width + 2
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    table = perm[: num_reqs * width].view(num_reqs, width).to(torch.int32)
    window = draw(st.sampled_from([None, 3, 17]))
    layout = kvmulti.KVCacheLayout(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, order=order)
    md = kvmulti.CommonAttentionMetadata.from_lens(query_lens, seq_lens, table, block_size)
    gen = torch.Generator().manual_seed(7)
    cache = layout.allocate(huge_pages=False)
    cache.copy_(torch.randn(layout.shape, generator=gen).to(dtype))
    query = torch.randn(md.num_actual_tokens, num_kv_heads * group, head_size, generator=gen).to(dtype)
    return layout, cache, query, md, window


def rebuilt(md: kvmulti.CommonAttentionMetadata, **fields) -> kvmulti.CommonAttentionMetadata:
    """``md`` with fields replaced, host copies re-derived unless given (as an engine builds it)."""
    fields.setdefault("query_start_loc_cpu", None if "query_start_loc" in fields else md.query_start_loc_cpu)
    fields.setdefault("seq_lens_cpu", None if "seq_lens" in fields else md.seq_lens_cpu)
    return dataclasses.replace(md, **fields)


CORRUPTIONS = {
    "query_start_loc past the query": lambda md: rebuilt(
        md, query_start_loc=md.query_start_loc + torch.arange(md.num_reqs + 1, dtype=torch.int32) * 50),
    "query_start_loc decreasing": lambda md: rebuilt(
        md, query_start_loc=torch.cat([md.query_start_loc[:1], md.query_start_loc[1:] * 0 - 1])),
    "block table missing rows": lambda md: rebuilt(md, block_table=md.block_table[:0].contiguous()),
    "block ids out of range": lambda md: rebuilt(md, block_table=md.block_table + 10_000),
    "negative block ids": lambda md: rebuilt(md, block_table=md.block_table - 10_000),
    "max_seq_len too small": lambda md: rebuilt(md, max_seq_len=0),
    "seq_lens too long for the table": lambda md: rebuilt(md, seq_lens=md.seq_lens + 1000, max_seq_len=md.max_seq_len + 1000),
    "seq_lens shorter than num_reqs": lambda md: rebuilt(md, seq_lens=md.seq_lens[:-1].contiguous()),
    "num_actual_tokens disagrees": lambda md: rebuilt(md, num_actual_tokens=md.num_actual_tokens + 3),
    "negative seq_lens": lambda md: rebuilt(md, seq_lens=-md.seq_lens - 5),
    "huge seq_lens": lambda md: rebuilt(md, seq_lens=md.seq_lens * 0 + 2**31 - 1, max_seq_len=2**31 - 1),
}


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(12))
@given(case=batches())
def test_directly_built_valid_metadata_matches_oracle(backend, case):
    layout, cache, query, md, window = case
    direct = kvmulti.CommonAttentionMetadata(
        query_start_loc=md.query_start_loc.clone(), seq_lens=md.seq_lens.clone(), block_table=md.block_table.clone(),
        slot_mapping=md.slot_mapping.clone(), num_reqs=md.num_reqs, num_actual_tokens=md.num_actual_tokens,
        max_query_len=md.max_query_len, max_seq_len=md.max_seq_len)
    out = kvmulti.paged_attention(query, cache, layout, direct, sliding_window=window, backend=backend)
    expected = reference.paged_attention(query, cache, layout, md, sliding_window=window)
    assert_close_to_reference(out, expected, layout.dtype, f"{backend} directly built metadata")


@pytest.mark.parametrize("corruption", CORRUPTIONS)
@settings(max_examples=examples(6))
@given(case=batches())
def test_corrupted_metadata_is_a_clear_error(corruption, case):
    layout, cache, query, md, window = case
    bad = CORRUPTIONS[corruption](md)
    before = cache.clone()
    with pytest.raises((ValueError, TypeError), match="metadata|block_table|query|seq_len"):
        kvmulti.paged_attention(query, cache, layout, bad, sliding_window=window, backend="CPU")
    assert torch.equal(cache, before)


def _guarded_cache(layout: kvmulti.KVCacheLayout, backend, fill: torch.Tensor, margin: int = 64):
    """(buffer, cache view): a cache of ``layout``'s strides in the middle of a sentinel-filled
    buffer allocated the way ``backend`` wants its caches (SYCL: USM)."""
    numel = layout.num_blocks * layout.block_size * layout.num_kv_heads * layout.entry_size
    allocator = backend.cache_allocator("cpu")
    total = numel + 2 * margin
    buffer = allocator(total, layout.dtype, torch.device("cpu")) if allocator else torch.empty(total, dtype=layout.dtype)
    buffer.fill_(SENTINEL)
    flat = buffer[margin:margin + numel]
    b, n, h, e = layout.shape
    view = flat.view(b, n, h, e) if layout.order == "NHD" else flat.view(b, h, n, e).permute(0, 2, 1, 3)
    view.copy_(fill)
    return buffer, view


@st.composite
def corruptions(draw, md: kvmulti.CommonAttentionMetadata):
    """One named corruption, or arbitrary int32 values written into one metadata field."""
    if draw(st.booleans()):
        return CORRUPTIONS[draw(st.sampled_from(sorted(CORRUPTIONS)))](md)
    field = draw(st.sampled_from(["query_start_loc", "seq_lens", "block_table"]))
    tensor = getattr(md, field).clone()
    if tensor.numel() == 0:
        return md
    values = st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-3, 70))
    flat = tensor.view(-1)
    for index in draw(st.lists(st.integers(0, flat.numel() - 1), min_size=1, max_size=4)):
        flat[index] = draw(values)
    return rebuilt(md, **{field: tensor})


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(10), deadline=None)
@given(case=batches(), data=st.data())
def test_unvalidated_path_stays_inside_its_tensors(backend, case, data):
    """The path an accelerator takes without KVMULTI_VALIDATE=1: corrupted metadata straight to the
    backend object. Wrong numbers are allowed; a crash or a write outside ``out`` is not."""
    layout, cache, query, md, window = case
    bad = data.draw(corruptions(md))
    impl = get_backend(backend)
    cache_buf, cache_view = _guarded_cache(layout, impl, cache)
    cache_before = cache_buf.clone()
    query_buf, query_view = guarded(tuple(query.shape), query.dtype, query)
    out_buf, out_view = guarded((query.shape[0], query.shape[1], layout.value_size), query.dtype)
    try:
        step = impl.build_metadata(bad, layout, query.shape[1], window)
        impl.paged_attention(query_view, cache_view, step, layout.head_size ** -0.5, None, out_view)
    except (ValueError, TypeError, RuntimeError, IndexError):
        pass                                  # refusing is fine; the checks below still hold
    assert margins_intact(out_buf, out_view), f"{backend}: write outside out"
    assert margins_intact(query_buf, query_view) and torch.equal(query_view, query), f"{backend}: query changed"
    assert torch.equal(cache_buf, cache_before), f"{backend}: attention changed the cache or its margins"
