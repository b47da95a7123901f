"""Attention sinks, ALiBi and non-causal attention on the HIP kernels (the CPU harness), against the oracle:
the decode kernel (FMA engine on wave32, MFMA engine on wave64 for 16-bit queries) and the prefill kernel
(MFMA, and its FMA tile engine with MFMA disabled; WMMA on wave32, and the FMA tile engine without WMMA), GQA,
split-KV on and off (sinks: joined once, after the merge), sliding window and softcap, fp8 caches; features
combined."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import pytest
import torch

import kvmulti
from kvmulti import reference
from batches import CaseSpec, assert_close_to_reference, build_case, check_fp8_against_reference
from test_hip_harness import (FP8_FORMATS, _emulated_wmma, _fma_tile_library, _mfma_library, _run_case,  # noqa: F401
                              hip_backend)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# decode + chunked prefill + prefill in one batch, GQA 4, contexts over several 32-key tiles
DECODE = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=F32,
                  query_lens=(9, 1, 5, 1), context_lens=(0, 70, 30, 200), seed=3)
# the prefill kernel's shapes (head 128): several token tiles and key tiles, GQA 4
PREFILL = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=128, dtype=BF16,
                   query_lens=(40, 1, 9, 23), context_lens=(0, 30, 50, 70), seed=5)
# where the engines run: (wave, prefill_min_query); 0 = decode kernel only, 1 = prefill kernel for every step
# (wave32: its WMMA engine, in the harness's default gfx11 layout, for 16-bit queries)
ENGINES = {"decode-w32": (32, 0), "decode-w64": (64, 0), "prefill-w64": (64, 1), "prefill-w32": (32, 1)}


@pytest.mark.parametrize("feature, window, softcap", [("sinks", 24, 20.0), ("alibi", 33, 8.0)], ids=["sinks", "alibi"])
@pytest.mark.parametrize("partition", [0, 16])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_feature_matches_the_oracle(hip_backend, engine, dtype, partition, feature, window, softcap):
    """Sinks or ALiBi alone, then with a window and softcap."""
    wave, pmq = ENGINES[engine]
    base = PREFILL if engine.startswith("prefill") else DECODE
    for extra in ({}, dict(sliding_window=window, softcap=softcap)):
        _run_case(hip_backend, dataclasses.replace(base, dtype=dtype, **{feature: True}, **extra), wave=wave,
                  partition_size=partition, prefill_min_query=pmq)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_prefill_kernel_takes_the_features_on_mfma_and_fma(hip_backend, dtype):
    """The prefill kernel (MFMA counted) and, with MFMA disabled, its FMA tile engine (tiles counted): sinks +
    ALiBi + window + softcap at once, split and not."""
    spec = dataclasses.replace(PREFILL, dtype=dtype, sinks=True, alibi=True, sliding_window=50, softcap=10.0)
    lib = _mfma_library()
    lib.kvcpu_reset_mfma_count()
    _run_case(hip_backend, spec, wave=64, partition_size=0, prefill_min_query=1)
    assert lib.kvcpu_mfma_count() > 0
    lib.kvcpu_set_mfma_enabled(0)
    tiles = _fma_tile_library()
    try:
        lib.kvcpu_reset_mfma_count()
        tiles.kvcpu_reset_fma_tile_count()
        for partition in (0, 32):
            _run_case(hip_backend, spec, wave=64, partition_size=partition, prefill_min_query=1)
        assert lib.kvcpu_mfma_count() == 0 and tiles.kvcpu_fma_tile_count() > 0
    finally:
        lib.kvcpu_set_mfma_enabled(1)


@pytest.mark.parametrize("family", [11, 12])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_prefill_kernel_takes_the_features_on_wmma(hip_backend, dtype, family):
    """wave32: the prefill kernel's WMMA engine (WMMA counted) in the gfx11 and gfx12 layouts with sinks + ALiBi
    + window + softcap at once, split and not (an fp8 cache: the attention kernel, see prefill_served); without
    WMMA the FMA tile engine serves the same steps (tiles counted)."""
    spec = dataclasses.replace(PREFILL, dtype=dtype, sinks=True, alibi=True, sliding_window=50, softcap=10.0)
    fmt = list(FP8_FORMATS)[family % 2]
    with _emulated_wmma(family) as lib:
        lib.kvcpu_reset_wmma_count()
        for partition in (0, 32):
            _run_case(hip_backend, spec, wave=32, partition_size=partition, prefill_min_query=1)
        assert lib.kvcpu_wmma_count() > 0
        lib.kvcpu_reset_wmma_count()
        with _knobs(hip_backend, 32, 16, 1):
            check_fp8_against_reference(spec, "HIP", FP8_FORMATS[fmt])
        assert lib.kvcpu_wmma_count() == 0
    tiles = _fma_tile_library()
    with _emulated_wmma(0) as lib:
        lib.kvcpu_reset_wmma_count()
        tiles.kvcpu_reset_fma_tile_count()
        for partition in (0, 32):
            _run_case(hip_backend, spec, wave=32, partition_size=partition, prefill_min_query=1)
        assert lib.kvcpu_wmma_count() == 0 and tiles.kvcpu_fma_tile_count() > 0


# ALiBi over an fp8 cache in the prefill kernel at every head size: the case of
# test_prefill_kernel_serves_every_head_size with ALiBi gives that test's MFMA count (9 wave-tiles; head 256:
# 12), which the decode kernel's differs from; the oracle checks each run.
ALIBI_PREFILL_MFMAS = {64: 9 * 48, 80: 9 * 56, 96: 9 * 56, 128: 9 * 64, 256: 12 * 64}


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("head_size", ALIBI_PREFILL_MFMAS)
def test_prefill_kernel_takes_alibi_over_fp8_caches(hip_backend, fmt, head_size):
    dtype = (F16, BF16)[(head_size // 16 + list(FP8_FORMATS).index(fmt)) % 2]
    spec = CaseSpec(order="NHD" if fmt == "e4m3" else "HND", block_size=1 if fmt == "e4m3" else 16, num_kv_heads=1,
                    group=1, head_size=head_size, dtype=dtype, query_lens=(70, 3), context_lens=(20, 0),
                    sliding_window=33, softcap=8.0 if head_size % 64 else None, alibi=True)
    lib = _mfma_library()
    lib.kvcpu_reset_mfma_count()
    with _knobs(hip_backend, 64, 0, 1):
        check_fp8_against_reference(spec, "HIP", FP8_FORMATS[fmt])
    assert lib.kvcpu_mfma_count() == ALIBI_PREFILL_MFMAS[head_size]


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("pmq", [0, 1], ids=["decode", "prefill"])
def test_fp8_caches_with_sinks_and_alibi(hip_backend, fmt, pmq):
    spec = dataclasses.replace(PREFILL, dtype=F16 if fmt == "e4m3" else BF16, sinks=True, alibi=True,
                               sliding_window=40, softcap=10.0)
    lib = _mfma_library()
    lib.kvcpu_reset_mfma_count()
    for partition in (0, 16):
        with _knobs(hip_backend, 64, partition, pmq):
            check_fp8_against_reference(spec, "HIP", FP8_FORMATS[fmt])
    assert lib.kvcpu_mfma_count() > 0


@contextlib.contextmanager
def _knobs(backend, wave: int, partition: int, pmq: int):
    """The registry's HIP instance emulating ``wave`` with ``partition_size`` and ``prefill_min_query``."""
    saved = backend.cpu_wave, backend.partition_size, backend.prefill_min_query
    backend.cpu_wave, backend.partition_size, backend.prefill_min_query = wave, partition, pmq
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)
            yield
    finally:
        backend.cpu_wave, backend.partition_size, backend.prefill_min_query = saved


def _non_causal(backend, spec: CaseSpec, wave: int, partition: int, pmq: int,
                cache_dtype: torch.dtype | None = None) -> None:
    """``spec``'s batch written by HIP (over an fp8 ``cache_dtype`` cache of random codes when given), its
    metadata non-causal; HIP against the oracle reading the same cache."""
    case = build_case(spec)
    layout, cache, scales = case.layout, case.cache, {}
    if cache_dtype is not None:
        layout = dataclasses.replace(layout, dtype=cache_dtype)
        cache = layout.allocate("cpu")
        cache.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(spec.seed)).to(cache_dtype))
        k_scale = torch.linspace(0.05, 0.3, spec.num_kv_heads)
        scales = dict(k_scale=k_scale, v_scale=k_scale * 2)
    kw = dict(sliding_window=spec.sliding_window, softcap=spec.softcap, sinks=case.sinks,
              alibi_slopes=case.alibi_slopes, **scales)
    with _knobs(backend, wave, partition, pmq):
        kvmulti.write_kv(case.key, case.value, cache, layout, case.metadata.slot_mapping, backend="HIP", **scales)
        case.metadata.causal = False
        actual = kvmulti.paged_attention(case.query, cache, layout, case.metadata, backend="HIP", **kw)
    expected = reference.paged_attention(case.query, cache, layout, case.metadata, **kw)
    case.metadata.causal = True
    causal = reference.paged_attention(case.query, cache, layout, case.metadata, **kw)
    assert (causal.float() - expected.float()).abs().max() > 0.05   # the case tells the two apart
    assert_close_to_reference(actual, expected, spec.dtype, f"HIP non-causal {spec} {cache_dtype}")


@pytest.mark.parametrize("partition", [0, 16])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_non_causal_matches_the_oracle(hip_backend, engine, dtype, partition):
    wave, pmq = ENGINES[engine]
    base = PREFILL if engine.startswith("prefill") else DECODE
    _non_causal(hip_backend, dataclasses.replace(base, dtype=dtype), wave, partition, pmq)
    _non_causal(hip_backend, dataclasses.replace(base, dtype=dtype, softcap=20.0, sinks=True, alibi=True), wave, partition, pmq)


def test_non_causal_with_a_window_is_refused(hip_backend):
    """The contract's non-causal window is two-sided (|p - k| < W); HIP's kernels mask one side, so HIP
    names it as a capability reason and a call naming HIP is refused rather than served one-sided."""
    config = kvmulti.AttentionConfig("cpu", BF16, 128, 128, 2, 16, "HND", causal=False, sliding_window=True)
    (reason,) = hip_backend.capability_reasons(config)
    assert "no sliding window for non-causal" in reason
    case = build_case(dataclasses.replace(DECODE, dtype=BF16, sliding_window=20))
    case.metadata.causal = False
    with pytest.raises((ValueError, RuntimeError), match="no sliding window for non-causal"):
        kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=20, backend="HIP")


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("pmq", [0, 1], ids=["decode", "prefill"])
def test_non_causal_over_fp8_caches(hip_backend, fmt, pmq):
    lib = _mfma_library()
    lib.kvcpu_reset_mfma_count()
    for partition in (0, 16):
        _non_causal(hip_backend, dataclasses.replace(PREFILL, dtype=BF16, sinks=True), 64, partition, pmq,
                    FP8_FORMATS[fmt])
    assert lib.kvcpu_mfma_count() > 0


def test_hip_declares_the_features_and_a_prepared_step_takes_them_per_layer(hip_backend):
    for causal, window in ((False, False), (True, True)):
        config = kvmulti.AttentionConfig("cpu", BF16, 128, 128, 2, 16, "HND", causal=causal, sliding_window=window,
                                         sinks=True, alibi=True)
        assert hip_backend.capability_reasons(config) == []
    case = build_case(dataclasses.replace(PREFILL, sliding_window=48))
    hq = case.query.shape[1]
    with _knobs(hip_backend, 64, 16, 1):
        kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="HIP")
        step = kvmulti.prepare_step(case.metadata, case.layout, hq, sliding_window=48, backend="HIP", sinks=True,
                                    alibi_slopes=True)
        assert step.plan.num_partitions > 1
        for seed in range(2):                       # two layers of one step, each its own sinks and slopes
            gen = torch.Generator().manual_seed(seed)
            sinks, slopes = torch.randn(hq, generator=gen) * 3, torch.rand(hq, generator=gen)
            out = torch.empty(case.query.shape[0], hq, 128, dtype=BF16)
            kvmulti.paged_attention(case.query, case.cache, case.layout, step, sliding_window=48, out=out,
                                    sinks=sinks, alibi_slopes=slopes)
            want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=48,
                                             sinks=sinks, alibi_slopes=slopes)
            assert_close_to_reference(out, want, BF16, f"HIP prepared step, layer {seed}")
