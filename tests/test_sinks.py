"""Attention sinks (gpt-oss): one fp32 logit per query head that joins each row's softmax
denominator and contributes no value. The oracle against a direct formula, then every backend that
serves sinks against the oracle (decode, prefill, chunked prefill, sliding window, GQA, softcap,
split-KV on and off, fp8 caches), the prepared-step path, and the backends that do not serve them
refusing by name."""

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
from availability import unavailable

MIXED = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=torch.float32,
                 query_lens=(9, 1, 5, 1), context_lens=(0, 70, 30, 200), sinks=True, seed=3)


def require(backend: str) -> None:
    reasons = get_backend(backend).unavailable_reasons()
    if reasons:
        unavailable(f"{backend}: {reasons}")


def test_oracle_sinks_are_an_extra_logit_without_value():
    case = build_case(dataclasses.replace(MIXED, query_lens=(1,), context_lens=(12,), num_kv_heads=1, group=2))
    reference.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping)
    sinks = torch.tensor([0.5, 3.0])
    out = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sinks=sinks)
    keys = torch.stack([case.layout.keys(case.cache)[case.metadata.block_table[0, p // 16], p % 16, 0]
                        for p in range(13)])
    values = torch.stack([case.layout.values(case.cache)[case.metadata.block_table[0, p // 16], p % 16, 0]
                          for p in range(13)])
    for h in range(2):
        scores = keys @ case.query[0, h] * 64 ** -0.5
        weights = scores.exp() / (scores.exp().sum() + sinks[h].exp())
        torch.testing.assert_close(out[0, h], weights @ values, atol=1e-5, rtol=1e-5)
    plain = reference.paged_attention(case.query, case.cache, case.layout, case.metadata)
    none = reference.paged_attention(case.query, case.cache, case.layout, case.metadata,
                                     sinks=torch.full((2,), float("-inf")))
    torch.testing.assert_close(none, plain)
    assert out.norm() < plain.norm()          # the sink takes mass and gives no value


@settings(max_examples=examples(40), deadline=None)
@given(batch_cases(head_sizes=(16, 64, 80), sinks=True))
def test_cpu_native_matches_oracle(spec):
    check_against_reference(dataclasses.replace(spec, sinks=True), "CPU")


@pytest.mark.parametrize("partition", [0, 16, 64])
@pytest.mark.parametrize("window", [None, 24])
def test_cpu_split_kv_adds_the_sink_once(monkeypatch, partition, window):
    monkeypatch.setattr(get_backend("CPU"), "partition_size", partition)
    for dtype in (torch.float32, torch.bfloat16):
        check_against_reference(dataclasses.replace(MIXED, sliding_window=window, dtype=dtype, softcap=20.0), "CPU")


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_cpu_torch_path(monkeypatch, order):
    monkeypatch.setattr(get_backend("CPU"), "native_kernel", False)
    check_against_reference(dataclasses.replace(MIXED, order=order, sliding_window=40), "CPU")
    check_against_reference(dataclasses.replace(MIXED, order=order, dtype=torch.float16, group=1), "CPU")


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_fp8_cache(cache_dtype):
    check_fp8_against_reference(dataclasses.replace(MIXED, dtype=torch.bfloat16, sliding_window=50), "CPU",
                                cache_dtype)


def test_prepared_step_takes_sinks_per_layer():
    case = build_case(dataclasses.replace(MIXED, sliding_window=64))
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping)
    step = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], sliding_window=64, sinks=True)
    assert step.sinks and step.backend.supports_sinks
    for seed in range(2):                       # two layers: one step, each its own sinks
        sinks = torch.randn(case.query.shape[1], generator=torch.Generator().manual_seed(seed)) * 3
        out = torch.empty(case.query.shape[0], case.query.shape[1], 64)
        kvmulti.paged_attention(case.query, case.cache, case.layout, step, sliding_window=64, out=out, sinks=sinks)
        want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=64,
                                         sinks=sinks)
        torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4)
    plain = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], sliding_window=64)
    with pytest.raises(ValueError, match="prepared without them"):
        kvmulti.paged_attention(case.query, case.cache, case.layout, plain, sliding_window=64,
                                sinks=torch.zeros(case.query.shape[1]))


def test_nan_query_row_stays_nan_and_alone():
    case = build_case(MIXED)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping)
    case.query[3, 1] = float("nan")
    out = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, sinks=case.sinks)
    want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sinks=case.sinks)
    assert out[3, 1].isnan().all()
    torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4, equal_nan=True)


@pytest.mark.parametrize("backend", ["IPEX"])
def test_backends_without_sinks_refuse_by_name(backend):
    case = build_case(MIXED)
    config = kvmulti.AttentionConfig.from_layout(case.layout, "cpu", sinks=True)
    assert f"{backend} does not serve attention sinks" in get_backend(backend).not_supported_reasons(config)
    with pytest.raises(BackendSelectionError, match="does not serve attention sinks"):
        kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend=backend,
                                sinks=case.sinks)
    with pytest.raises(BackendSelectionError, match="does not serve attention sinks"):
        kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], backend=backend, sinks=True)
