"""Attention sinks on the TRITON backend against the oracle, run by Triton's interpreter on CPU
tensors (as tests/test_triton_backend.py): the single pass (mixed-batch and prefill loops) and the
split-KV path (the sink added once, in the partition reduction), with window, softcap, GQA and fp8."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvmulti  # noqa: E402
from kvmulti import reference  # noqa: E402
from kvmulti.backends import triton as triton_backend  # noqa: E402
from kvmulti.backends.triton import TritonBackend  # noqa: E402

from batches import (CaseSpec, assert_close_to_reference, build_case, check_against_reference,  # noqa: E402
                     check_fp8_against_reference)

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not triton_backend.interpreting(),
                                reason="CPU-tensor Triton tests need TRITON_INTERPRET=1 (GPU hosts: test_triton_gpu.py)")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def spec(**kw) -> CaseSpec:
    base = dict(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=F32, sinks=True, seed=5,
                query_lens=(9, 1, 5, 1), context_lens=(0, 70, 30, 150))
    base.update(kw)
    return CaseSpec(**base)


@pytest.mark.parametrize("case", [
    spec(),
    spec(dtype=F16, order="HND", sliding_window=24, softcap=20.0),
    spec(dtype=BF16, group=1, block_size=1, sliding_window=40),
    spec(group=8, num_kv_heads=1, head_size=80, head_size_v=64),
], ids=["fp32", "fp16_hnd_window_softcap", "bf16_gqa1_block1_window", "gqa8_hs80_hsv64"])
def test_single_pass_matches_oracle(case):
    check_against_reference(case, "TRITON")


@pytest.mark.parametrize("family", ["nvidia", "amd"])
@pytest.mark.parametrize("case", [
    spec(dtype=BF16, query_lens=(70, 1, 9), context_lens=(0, 130, 20)),
    spec(dtype=F16, query_lens=(66, 5), context_lens=(150, 10), sliding_window=50, softcap=20.0, order="HND"),
], ids=["varlen_bf16", "chunked_window_softcap_fp16"])
def test_prefill_loop_matches_oracle(case, family, monkeypatch):
    from kvmulti.backends.triton import launch
    monkeypatch.setattr(launch, "device_family", lambda device: family)
    launches, run = [], launch.run
    monkeypatch.setattr(launch, "run", lambda ls: (launches.extend(ls), run(ls))[1])
    check_against_reference(case, "TRITON")
    (attention,) = [ln for ln in launches if ln.kernel == "unified_attention"]
    assert attention.args["PREFILL"] and attention.args["SINKS"]    # log2 units: the sink converted


@pytest.mark.parametrize("window", [None, 40])
def test_split_kv_adds_the_sink_once(window):
    case_spec = spec(query_lens=(1, 1, 1), context_lens=(70, 150, 200), sliding_window=window, dtype=BF16)
    case = build_case(case_spec)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="CPU")
    expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=window,
                                         sinks=case.sinks)
    for partition in (0, 32):
        backend = TritonBackend(partition_size=partition)
        step = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], sliding_window=window,
                                    backend=backend, sinks=True)
        assert step.plan.split is bool(partition) and step.plan.num_parts == (7 if partition else 1)
        out = kvmulti.paged_attention(case.query, case.cache, case.layout, step, sliding_window=window,
                                      sinks=case.sinks)
        assert_close_to_reference(out, expected, BF16, f"partition_size={partition}")


def test_fp8_cache():
    check_fp8_against_reference(spec(dtype=BF16, sliding_window=50), "TRITON", torch.float8_e4m3fn)


def test_sinks_change_the_output():
    """The suites above would pass a kernel that ignored sinks only if the sinks did nothing."""
    case = build_case(spec())
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="CPU")
    plain = reference.paged_attention(case.query, case.cache, case.layout, case.metadata)
    with_sinks = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend="TRITON",
                                         sinks=case.sinks)
    assert (plain - with_sinks).abs().max() > 0.1
