"""The SYCL backend on an Intel GPU (vendor CI job): torch XPU tensors, torch's XPU queue, no staging.

Every test here is marked ``xpu`` and skipped (with the reason) on hosts without torch.xpu.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import kvmulti
from batches import CaseSpec, assert_close_to_reference, batch_cases, build_case, check_against_reference
from kvmulti.backends import AttentionConfig, get_backend, select_backend

pytestmark = pytest.mark.xpu


@pytest.fixture(scope="module")
def S():
    from kvmulti.backends import sycl
    reasons = sycl.runtime_reasons()
    assert reasons == [], f"SYCL runtime unusable on an XPU host: {reasons}"
    return sycl


@settings(max_examples=150)
@given(batch_cases(head_sizes=(64, 80, 128), max_context=300))
def test_xpu_matches_reference(spec):
    check_against_reference(spec, "SYCL", device="xpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_xpu_grid(dtype, order):
    for i, (bs, group, window, softcap) in enumerate([(1, 1, None, None), (16, 4, 7, 12.0), (32, 8, 40, None)]):
        spec = CaseSpec(order=order, block_size=bs, num_kv_heads=2, group=group, head_size=(64, 80, 128)[i],
                        dtype=dtype, query_lens=(9, 1, 4, 1), context_lens=(0, 45, 20, 700), extra_blocks=i,
                        sliding_window=window, softcap=softcap, seed=i)
        check_against_reference(spec, "SYCL", device="xpu")


def test_xpu_dispatch_picks_sycl(monkeypatch):
    monkeypatch.delenv("KVMULTI_ATTENTION_BACKEND", raising=False)
    layout = kvmulti.KVCacheLayout(8, 16, 2, 64, dtype=torch.bfloat16)
    assert select_backend(AttentionConfig.from_layout(layout, "xpu")) == "SYCL"


def test_xpu_runs_on_torchs_queue_with_device_pointers(S):
    device = torch.device("xpu")
    session = S.xpu_session(device)
    assert session.device.type == "gpu"
    t = torch.empty(100, device=device)
    assert session.pointer_type(t.data_ptr()) in (S.USM_DEVICE, S.USM_SHARED)
    cache = kvmulti.KVCacheLayout(4, 16, 2, 64, dtype=torch.float16).allocate(device, allocator=S.usm_allocator)
    assert cache.device.type == "xpu"


@pytest.mark.parametrize("part", [16, 64])
def test_xpu_split_kv_forced(monkeypatch, part):
    monkeypatch.setattr(get_backend("SYCL"), "partition_size", part)
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=128, dtype=torch.bfloat16,
                    query_lens=(1, 1, 4, 9), context_lens=(1500, 7, 300, 0), sliding_window=None, softcap=15.0)
    check_against_reference(spec, "SYCL", device="xpu")


@pytest.mark.parametrize("part", [0, 16])
@pytest.mark.parametrize("window", [None, 40])
def test_xpu_sinks_and_alibi(monkeypatch, part, window):
    """Sinks alone (the plain kernel) and with ALiBi (kvm_paged_attention_terms), split-KV off and on."""
    monkeypatch.setattr(get_backend("SYCL"), "partition_size", part)
    for alibi in (False, True):
        spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=128, dtype=torch.bfloat16,
                        query_lens=(1, 1, 4, 9), context_lens=(700, 7, 300, 0), sliding_window=window,
                        softcap=15.0, sinks=True, alibi=alibi)
        check_against_reference(spec, "SYCL", device="xpu")


def test_xpu_cache_cross_read_with_cpu():
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=torch.float16,
                    query_lens=(7, 1, 3), context_lens=(0, 33, 12), sliding_window=25)
    case = build_case(spec, "xpu")
    md = case.metadata
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, md.slot_mapping, backend="SYCL")
    cpu_cache = case.cache.cpu().clone()
    cpu_md = kvmulti.CommonAttentionMetadata.from_lens(md.query_lens_cpu.tolist(), md.seq_lens_cpu.tolist(),
                                                       md.block_table.cpu(), spec.block_size)
    out_cpu = kvmulti.paged_attention(case.query.cpu(), cpu_cache, case.layout, cpu_md, sliding_window=25,
                                      backend="CPU")
    out_xpu = kvmulti.paged_attention(case.query, case.cache, case.layout, md, sliding_window=25, backend="SYCL")
    assert_close_to_reference(out_xpu, out_cpu, spec.dtype)
