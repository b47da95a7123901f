"""ALiBi (Bloom / MPT): per-query-head fp32 slopes; the score of the query at position q against
the key at position k gains slope[h] * (k - q) after scale and softcap. The oracle against a direct
formula, then the CPU backend against the oracle (decode, prefill, chunked prefill, GQA, sliding
window, softcap, split-KV on and off, fp8 caches, both orders, the torch path), the prepared-step
path, the input rules, and the backends that do not serve ALiBi refusing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from tiers import examples

import kvmulti
from kvmulti import reference
from kvmulti.backends.registry import BackendSelectionError, get_backend
from batches import CaseSpec, batch_cases, build_case, check_against_reference, check_fp8_against_reference

MIXED = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=torch.float32,
                 query_lens=(9, 1, 5, 1, 40), context_lens=(0, 70, 30, 200, 20), alibi=True, seed=3)


def test_oracle_adds_slope_times_distance():
    case = build_case(dataclasses.replace(MIXED, query_lens=(3,), context_lens=(10,), num_kv_heads=1, group=2))
    reference.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping)
    slopes = torch.tensor([0.5, 0.125])
    out = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, softcap=3.0,
                                    alibi_slopes=slopes)
    bt = case.metadata.block_table[0]
    keys = torch.stack([case.layout.keys(case.cache)[bt[p // 16], p % 16, 0] for p in range(13)])
    values = torch.stack([case.layout.values(case.cache)[bt[p // 16], p % 16, 0] for p in range(13)])
    for t in range(3):
        q_pos = 10 + t
        for h in range(2):
            raw = keys[: q_pos + 1] @ case.query[t, h] * 64 ** -0.5
            scores = 3.0 * torch.tanh(raw / 3.0) + slopes[h] * (torch.arange(q_pos + 1) - q_pos)
            torch.testing.assert_close(out[t, h], torch.softmax(scores, 0) @ values[: q_pos + 1],
                                       atol=1e-5, rtol=1e-5)
    zero = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, softcap=3.0,
                                     alibi_slopes=torch.zeros(2))
    torch.testing.assert_close(zero, reference.paged_attention(case.query, case.cache, case.layout,
                                                               case.metadata, softcap=3.0))


def test_alibi_changes_the_output():
    """The suites below would pass a kernel that ignored the slopes only if the slopes did nothing."""
    case = build_case(MIXED)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping)
    plain = reference.paged_attention(case.query, case.cache, case.layout, case.metadata)
    with_alibi = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend="CPU",
                                         alibi_slopes=case.alibi_slopes)
    assert (plain - with_alibi).abs().max() > 0.1


@settings(max_examples=examples(30), deadline=None)
@given(batch_cases(head_sizes=(16, 64, 80)))
def test_cpu_native_matches_oracle(spec):
    check_against_reference(dataclasses.replace(spec, alibi=True), "CPU")


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("partition", [0, 16, 64])
@pytest.mark.parametrize("window", [None, 24])
def test_cpu_split_kv_and_window(monkeypatch, order, partition, window):
    monkeypatch.setattr(get_backend("CPU"), "partition_size", partition)
    for dtype in (torch.float32, torch.bfloat16):
        check_against_reference(dataclasses.replace(MIXED, order=order, sliding_window=window, dtype=dtype,
                                                    softcap=20.0), "CPU")


@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_gqa_decode_and_long_prefill(group, dtype):
    """Decode rows (direct path), many-row prefill tiles (a 150-token prefill) and chunked prefill."""
    check_against_reference(dataclasses.replace(MIXED, group=group, dtype=dtype, query_lens=(1, 1, 150, 33),
                                                context_lens=(300, 9, 0, 100)), "CPU")


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "generic"])
def test_cpu_every_isa_variant(monkeypatch, isa):
    from kvmulti.backends.cpu import native
    module = native.load()
    if module is None or isa not in module.available_isas():
        pytest.skip(f"{isa}: not usable on this CPU / build")
    monkeypatch.setattr(get_backend("CPU"), "isa", isa)
    for dtype, group in ((torch.float32, 4), (torch.bfloat16, 8), (torch.float16, 1)):
        check_against_reference(dataclasses.replace(MIXED, dtype=dtype, group=group, softcap=12.0,
                                                    query_lens=(1, 1, 150, 7), context_lens=(300, 9, 0, 100)), "CPU")


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_cpu_torch_path(monkeypatch, order):
    monkeypatch.setattr(get_backend("CPU"), "native_kernel", False)
    check_against_reference(dataclasses.replace(MIXED, order=order, sliding_window=40, softcap=10.0), "CPU")
    check_against_reference(dataclasses.replace(MIXED, order=order, dtype=torch.float16, group=1, sinks=True), "CPU")


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_fp8_cache(cache_dtype):
    check_fp8_against_reference(dataclasses.replace(MIXED, dtype=torch.bfloat16, sliding_window=50), "CPU",
                                cache_dtype)


def test_with_sinks():
    check_against_reference(dataclasses.replace(MIXED, sinks=True, softcap=15.0), "CPU")


def test_prepared_step_takes_slopes_per_layer():
    case = build_case(dataclasses.replace(MIXED, sliding_window=64))
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping)
    hq = case.query.shape[1]
    step = kvmulti.prepare_step(case.metadata, case.layout, hq, sliding_window=64, alibi_slopes=True)
    assert step.alibi and step.backend.supports_alibi
    for seed in range(2):                       # two layers: one step, each its own slopes
        slopes = torch.rand(hq, generator=torch.Generator().manual_seed(seed))
        out = torch.empty(case.query.shape[0], hq, 64)
        kvmulti.paged_attention(case.query, case.cache, case.layout, step, sliding_window=64, out=out,
                                alibi_slopes=slopes)
        want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=64,
                                         alibi_slopes=slopes)
        torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)
    plain = kvmulti.prepare_step(case.metadata, case.layout, hq, sliding_window=64)
    with pytest.raises(ValueError, match="prepared without them"):
        kvmulti.paged_attention(case.query, case.cache, case.layout, plain, sliding_window=64,
                                alibi_slopes=torch.zeros(hq))


@pytest.mark.parametrize("bad, error, match", [
    (torch.ones(8, dtype=torch.float16), TypeError, "must be torch.float32"),
    (torch.ones(7), ValueError, r"expected \(8,\)"),
    (torch.tensor([float("inf")] + [0.5] * 7), ValueError, "finite"),
])
def test_input_rules(bad, error, match):
    case = build_case(MIXED)
    with pytest.raises(error, match=match):
        kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, alibi_slopes=bad)


def test_strided_slopes_are_taken():
    case = build_case(MIXED)
    wide = torch.rand(16, generator=torch.Generator().manual_seed(3))
    out = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, alibi_slopes=wide[::2])
    want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata,
                                     alibi_slopes=wide[::2].contiguous())
    torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("backend", ["IPEX"])
def test_backends_without_alibi_refuse(backend):
    case = build_case(MIXED)
    config = kvmulti.AttentionConfig.from_layout(case.layout, "cpu", alibi=True)
    assert "ALiBi not supported" in get_backend(backend).not_supported_reasons(config)
    with pytest.raises(BackendSelectionError, match="ALiBi not supported"):
        kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend=backend,
                                alibi_slopes=case.alibi_slopes)
    with pytest.raises(BackendSelectionError, match="ALiBi not supported"):
        kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], backend=backend, alibi_slopes=True)
