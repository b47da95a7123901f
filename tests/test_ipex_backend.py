"""The IPEX backend against the oracle, and IPEX 2.8's paged-kernel hazards as regression tests.

Tests marked ``ipex`` need Intel Extension for PyTorch: they run in ``.venv-ipex`` (torch 2.8 +
IPEX 2.8, made by ``scripts/setup.sh --test``) as ``pytest -m ipex tests/test_ipex_backend.py``.
Elsewhere they skip with the reason; under ``CI=true`` an unimportable IPEX fails them instead.
The unmarked tests (selection, refusals) run in every venv.

The ``*_hazard`` tests call IPEX directly and pin down what its kernels do wrong on kvmulti's views;
when one starts failing, IPEX changed, and the workaround in kvmulti/backends/ipex may be dropped.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import kvmulti
from kvmulti import reference
from kvmulti.backends import AttentionConfig, get_backend, select_backend
from kvmulti.backends.ipex import backend as ipex_backend
from kvmulti.backends.ipex.library import ipex_status, paged_attention_module
from kvmulti.backends.registry import BackendSelectionError, dispatch_order

from kvmulti.layout import CROSS_LAYER_ORDERS, token_order
from kvmulti.platform import platform_names

from batches import CaseSpec, assert_close_to_reference, build_case, check_against_reference, check_cross_layer


@pytest.fixture(scope="module")
def ipex():
    """IPEX's PagedAttention class; skip (fail under CI=true) with the reason where IPEX is unusable."""
    reason = ipex_status().reason
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs the IPEX tests in .venv-ipex and IPEX is unusable there: {reason}", pytrace=False)
        pytest.skip(reason)
    return paged_attention_module()


def spec(**kw) -> CaseSpec:
    base = dict(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=64, dtype=torch.float32,
                query_lens=(1, 1, 1), context_lens=(40, 7, 100), extra_blocks=2)
    base.update(kw)
    return CaseSpec(**base)


# -- selection and refusals (any venv) -------------------------------------------------------------
def test_ipex_is_never_chosen_without_being_named():
    assert all("IPEX" not in dispatch_order(platform) for platform in platform_names())


def test_ipex_refuses_what_it_cannot_serve_with_reasons():
    backend = get_backend("IPEX")
    base = dict(platform="cpu", dtype=torch.float16, head_size=64, head_size_v=64, num_kv_heads=2, block_size=16,
                order="HND")
    reasons = " ".join(backend.capability_reasons(AttentionConfig(**base, sliding_window=True, softcap=True)))
    assert "sliding window together with softcap" in reasons
    assert "IPEX reads V with K's strides" in " ".join(
        backend.capability_reasons(AttentionConfig(**{**base, "head_size_v": 32})))
    assert "latent" in " ".join(backend.capability_reasons(AttentionConfig(**{**base, "head_size_v": 0})))
    assert "not supported" in " ".join(
        backend.capability_reasons(AttentionConfig(**{**base, "dtype": torch.float8_e4m3fn})))
    assert "XPU paged kernels are not wired" in " ".join(backend.platform_reasons("xpu"))
    config = AttentionConfig(**base, sliding_window=True, softcap=True)
    with pytest.raises(BackendSelectionError, match="IPEX cannot serve"):
        select_backend(config, requested="IPEX")


def test_ipex_status_names_the_torch_it_needs():
    status = ipex_status()
    line = get_backend("IPEX").describe()
    assert "intel-extension-for-pytorch" in line
    if status.version is not None:
        assert f"needs torch {status.needs_torch}" in line and torch.__version__ in line


# -- against the oracle (.venv-ipex) ---------------------------------------------------------------
@pytest.mark.ipex
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size,head_size,group", [(16, 64, 1), (32, 128, 4), (64, 64, 2)])
def test_decode_matches_oracle(ipex, order, dtype, block_size, head_size, group):
    check_against_reference(spec(order=order, dtype=dtype, block_size=block_size, head_size=head_size,
                                 group=group), "IPEX")


@pytest.mark.ipex
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("window", [1, 2, 15, 16, 17, 40, 41, 100, 101, 500])
def test_window_matches_oracle_semantics(ipex, order, window):
    """kvmulti: key visible iff q_pos - k_pos < W, at every boundary (seq_lens 41, 8, 101)."""
    check_against_reference(spec(order=order, sliding_window=window), "IPEX")


@pytest.mark.ipex
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_softcap_matches_oracle(ipex, order):
    check_against_reference(spec(order=order, softcap=5.0, dtype=torch.bfloat16), "IPEX")


@pytest.mark.ipex
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("window", [None, 9])
def test_mixed_batch_serves_multi_query_rows_with_the_cpu_kernel(ipex, order, window):
    """Prefill, chunked prefill, verification and decode rows in one step: all equal the oracle;
    the multi-query requests run on kvmulti's native CPU kernel (built under this torch)."""
    s = spec(order=order, query_lens=(5, 1, 12, 1, 3), context_lens=(0, 30, 20, 3, 17), sliding_window=window)
    check_against_reference(s, "IPEX")
    case = build_case(s)
    step = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], sliding_window=window,
                                backend="IPEX")
    assert step.plan.decode.rows.tolist() == [5, 18]
    assert step.plan.prefill.step.backend.name == "CPU" and step.plan.prefill.step.plan.module is not None


@pytest.mark.ipex
@pytest.mark.parametrize("group", [1, 4])
def test_shared_first_block_without_window_works(ipex, group):
    """Prefix sharing: every request's first block is the same block (IPEX's -1 window raises there)."""
    case = build_case(spec(group=group, query_lens=(1,) * 6, context_lens=(20, 33, 17, 40, 18, 25)))
    case.metadata.block_table[:, 0] = case.metadata.block_table[0, 0]
    _check_case(case, softcap=None)


@pytest.mark.ipex
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("n", [4, 7])
def test_shared_first_block_with_softcap_works(ipex, group, n):
    case = build_case(spec(group=group, query_lens=(1,) * n, context_lens=(20, 33, 17, 40, 18, 25, 50)[:n]))
    case.metadata.block_table[:, 0] = case.metadata.block_table[0, 0]
    _check_case(case, softcap=3.0)


def _check_case(case, softcap: float | None, window: int | None = None) -> None:
    expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=window,
                                         softcap=softcap)
    actual = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=window,
                                     softcap=softcap, backend="IPEX")
    assert_close_to_reference(actual, expected, case.layout.dtype)


# -- writes: exact, zero copy, padding and bad slots never reach IPEX ---------------------------------
@pytest.mark.ipex
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_write_is_exact_and_in_place_with_padding_and_bad_slots(ipex, order):
    layout = kvmulti.KVCacheLayout(num_blocks=6, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                                   order=order)
    margin = 4096
    buffer = torch.full((layout.num_slots * 2 * 128 + 2 * margin,), 7.0, dtype=layout.dtype)
    flat = buffer[margin:margin + layout.num_slots * 2 * 128]
    cache = flat.view(layout.shape) if order == "NHD" else flat.view(6, 2, 16, 128).permute(0, 2, 1, 3)
    layout.validate(cache)
    slots = torch.tensor([-1, 5, layout.num_slots, 90, -1, 17, -7, layout.num_slots - 1, 10**9])
    key = torch.randn(len(slots), 2, 64).to(layout.dtype)
    value = torch.randn(len(slots), 2, 64).to(layout.dtype)
    expected = cache.clone()
    reference.write_kv(key, value, expected, layout, torch.where(slots < layout.num_slots, slots, -1))
    get_backend("IPEX").write_kv(key, value, cache, layout, slots)
    assert torch.equal(cache, expected)
    assert cache.data_ptr() == flat.data_ptr()
    assert bool((buffer[:margin] == 7.0).all() and (buffer[margin + flat.numel():] == 7.0).all())


@pytest.mark.ipex
def test_slot_minus_one_hazard(ipex):
    """IPEX 2.8 writes a token with slot -1 BEFORE the cache (hence the filter in write_kv)."""
    layout = kvmulti.KVCacheLayout(num_blocks=2, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    margin = 4096
    buffer = torch.zeros(layout.num_slots * 2 * 128 + 2 * margin)
    cache = buffer[margin:margin + layout.num_slots * 2 * 128].view(layout.shape)
    key_cache, value_cache = ipex_backend.ipex_views(cache, layout)
    ipex.reshape_and_cache(torch.ones(1, 2, 64), torch.ones(1, 2, 64), key_cache, value_cache,
                           torch.tensor([-1]))
    assert int((buffer[:margin] != 0).sum()) > 0, "IPEX now skips slot -1"


# -- the other hazards, pinned ----------------------------------------------------------------------
def _raw_decode(ipex, case, window: int, softcap: float = -1.0) -> torch.Tensor:
    layout, md = case.layout, case.metadata
    key_cache, value_cache = ipex_backend.ipex_views(case.cache, layout)
    hq = case.query.shape[1]
    out = torch.empty_like(case.query)
    mapping = torch.arange(layout.num_kv_heads, dtype=torch.int32).repeat_interleave(hq // layout.num_kv_heads)
    table = ipex_backend.safe_block_tables(md.block_table.long(), md.seq_lens.long(), layout, None).int()
    ipex.single_query_cached_kv_attention(out, case.query, key_cache, value_cache, mapping, layout.head_size ** -0.5,
                                          table, md.seq_lens, layout.block_size, md.max_seq_len, None,
                                          window_size=window, softcap=softcap)
    return out


@pytest.mark.ipex
def test_ipex_window_is_kvmulti_window_hazard(ipex):
    """IPEX's window_size=W shows exactly the keys with q_pos - k_pos < W (kvmulti's W, unchanged)."""
    case = build_case(spec(query_lens=(1, 1, 1, 1), context_lens=(40, 7, 100, 16)))
    for window in (1, 5, 16, 17):
        expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata,
                                             sliding_window=window)
        assert_close_to_reference(_raw_decode(ipex, case, window), expected, torch.float32, f"W={window}")


@pytest.mark.ipex
def test_no_window_with_shared_first_block_hazard(ipex):
    """window_size=-1 raises when a KV head has >= 3 query heads and the first four sequences share
    their first block; three sequences, or the sharing not among the first four, pass."""
    case = build_case(spec(group=4, query_lens=(1,) * 5, context_lens=(20, 33, 17, 40, 21)))
    case.metadata.block_table[1:, 0] = case.metadata.block_table[1, 0]
    _raw_decode(ipex, case, -1)
    case.metadata.block_table[0, 0] = case.metadata.block_table[1, 0]
    with pytest.raises(RuntimeError, match="Sliding window unsupported"):
        _raw_decode(ipex, case, -1)
    with pytest.raises(RuntimeError, match="Sliding window unsupported"):
        _raw_decode(ipex, case, -1, softcap=3.0)


@pytest.mark.ipex
def test_window_with_softcap_hazard(ipex):
    case = build_case(spec())
    with pytest.raises(RuntimeError, match="use_softcap"):
        _raw_decode(ipex, case, 8, softcap=5.0)


@pytest.mark.ipex
def test_guarded_decode_never_reads_stale_or_bad_block_ids(ipex):
    """Entries before the window point outside the cache (batches.build_case): replaced, not read;
    a needed id outside the cache is a ValueError before IPEX runs."""
    case = build_case(spec(sliding_window=9))
    backend = get_backend("IPEX")
    step = backend.build_metadata(case.metadata, case.layout, case.query.shape[1], 9)
    assert int(step.plan.decode.block_tables.max()) < case.layout.num_blocks
    bad = case.metadata.block_table.clone()
    bad[2, 100 // 16] = case.layout.num_blocks
    md = kvmulti.CommonAttentionMetadata.from_lens([1, 1, 1], list(case.spec.seq_lens), bad, 16)
    with pytest.raises(ValueError, match=r"block_table\[2, 6\]"):
        backend.build_metadata(md, case.layout, case.query.shape[1], 9)


def test_kvmulti_info_has_an_ipex_line():
    from kvmulti.cli import collect_info
    entry = collect_info()["backends"]["IPEX"]
    assert "intel-extension-for-pytorch" in entry["runs_on"]
    json.dumps(entry)


@pytest.mark.ipex
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_varlen_prefill_ignores_the_token_stride_hazard(ipex, order):
    """``flash_attn_varlen_func`` on kvmulti's views is wrong (why multi-query rows never go to IPEX)."""
    case = build_case(spec(order=order, query_lens=(6, 9), context_lens=(10, 20)))
    layout, md = case.layout, case.metadata
    key_cache, value_cache = ipex_backend.ipex_views(case.cache, layout)
    hq = case.query.shape[1]
    out = torch.zeros_like(case.query)
    cu_kv = torch.zeros(md.num_reqs + 1, dtype=torch.int32)
    cu_kv[1:] = torch.cumsum(md.seq_lens, 0)
    table = ipex_backend.safe_block_tables(md.block_table.long(), md.seq_lens.long(), layout, None).int()
    ipex.flash_attn_varlen_func(out, case.query, key_cache, value_cache, md.query_start_loc, cu_kv,
                                md.max_query_len, md.max_seq_len, layout.head_size ** -0.5, True, table, None)
    expected = reference.paged_attention(case.query, case.cache, case.layout, md)
    assert hq and float((out - expected).abs().max()) > 0.5, "IPEX's varlen prefill now reads kvmulti's views right"


@pytest.mark.ipex
def test_direct_calls_stay_inside_out_whatever_the_metadata(ipex):
    """The unvalidated path (a backend object called directly): ``out`` sits in a guard buffer; valid
    metadata gives the oracle's rows, corrupted metadata is an error before any write past ``out``."""
    case = build_case(spec(query_lens=(1, 4, 1), context_lens=(40, 7, 100)))
    backend, layout, hq = get_backend("IPEX"), case.layout, case.query.shape[1]
    margin, sentinel = 256, 1234.5
    rows = case.query.shape[0]
    buffer = torch.full((rows * hq * 64 + 2 * margin,), sentinel)
    out = buffer[margin:margin + rows * hq * 64].view(rows, hq, 64)

    def intact() -> bool:
        return bool((buffer[:margin] == sentinel).all() and (buffer[margin + out.numel():] == sentinel).all())

    backend.paged_attention(case.query, case.cache, backend.build_metadata(case.metadata, layout, hq, None), 0.125,
                            None, out)
    assert intact()
    assert_close_to_reference(out, reference.paged_attention(case.query, case.cache, layout, case.metadata,
                                                             scale=0.125), torch.float32)
    md = case.metadata
    corruptions = {
        "seq_len 0": dict(seq_lens=torch.tensor([0, 11, 101], dtype=torch.int32)),
        "seq_len past the table": dict(seq_lens=torch.tensor([40, 11, 10**6], dtype=torch.int32)),
        "rows past the query": dict(query_start_loc=torch.tensor([0, 1, 5, 60], dtype=torch.int32)),
    }
    for what, change in corruptions.items():
        bad = kvmulti.CommonAttentionMetadata(**{**dict(query_start_loc=md.query_start_loc, seq_lens=md.seq_lens,
                                                        block_table=md.block_table, slot_mapping=md.slot_mapping,
                                                        num_reqs=md.num_reqs, num_actual_tokens=md.num_actual_tokens,
                                                        max_query_len=md.max_query_len, max_seq_len=md.max_seq_len),
                                                     **change})
        with pytest.raises((ValueError, IndexError, RuntimeError)):
            backend.paged_attention(case.query, case.cache, backend.build_metadata(bad, layout, hq, None), 0.125,
                                    None, out)
        assert intact(), what


@pytest.mark.ipex
@pytest.mark.parametrize("physical", CROSS_LAYER_ORDERS)
def test_one_layer_of_a_cross_layer_allocation_matches_the_oracle(ipex, physical):
    for n, (window, softcap) in enumerate([(None, None), (12, None), (None, 20.0)]):
        check_cross_layer(spec(order=token_order(physical), sliding_window=window, softcap=softcap, seed=n,
                               query_lens=(1, 3, 1), dtype=torch.bfloat16), physical, "IPEX")
