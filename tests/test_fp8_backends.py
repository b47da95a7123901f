"""fp8 KV caches on every backend, against the oracle (kvmulti/reference.py, kvmulti/fp8.py).

Every backend must serve both fp8 formats: writes byte-identical to the oracle's (saturation, NaN,
slot -1 included), attention within the query dtype's tolerance of the oracle reading the same
bytes (both orders, GQA, windows, softcap, per-tensor and per-head scales, mixed batches), a cache
written by one backend read by every other, and no access outside the tensors whatever the
metadata. Shapes are small: Triton runs interpreted here, HIP on the fiber harness, SYCL on the
OpenCL CPU device.
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
from kvmulti import fp8, reference
from kvmulti.backends.registry import get_backend

from batches import Case, CaseSpec, assert_close_to_reference, batch_cases, build_case, registered_backends

BACKENDS = registered_backends()
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)


@dataclasses.dataclass
class Fp8Case(Case):
    """A batch over an fp8 cache, with the scales to write and read it."""

    k_scale: float | torch.Tensor = 1.0
    v_scale: float | torch.Tensor = 1.0


def fp8_case(spec: CaseSpec, cache_dtype: torch.dtype, per_head: bool) -> Fp8Case:
    """build_case's batch (query / key / value of spec.dtype) over an fp8 cache of random codes."""
    base = build_case(spec)
    layout = dataclasses.replace(base.layout, dtype=cache_dtype)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    cache = layout.allocate("cpu")
    cache.copy_(torch.randn(layout.shape, generator=gen).to(cache_dtype))   # no NaN codes
    heads = spec.num_kv_heads
    if per_head:
        k_scale = torch.rand(heads, generator=gen) * 1.5 + 0.25
        v_scale = torch.rand(heads, generator=gen) * 1.5 + 0.25
    else:
        k_scale, v_scale = 0.75, 1.25
    return Fp8Case(spec, layout, cache, base.metadata, base.query, base.key, base.value, k_scale, v_scale)


def oracle(case: Fp8Case, spec: CaseSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache after the oracle's write, the oracle's attention over it)."""
    cache = case.cache.clone()
    reference.write_kv(case.key, case.value, cache, case.layout, case.metadata.slot_mapping, case.k_scale, case.v_scale)
    out = reference.paged_attention(case.query, cache, case.layout, case.metadata, sliding_window=spec.sliding_window,
                                    softcap=spec.softcap, k_scale=case.k_scale, v_scale=case.v_scale)
    return cache, out


def check_fp8(spec: CaseSpec, cache_dtype: torch.dtype, per_head: bool, backend: str) -> None:
    case = fp8_case(spec, cache_dtype, per_head)
    want_cache, want = oracle(case, spec)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend=backend,
                     k_scale=case.k_scale, v_scale=case.v_scale)
    assert torch.equal(case.cache.view(torch.uint8), want_cache.view(torch.uint8)), f"{backend} fp8 write for {spec}"
    out = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=spec.sliding_window,
                                  softcap=spec.softcap, backend=backend, k_scale=case.k_scale, v_scale=case.v_scale)
    assert out.dtype == spec.dtype and out.shape == want.shape
    assert_close_to_reference(out, want, spec.dtype, f"{backend} fp8 attention for {spec}")


def small(backend: str) -> dict:
    """batch_cases arguments: the interpreted / emulated backends get small batches."""
    if backend == "CPU":
        return dict(max_reqs=4, max_context=80, max_query=12)
    return dict(max_reqs=2, max_context=40, max_query=6, groups=(1, 4), block_sizes=(16,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_fixed_batches_match_the_oracle(backend, fmt):
    # decode, verification and prefill together; GQA 4; both orders; window + softcap; each query dtype
    cases = [
        (torch.bfloat16, "NHD", 4, (1, 4, 7), (70, 20, 0), None, None, False),
        (torch.float16, "HND", 2, (1, 1), (45, 9), 16, 20.0, True),
        (torch.float32, "NHD", 1, (3, 1), (10, 33), 5, None, True),
        (torch.bfloat16, "HND", 4, (1, 2), (130, 17), None, 8.0, True),
    ]
    for dtype, order, group, qlens, ctx, window, softcap, per_head in cases:
        spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=group, head_size=64, dtype=dtype,
                        query_lens=qlens, context_lens=ctx, sliding_window=window, softcap=softcap, seed=len(qlens))
        check_fp8(spec, FORMATS[fmt], per_head, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(10), deadline=None)
@given(data=st.data())
def test_mixed_batches_match_the_oracle(backend, data):
    spec = data.draw(batch_cases(head_sizes=(64, 128), **small(backend)))
    cache_dtype = data.draw(st.sampled_from(list(FORMATS.values())))
    per_head = data.draw(st.booleans())
    check_fp8(spec, cache_dtype, per_head, backend)


def extreme_rows(tokens: int, heads: int, size: int, top: float) -> torch.Tensor:
    """Rows full of what the quantiser must get right: saturation, ±inf, NaN, ties, subnormals, zeros."""
    specials = torch.tensor([top * 3, -top * 3, float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 17.0, 19.0,
                             2.0 ** -8, 2.0 ** -9 * 1.5, 2.0 ** -17, 2.0 ** -17 * 1.5, top, -top, 1e-30])
    rows = torch.randn(tokens, heads, size, generator=torch.Generator().manual_seed(3)) * 30
    flat = rows.view(-1)
    flat[: specials.numel()] = specials
    flat[-specials.numel():] = specials.flip(0)
    return rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_is_byte_identical_saturates_keeps_nan_and_skips_minus_one(backend, fmt, dtype):
    cache_dtype = FORMATS[fmt]
    layout = kvmulti.KVCacheLayout(3, 8, 2, 64, dtype=cache_dtype, order="HND")
    top = fp8.max_finite(cache_dtype)
    key = extreme_rows(6, 2, 64, top).to(dtype)
    value = extreme_rows(6, 2, 64, top).flip(2).to(dtype).contiguous()
    slots = torch.tensor([0, -1, 9, 23, -1, 5])
    for k_scale, v_scale in [(1.0, 1.0), (torch.tensor([0.5, 3.0]), torch.tensor(0.125))]:
        cache = layout.allocate("cpu")
        cache.view(torch.uint8).fill_(0x11)
        want = cache.clone()
        reference.write_kv(key, value, want, layout, slots, k_scale, v_scale)
        kvmulti.write_kv(key, value, cache, layout, slots, backend=backend, k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8)), f"{backend} {fmt} {dtype} {k_scale}"
    assert fp8.dequantize(want, None).isnan().any() and (want.view(torch.uint8) == 0x11).any()


PAIRS = [f"{w}-{r}" for w in BACKENDS for r in BACKENDS]


@pytest.mark.parametrize("pair", PAIRS)
def test_a_cache_written_by_one_backend_reads_the_same_in_another(pair):
    writer, reader = pair.split("-")
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=64, dtype=torch.bfloat16,
                    query_lens=(1, 3), context_lens=(30, 12), sliding_window=None, softcap=None, seed=11)
    for cache_dtype in FORMATS.values():
        case = fp8_case(spec, cache_dtype, per_head=True)
        want_cache, want = oracle(case, spec)
        kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend=writer,
                         k_scale=case.k_scale, v_scale=case.v_scale)
        assert torch.equal(case.cache.view(torch.uint8), want_cache.view(torch.uint8))
        out = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend=reader,
                                      k_scale=case.k_scale, v_scale=case.v_scale)
        assert_close_to_reference(out, want, spec.dtype, f"written by {writer}, read by {reader}")


# ---- memory safety: backend objects called directly, tensors inside guard buffers ------------------
MARGIN = 4096
GUARD_BYTE = 0xA5


class GuardedBytes:
    """A ``dtype`` tensor of ``shape`` / ``strides`` in the middle of a byte buffer filled with GUARD_BYTE."""

    def __init__(self, shape, strides, dtype, fill=None):
        size = torch.empty((), dtype=dtype).element_size()
        self.span = (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * size
        self.buf = torch.full((self.span + 2 * MARGIN,), GUARD_BYTE, dtype=torch.uint8)
        self.view = self.buf[MARGIN:MARGIN + self.span].view(dtype).as_strided(shape, strides)
        if fill is not None:
            self.view.copy_(fill)

    def margins_intact(self) -> bool:
        return bool((self.buf[:MARGIN] == GUARD_BYTE).all() and (self.buf[MARGIN + self.span:] == GUARD_BYTE).all())


def contiguous(shape, dtype, fill=None) -> GuardedBytes:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return GuardedBytes(shape, tuple(reversed(strides)), dtype, fill)


BAD_METADATA = {   # (query_start_loc, seq_lens, block_table), each breaking the contract in one way
    "query_start_loc beyond the query rows": ([0, 1, 40], [20, 30], [[0, 1], [2, 3]]),
    "query_start_loc not monotonic": ([0, 3, 1, 3], [10, 5, 9], [[0], [1], [2]]),
    "seq_lens huge": ([0, 1, 2], [2**31 - 1, 2**30], [[0, 1], [2, 3]]),
    "seq_lens negative": ([0, 2, 3], [-7, -1], [[0], [1]]),
    "block table narrower than the context": ([0, 1, 2], [500, 70], [[0], [1]]),
    "block ids out of range": ([0, 1, 3], [40, 33], [[-1, 6, 2**30], [-(2**31), 5, 7]]),
}


def bad_metadata(qsl, seq_lens, table) -> kvmulti.CommonAttentionMetadata:
    qsl_t, seq = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    rows = max(1, int(qsl_t.max()))
    return kvmulti.CommonAttentionMetadata(
        query_start_loc=qsl_t, seq_lens=seq, block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int64), num_reqs=len(seq_lens), num_actual_tokens=rows,
        max_query_len=rows, max_seq_len=max(1, max(seq_lens)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_fp8_kernels_stay_inside_their_tensors(backend, order):
    impl = get_backend(backend)
    hkv, group, head = 2, 2, 64
    for cache_dtype in FORMATS.values():
        layout = kvmulti.KVCacheLayout(6, 16, hkv, head, dtype=cache_dtype, order=order)
        s = layout.expected_strides()
        codes = torch.randn(layout.shape, generator=torch.Generator().manual_seed(5)).to(cache_dtype)
        cache = GuardedBytes(layout.shape, (s.block, s.token, s.head, 1), cache_dtype, codes)
        scales = torch.tensor([0.5, 2.0])
        for name, (qsl, seq_lens, table) in BAD_METADATA.items():
            before = cache.buf.clone()
            query = contiguous((3, hkv * group, head), torch.bfloat16, torch.randn(3, hkv * group, head))
            out = contiguous((3, hkv * group, head), torch.bfloat16, torch.zeros(3, hkv * group, head))
            md = bad_metadata(qsl, seq_lens, table)
            for window in (None, 7):
                step = impl.build_metadata(md, layout, hkv * group, window)
                impl.paged_attention(query.view, cache.view, step, head ** -0.5, None, out.view,
                                     k_scale=scales, v_scale=scales)
            assert out.margins_intact() and query.margins_intact(), f"{backend} {name}: write outside out / query"
            assert torch.equal(cache.buf, before), f"{backend} {name}: attention changed the cache or its margins"
        # slots outside the cache are skipped; 8 slots for 6 key rows (the last 2 are not read)
        key = contiguous((6, hkv, head), torch.float32, torch.randn(6, hkv, head))
        value = contiguous((6, hkv, head), torch.float32, torch.randn(6, hkv, head))
        num_slots = 6 * 16
        slots = torch.tensor([5, num_slots, -1, -(2**40), 2**40, num_slots - 1, 7, 9], dtype=torch.int64)
        want = cache.view.clone()
        reference.write_kv(key.view[[0, 5]], value.view[[0, 5]], want, layout, slots[[0, 5]], scales, scales)
        impl.write_kv(key.view, value.view, cache.view, layout, slots, k_scale=scales, v_scale=scales)
        assert cache.margins_intact(), f"{backend}: write_kv outside the cache"
        assert torch.equal(cache.view.view(torch.uint8), want.view(torch.uint8))
