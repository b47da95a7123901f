"""HIP backend on a real AMD GPU (ROCm build of torch): the same oracle suite as the CPU harness,
on device tensors, through the hipcc-built library. Runs in the rocm vendor CI job; conftest skips
the `rocm` marker elsewhere with the reason."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batches import ALL_DTYPES, CaseSpec, batch_cases, check_against_reference

import kvmulti
from kvmulti import reference
from kvmulti.backends import get_backend, hip
from kvmulti.backends.base import AttentionConfig
from kvmulti.backends.registry import select_backend

pytestmark = pytest.mark.rocm

MIXED = dict(block_sizes=(1, 16, 32), head_sizes=(64, 128), groups=(1, 4, 8), kv_heads=(1, 2), dtypes=ALL_DTYPES,
             max_reqs=6, max_context=300, max_query=24)


@pytest.fixture(scope="module")
def backend():
    b = get_backend("HIP")
    reasons = b.platform_reasons("rocm") + b.unavailable_reasons()
    assert not reasons, f"HIP cannot run on this ROCm host: {reasons}"
    return b


def _run(backend, spec, partition_size=-1):
    saved = backend.partition_size
    backend.partition_size = partition_size
    try:
        check_against_reference(spec, "HIP", device="cuda")
    finally:
        backend.partition_size = saved


def test_hip_is_first_choice_on_rocm(backend):
    layout = kvmulti.KVCacheLayout(8, 16, 2, 128, dtype=torch.bfloat16, order="HND")
    assert select_backend(AttentionConfig.from_layout(layout, "cuda")) == "HIP"
    assert not backend.describe().startswith("CPU harness")


def test_library_built_for_this_device(backend):
    path = hip.build.prebuilt_rocm_library() or hip.build.build_rocm_library()
    archs = hip.build.library_archs(path)
    assert archs is None or hip.build.device_arch() in archs
    lib = hip.library.load_rocm_library()
    assert lib.kvmulti_hip_wave_size(0) in (32, 64)


@settings(max_examples=60)
@given(spec=batch_cases(**MIXED))
def test_matches_reference_on_gpu(backend, spec):
    _run(backend, spec, partition_size=0)


@settings(max_examples=40)
@given(spec=batch_cases(**MIXED), partition=st.sampled_from([5, 16, 64]))
def test_partitioned_decode_on_gpu(backend, spec, partition):
    _run(backend, spec, partition_size=partition)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("head_size", hip.HEAD_SIZES)
def test_declared_head_sizes_and_long_contexts(backend, order, head_size):
    spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=4, head_size=head_size, dtype=torch.float16,
                    query_lens=(17, 1, 1, 5), context_lens=(0, 2100, 700, 1500), sliding_window=None, softcap=30.0)
    _run(backend, spec)        # the default heuristic; long decodes with few heads split
    spec = CaseSpec(order=order, block_size=32, num_kv_heads=1, group=8, head_size=head_size, dtype=torch.bfloat16,
                    query_lens=(3, 1), context_lens=(1200, 900), sliding_window=512)
    _run(backend, spec, partition_size=0)


def test_two_block_cache_on_gpu(backend):
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=torch.float32,
                    query_lens=(3, 1), context_lens=(0, 9))
    _run(backend, spec)


def test_runs_on_torch_current_stream(backend):
    """Work is queued on torch's current stream: results are right after that stream syncs."""
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=128, dtype=torch.float16,
                    query_lens=(9, 1), context_lens=(40, 700))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _run(backend, spec)
    stream.synchronize()


def test_gpu_and_cpu_caches_read_identically(backend):
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=torch.bfloat16,
                    query_lens=(6, 1), context_lens=(0, 37))
    from batches import build_case
    case = build_case(spec, device="cuda")
    cpu_cache = case.cache.cpu().clone()
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="HIP")
    kvmulti.write_kv(case.key.cpu(), case.value.cpu(), cpu_cache, case.layout, case.metadata.slot_mapping.cpu(),
                     backend="CPU")
    assert torch.equal(case.cache.cpu(), cpu_cache)
    gpu_out = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend="HIP")
    md_cpu = kvmulti.CommonAttentionMetadata.from_lens(list(spec.query_lens), list(spec.seq_lens),
                                                       case.metadata.block_table.cpu(), spec.block_size)
    expected = reference.paged_attention(case.query.cpu(), cpu_cache, case.layout, md_cpu)
    torch.testing.assert_close(gpu_out.float().cpu(), expected.float(), atol=1.6e-2, rtol=1.6e-2)
