"""The SYCL backend serves attention sinks, ALiBi and non-causal (encoder-only) attention: its
kernels on whatever SYCL device this host has (Intel's OpenCL CPU device in CPU CI) against the
oracle, over ragged mixed batches (prefill, chunked prefill with context already cached, decode),
GQA, softcap, a sliding window (causal only), both block sizes and orders, fp8 caches, and split-KV
on and off (the sink joins once, in the reduction); then the prepared-step path, a NaN row, and the
one refusal left: a sliding window with non-causal attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

import kvmulti
from batches import (assert_close_to_reference, batch_cases, build_case, check_against_reference,
                     check_fp8_against_reference)
from kvmulti import reference
from kvmulti.backends.registry import BackendSelectionError, get_backend
from test_alibi import MIXED as ALIBI_MIXED
from test_non_causal import check_backend as check_non_causal, non_causal_case, spec as nc_spec
from test_sinks import MIXED as SINKS_MIXED, require
from test_sycl_backend import launches  # noqa: F401 (the fixture naming the kernels a test launches)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(autouse=True)
def sycl():
    """The SYCL backend with its partition size restored after each test (skipped where the
    runtime is unusable; a failure in CI)."""
    require("SYCL")
    backend = get_backend("SYCL")
    saved = backend.partition_size
    yield backend
    backend.partition_size = saved


def split_plan(case, **prepare) -> object:
    """The SYCL launch plan of the case's step (to assert that a split really happens)."""
    step = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], backend="SYCL", **prepare)
    return step.plan.plan


# ------------------------------------------------------------------------------------ which kernel
def test_plain_kernel_unless_alibi_or_non_causal(sycl, launches):
    """Sinks touch only the merge after the key loop: the plain kernels serve them (and the split
    reduction adds them). ALiBi or non-causal take the *_terms kernels. Tiles of at most 8 rows go to
    kvm_paged_attention(_terms), larger ones to kvm_paged_prefill(_terms)."""
    case = build_case(SINKS_MIXED)
    reference.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping)

    def attend(**kw):
        kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend="SYCL", **kw)

    attend(sinks=case.sinks)
    attend(alibi_slopes=torch.full((case.query.shape[1],), 0.25))
    case.metadata.causal = False
    attend(sinks=case.sinks)
    sycl.partition_size = 16
    attend()
    case.metadata.causal = True
    attend(sinks=case.sinks)
    # the batch's decode tiles (4 rows) on the attention kernels, its prefill tiles (20, 36 rows) on
    # the prefill kernels
    assert launches == ["kvm_paged_attention", "kvm_paged_prefill",
                        "kvm_paged_attention_terms", "kvm_paged_prefill_terms",
                        "kvm_paged_attention_terms", "kvm_paged_prefill_terms",
                        "kvm_paged_attention_terms[split]", "kvm_paged_prefill_terms[split]", "kvm_split_reduce",
                        "kvm_paged_attention[split]", "kvm_paged_prefill[split]", "kvm_split_reduce"]


# ------------------------------------------------------------------------------------ random batches
@settings(max_examples=examples(25), deadline=None)
@given(batch_cases(head_sizes=(64, 80), block_sizes=(1, 16, 32), groups=(1, 4, 8), sinks=True), st.booleans(),
       st.sampled_from([0, 16]))
def test_random_batches_with_sinks_and_alibi(spec, alibi, partition):
    get_backend("SYCL").partition_size = partition
    check_against_reference(dataclasses.replace(spec, alibi=alibi or not spec.sinks), "SYCL")


@settings(max_examples=examples(15), deadline=None)
@given(batch_cases(head_sizes=(64, 80), block_sizes=(1, 16, 32), groups=(1, 4, 8), windows=False, sinks=True),
       st.booleans(), st.sampled_from([0, 16]))
def test_random_non_causal_batches(spec, alibi, partition):
    get_backend("SYCL").partition_size = partition
    check_non_causal(dataclasses.replace(spec, alibi=alibi), "SYCL")


# ------------------------------------------------------------------------------------ sinks
@pytest.mark.parametrize("partition", [0, 16, 64])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_split_kv_adds_the_sink_once(sycl, order, partition, window):
    sycl.partition_size = partition
    spec = dataclasses.replace(SINKS_MIXED, order=order, sliding_window=window, softcap=20.0)
    if partition == 16 or (partition and window is None):
        assert split_plan(build_case(spec), sliding_window=window, sinks=True).num_parts > 1
    for dtype in (F32, BF16):
        check_against_reference(dataclasses.replace(spec, dtype=dtype), "SYCL")


def test_sinks_dominating_and_absent():
    """A row whose sink far outweighs its keys (output near zero) and sinks of -inf (the plain softmax)."""
    case = build_case(SINKS_MIXED)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="SYCL")
    hq = case.query.shape[1]
    for sinks in (torch.full((hq,), 40.0), torch.full((hq,), float("-inf")), torch.linspace(-30, 30, hq)):
        out = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend="SYCL", sinks=sinks)
        want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sinks=sinks)
        assert_close_to_reference(out, want, F32, f"sinks {sinks}")


def test_nan_query_row_stays_nan_and_alone(sycl):
    for partition in (0, 16):
        sycl.partition_size = partition
        case = build_case(dataclasses.replace(SINKS_MIXED, alibi=True))
        kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="SYCL")
        case.query[3, 1] = float("nan")
        out = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend="SYCL",
                                      sinks=case.sinks, alibi_slopes=case.alibi_slopes)
        want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sinks=case.sinks,
                                         alibi_slopes=case.alibi_slopes)
        assert out[3, 1].isnan().all()
        torch.testing.assert_close(out, want, atol=2e-4, rtol=2e-4, equal_nan=True)


# ------------------------------------------------------------------------------------ ALiBi
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("partition", [0, 16])
@pytest.mark.parametrize("window", [None, 24])
def test_alibi_split_kv_and_window(sycl, order, partition, window):
    sycl.partition_size = partition
    for dtype in (F32, BF16):
        check_against_reference(dataclasses.replace(ALIBI_MIXED, order=order, sliding_window=window, dtype=dtype,
                                                    softcap=20.0), "SYCL")


@pytest.mark.parametrize("group", [1, 2, 8, 24])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_gqa_decode_and_long_prefill(group, dtype):
    """Decode rows, a 150-token prefill (many tiles) and chunked prefill, with ALiBi and sinks; a
    group of 24 spreads one token's heads over two tiles."""
    check_against_reference(dataclasses.replace(ALIBI_MIXED, group=group, dtype=dtype, sinks=True, block_size=32,
                                                query_lens=(1, 1, 150, 33), context_lens=(300, 9, 0, 100)), "SYCL")


def check_scaled(spec, backend, scale: float | None) -> None:
    """``spec``'s batch attended by ``backend`` with ``scale`` (its window and softcap) against the oracle."""
    case = build_case(spec)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend=backend)
    kw = dict(scale=scale, sliding_window=spec.sliding_window, softcap=spec.softcap)
    out = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend=backend, **kw)
    want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, **kw)
    assert_close_to_reference(out, want, spec.dtype, f"{kw}")


#: a long prefill, a chunked prefill and a decode row: most of the prefill tiles' key steps unmasked
LONG_PREFILL = dataclasses.replace(ALIBI_MIXED, alibi=False, group=2, head_size=64, block_size=16,
                                   query_lens=(120, 40, 1), context_lens=(0, 90, 50))


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("scale", [-0.125, 0.0, 0.2])
@pytest.mark.parametrize("softcap, window", [(None, None), (20.0, None), (None, 40)])
def test_prefill_scale_of_any_sign(dtype, scale, softcap, window):
    """The prefill body's query fragments carry the scale's sign (its scores use |scale|): negative
    and zero scales, with and without a softcap or window."""
    check_scaled(dataclasses.replace(LONG_PREFILL, dtype=dtype, sliding_window=window, softcap=softcap), "SYCL", scale)


def test_split_key_loop_on_the_emulated_body(monkeypatch):
    """The key loop the GPU build of kvm_paged_prefill runs (KVM_SPLIT_KEYS: masked steps, then
    unmasked ones in a copy with and one without the softcap, the latter taking the row max from the
    raw scores, then masked ones), built over the emulated built-ins: scales of either sign and zero,
    softcap, window, a chunk after cached context, invalid block ids past the window's edge, split-KV."""
    from kvmulti.backends.sycl import SyclBackend, kernel_config
    monkeypatch.setattr(kernel_config, "split_keys", lambda mma: mma != kernel_config.MMA_OFF)
    assert "-DKVM_SPLIT_KEYS=1" in kernel_config.kernel_options(BF16, 64, 64)
    split = SyclBackend()
    for scale, softcap, window in ((-0.125, None, None), (0.0, None, 40), (0.2, 20.0, None), (None, 30.0, 24)):
        check_scaled(dataclasses.replace(LONG_PREFILL, dtype=BF16, sliding_window=window, softcap=softcap), split, scale)
    split.partition_size = 32
    check_scaled(dataclasses.replace(LONG_PREFILL, dtype=BF16, sliding_window=24, extra_blocks=2, seed=5), split, None)


def test_decode_batch(sycl):
    for partition in (0, 16):
        sycl.partition_size = partition
        check_against_reference(dataclasses.replace(ALIBI_MIXED, sinks=True, block_size=1, order="HND", group=8,
                                                    query_lens=(1,) * 5, context_lens=(3, 70, 31, 200, 1),
                                                    sliding_window=50), "SYCL")


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("partition", [0, 16])
def test_fp8_cache_with_sinks_and_alibi(sycl, cache_dtype, partition):
    sycl.partition_size = partition
    check_fp8_against_reference(dataclasses.replace(ALIBI_MIXED, dtype=BF16, sliding_window=50, sinks=True),
                                "SYCL", cache_dtype)
    check_fp8_against_reference(dataclasses.replace(ALIBI_MIXED, dtype=F16, order="HND", block_size=1, group=1,
                                                    softcap=10.0), "SYCL", cache_dtype)


def test_prepared_step_takes_sinks_and_slopes_per_layer():
    case = build_case(dataclasses.replace(ALIBI_MIXED, sliding_window=64))
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="SYCL")
    hq = case.query.shape[1]
    step = kvmulti.prepare_step(case.metadata, case.layout, hq, sliding_window=64, backend="SYCL", sinks=True,
                                alibi_slopes=True)
    assert step.backend.name == "SYCL" and step.sinks and step.alibi
    for seed in range(2):                       # two layers: one step, each its own sinks and slopes
        gen = torch.Generator().manual_seed(seed)
        sinks, slopes = torch.randn(hq, generator=gen) * 3, torch.rand(hq, generator=gen)
        out = torch.empty(case.query.shape[0], hq, 64)
        kvmulti.paged_attention(case.query, case.cache, case.layout, step, sliding_window=64, out=out, sinks=sinks,
                                alibi_slopes=slopes)
        want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=64,
                                         sinks=sinks, alibi_slopes=slopes)
        assert_close_to_reference(out, want, F32, f"layer {seed}")


# ------------------------------------------------------------------------------------ non-causal
@pytest.mark.parametrize("case_spec", [
    nc_spec(),
    nc_spec(dtype=F16, order="HND", softcap=20.0, group=4, num_kv_heads=1, sinks=True),
    nc_spec(dtype=BF16, block_size=1, head_size=80, head_size_v=64, alibi=True),
    nc_spec(dtype=BF16, block_size=32, group=8, sinks=True, alibi=True, query_lens=(70, 1, 9, 33),
            context_lens=(0, 30, 20, 100)),
], ids=["fp32", "fp16_hnd_softcap_gqa4_sinks", "bf16_bs1_hs80_hsv64_alibi", "bf16_bs32_gqa8_sinks_alibi_long"])
@pytest.mark.parametrize("partition", [0, 32])
def test_non_causal_matches_oracle(sycl, case_spec, partition):
    sycl.partition_size = partition
    check_non_causal(case_spec, "SYCL")


def test_non_causal_split_covers_every_key(sycl):
    """Partitions of every tile run to seq_len (its last partition holds keys after the tile's rows)."""
    sycl.partition_size = 32
    case_spec = nc_spec(query_lens=(40, 3, 6), context_lens=(0, 120, 40), sinks=True, alibi=True)
    case = non_causal_case(case_spec)
    plan = split_plan(case, sinks=True, alibi_slopes=True)
    assert plan.max_span == 123 and plan.num_parts == 4
    check_non_causal(case_spec, "SYCL")


@pytest.mark.parametrize("cache_dtype", FP8)
def test_non_causal_fp8_cache(cache_dtype):
    case = non_causal_case(nc_spec(dtype=BF16, sinks=True, alibi=True, order="HND"))
    layout = dataclasses.replace(case.layout, dtype=cache_dtype)
    cache = layout.allocate()
    cache.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(5)).to(cache_dtype))
    scales = dict(k_scale=torch.tensor([0.1, 0.2]), v_scale=torch.tensor([0.3, 0.05]))
    kvmulti.write_kv(case.key, case.value, cache, layout, case.metadata.slot_mapping, backend="SYCL", **scales)
    out = kvmulti.paged_attention(case.query, cache, layout, case.metadata, backend="SYCL", sinks=case.sinks,
                                  alibi_slopes=case.alibi_slopes, **scales)
    want = reference.paged_attention(case.query, cache, layout, case.metadata, sinks=case.sinks,
                                     alibi_slopes=case.alibi_slopes, **scales)
    assert_close_to_reference(out, want, BF16, f"non-causal {cache_dtype}")


def test_serves_non_causal_but_not_with_a_window():
    config = kvmulti.AttentionConfig("cpu", F32, 64, 64, 2, 16, "NHD", causal=False, sinks=True, alibi=True)
    assert not get_backend("SYCL").capability_reasons(config)
    (reason,) = get_backend("SYCL").capability_reasons(dataclasses.replace(config, sliding_window=True))
    assert reason.startswith("SYCL has no sliding window for non-causal")
    case = non_causal_case(nc_spec())
    with pytest.raises(BackendSelectionError, match="no sliding window for non-causal"):
        kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], sliding_window=8, backend="SYCL")


# ------------------------------------------------------------------------------------ vector body
@pytest.mark.parametrize("partition", [0, 16])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_vector_body_over_16_bit_activations(monkeypatch, dtype, partition):
    """fp16 / bf16 on the vector body, which a GPU without the sub-group-16 matrix built-ins (DG2)
    runs: the CPU device otherwise takes the (emulated) matrix body for them. A fresh backend built
    with the matrix path off, against the oracle: sinks with a window and softcap, ALiBi, GQA,
    chunked prefill and decode, split-KV on and off."""
    from kvmulti.backends.sycl import SyclBackend, kernel_config
    monkeypatch.setattr(kernel_config, "matrix_mode", lambda *args, **kwargs: kernel_config.MMA_OFF)
    vector = SyclBackend()
    vector.partition_size = partition
    options = kernel_config.kernel_options(dtype, 64, 64)
    assert "-DKVM_MMA=0" in options
    check_against_reference(dataclasses.replace(SINKS_MIXED, dtype=dtype, sliding_window=48, softcap=30.0), vector)
    check_against_reference(dataclasses.replace(ALIBI_MIXED, dtype=dtype, order="HND"), vector)
