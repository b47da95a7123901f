"""ALiBi on the TRITON backend against the oracle, run by Triton's interpreter on CPU tensors (as
tests/test_sinks_triton.py): the single pass (mixed-batch and prefill loops) and the split-KV path,
with window, softcap, GQA, sinks and fp8. Kept small: the interpreter is slow."""

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
    base = dict(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=F32, alibi=True, seed=5,
                query_lens=(9, 1, 5, 1), context_lens=(0, 70, 30, 150))
    base.update(kw)
    return CaseSpec(**base)


@pytest.mark.parametrize("case", [
    spec(),
    spec(dtype=F16, order="HND", sliding_window=24, softcap=20.0),
    spec(dtype=BF16, group=1, block_size=1, sinks=True),
], ids=["fp32", "fp16_hnd_window_softcap", "bf16_gqa1_block1_sinks"])
def test_single_pass_matches_oracle(case):
    check_against_reference(case, "TRITON")


@pytest.mark.parametrize("case", [
    spec(dtype=BF16, query_lens=(70, 1, 9), context_lens=(0, 130, 20)),
    spec(dtype=F16, query_lens=(66, 5), context_lens=(150, 10), sliding_window=50, softcap=20.0, order="HND"),
], ids=["varlen_bf16", "chunked_window_softcap_fp16"])
def test_prefill_loop_matches_oracle(case, monkeypatch):
    from kvmulti.backends.triton import launch
    monkeypatch.setattr(launch, "device_family", lambda device: "nvidia")   # the GPU plan: the prefill loop
    launches, run = [], launch.run
    monkeypatch.setattr(launch, "run", lambda ls: (launches.extend(ls), run(ls))[1])
    check_against_reference(case, "TRITON")
    (attention,) = [ln for ln in launches if ln.kernel == "unified_attention"]
    assert attention.args["PREFILL"] and attention.args["ALIBI"]    # log2 units: the bias converted


@pytest.mark.parametrize("window", [None, 40])
def test_split_kv(window):
    case = build_case(spec(query_lens=(1, 1, 1), context_lens=(70, 150, 200), sliding_window=window, dtype=BF16))
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="CPU")
    expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=window,
                                         alibi_slopes=case.alibi_slopes)
    for partition in (0, 32):
        backend = TritonBackend(partition_size=partition)
        step = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], sliding_window=window,
                                    backend=backend, alibi_slopes=True)
        assert step.plan.split is bool(partition) and step.plan.num_parts == (7 if partition else 1)
        out = kvmulti.paged_attention(case.query, case.cache, case.layout, step, sliding_window=window,
                                      alibi_slopes=case.alibi_slopes)
        assert_close_to_reference(out, expected, BF16, f"partition_size={partition}")


def test_fp8_cache():
    check_fp8_against_reference(spec(dtype=BF16, sliding_window=50), "TRITON", torch.float8_e4m3fn)


def test_alibi_changes_the_output():
    """The suites above would pass a kernel that ignored the slopes only if the slopes did nothing."""
    case = build_case(spec())
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="CPU")
    plain = reference.paged_attention(case.query, case.cache, case.layout, case.metadata)
    with_alibi = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend="TRITON",
                                         alibi_slopes=case.alibi_slopes)
    assert (plain - with_alibi).abs().max() > 0.1
