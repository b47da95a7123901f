"""The TRITON oracle suite on a real GPU (compiled kernels, device="cuda"): NVIDIA and AMD.

Each test runs once per vendor marker (``cuda`` / ``rocm``); conftest skips the vendor this host
lacks, and the vendor CI job runs it. TRITON_INTERPRET must be unset there: a GPU suite run by
the interpreter fails instead of passing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from batches import CaseSpec, batch_cases, build_case, check_against_reference, check_fp8_against_reference
from test_triton_backend import (corner_specs, prefill_specs, run_cross_backend_cache, run_split_vs_single,
                                 run_strided_write, split_specs)

import kvmulti
from kvmulti import reference
from kvmulti.backends import get_backend
from kvmulti.backends import triton as triton_backend
from kvmulti.backends.base import AttentionConfig

VENDORS = [pytest.param("cuda", marks=pytest.mark.cuda, id="cuda"),
           pytest.param("rocm", marks=pytest.mark.rocm, id="rocm")]


def gpu(vendor: str) -> str:
    if triton_backend.interpreting():
        pytest.fail("TRITON_INTERPRET=1 is set on a GPU host: the GPU suite must run compiled kernels")
    reasons = get_backend("TRITON").not_supported_reasons(
        AttentionConfig.from_layout(kvmulti.KVCacheLayout(4, 16, 2, 64, dtype=torch.float16), "cuda"))
    assert not reasons, reasons
    return "cuda"


@pytest.mark.parametrize("vendor", VENDORS)
@settings(max_examples=150)
@given(spec=batch_cases(head_sizes=(64, 80, 128), max_reqs=8, max_context=700, max_query=70))
def test_gpu_matches_reference(vendor, spec):
    check_against_reference(spec, "TRITON", device=gpu(vendor))


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("spec", corner_specs())
def test_gpu_corners(vendor, spec):
    check_against_reference(spec, "TRITON", device=gpu(vendor))


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("spec", prefill_specs())
def test_gpu_prefill_tiles_match_reference(vendor, spec):
    """The prefill tiles the planner picks for this GPU (launch.prefill_tiles: per family, and on
    NVIDIA per compute capability) against the oracle."""
    check_against_reference(spec, "TRITON", device=gpu(vendor))


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("spec", split_specs())
def test_gpu_split_kv_matches_single_pass(vendor, spec):
    run_split_vs_single(spec, gpu(vendor))


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_split_kv_default_partition_long_decode(vendor, dtype):
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=8, head_size=128, dtype=dtype,
                    query_lens=(1, 1, 1), context_lens=(3000, 1500, 700), sliding_window=None, softcap=None)
    run_split_vs_single(spec, gpu(vendor), partition_size=kvmulti.settings.DEFAULT_PARTITION_SIZE)


@pytest.mark.parametrize("vendor", VENDORS)
def test_gpu_heuristic_picks_split_for_few_long_decodes(vendor):
    device = gpu(vendor)
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=1, group=8, head_size=64, dtype=torch.bfloat16,
                    query_lens=(1, 1), context_lens=(4000, 2500))
    case = build_case(spec, device)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="TRITON")
    step = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], backend="TRITON")
    assert step.plan.split      # 2 programs on a whole GPU: split
    out = kvmulti.paged_attention(case.query, case.cache, case.layout, step)
    expected = reference.paged_attention(case.query.cpu(), case.cache.cpu(), case.layout,
                                         kvmulti.CommonAttentionMetadata.from_lens(
                                             list(spec.query_lens), list(spec.seq_lens),
                                             case.metadata.block_table.cpu(), spec.block_size))
    torch.testing.assert_close(out.float().cpu(), expected.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_cache_written_by_triton_reads_through_cpu_and_back(vendor, order, dtype):
    spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=4, head_size=80, dtype=dtype,
                    query_lens=(6, 1, 3), context_lens=(0, 40, 18), sliding_window=30)
    run_cross_backend_cache(spec, gpu(vendor), "CPU")


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_gpu_write_kv_strided_inputs_and_padding(vendor, order):
    run_strided_write(gpu(vendor), torch.bfloat16, order)


@pytest.mark.parametrize("vendor", VENDORS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_fp8_cache_matches_reference(vendor, order, cache_dtype, dtype):
    spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=4, head_size=128, dtype=dtype,
                    query_lens=(7, 3, 1, 1), context_lens=(0, 40, 300, 9), extra_blocks=1, sliding_window=None,
                    softcap=None, seed=11)
    check_fp8_against_reference(spec, "TRITON", cache_dtype, device=gpu(vendor))
