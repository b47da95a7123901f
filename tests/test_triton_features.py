"""Attention sinks and ALiBi on the TRITON backend against the oracle, run by Triton's interpreter on
CPU tensors (as tests/test_triton_backend.py): the single pass (mixed-batch and prefill loops) and the
split-KV path (a sink added once, in the partition reduction), with window, softcap, GQA and fp8.
Kept small: the interpreter is slow."""

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
                     check_fp8_against_reference, record_triton_launches)

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not triton_backend.interpreting(),
                                reason="CPU-tensor Triton tests need TRITON_INTERPRET=1 (GPU hosts: test_triton_gpu.py)")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

#: feature -> (CaseSpec flag, argument of paged_attention / prepare_step, the kernel's constexpr)
FEATURES = {"sinks": ("sinks", "sinks", "SINKS"), "alibi": ("alibi", "alibi_slopes", "ALIBI")}


def spec(feature: str, **kw) -> CaseSpec:
    base = dict(order="NHD", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=F32, seed=5,
                query_lens=(9, 1, 5, 1), context_lens=(0, 70, 30, 150))
    base[FEATURES[feature][0]] = True
    base.update(kw)
    return CaseSpec(**base)


def feature_tensor(case, feature: str) -> dict:
    """``{argument: tensor}`` of ``feature`` for a built case."""
    argument = FEATURES[feature][1]
    return {argument: getattr(case, argument)}


@pytest.mark.parametrize("feature, kw", [
    ("sinks", {}),
    ("sinks", dict(dtype=F16, order="HND", sliding_window=24, softcap=20.0)),
    ("sinks", dict(dtype=BF16, group=1, block_size=1, sliding_window=40)),
    ("sinks", dict(group=8, num_kv_heads=1, head_size=80, head_size_v=64)),
    ("alibi", {}),
    ("alibi", dict(dtype=F16, order="HND", sliding_window=24, softcap=20.0)),
    ("alibi", dict(dtype=BF16, group=1, block_size=1, sinks=True)),
], ids=["sinks_fp32", "sinks_fp16_hnd_window_softcap", "sinks_bf16_gqa1_block1_window", "sinks_gqa8_hs80_hsv64",
        "alibi_fp32", "alibi_fp16_hnd_window_softcap", "alibi_bf16_gqa1_block1_sinks"])
def test_single_pass_matches_oracle(feature, kw):
    check_against_reference(spec(feature, **kw), "TRITON")


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("family", ["nvidia", "amd"])
@pytest.mark.parametrize("kw", [
    dict(dtype=BF16, query_lens=(70, 1, 9), context_lens=(0, 130, 20)),
    dict(dtype=F16, query_lens=(66, 5), context_lens=(150, 10), sliding_window=50, softcap=20.0, order="HND"),
], ids=["varlen_bf16", "chunked_window_softcap_fp16"])
def test_prefill_loop_matches_oracle(feature, family, kw, monkeypatch):
    from kvmulti.backends.triton import launch
    monkeypatch.setattr(launch, "device_family", lambda device: family)   # the GPU plan: the prefill loop
    launches = record_triton_launches(monkeypatch)
    check_against_reference(spec(feature, **kw), "TRITON")
    (attention,) = [ln for ln in launches if ln.kernel == "unified_attention"]
    assert attention.args["PREFILL"] and attention.args[FEATURES[feature][2]]   # log2 units: the term converted


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("window", [None, 40])
def test_split_kv(feature, window):
    """With split-KV a sink is added once, in the partition reduction; ALiBi in every partition."""
    case = build_case(spec(feature, query_lens=(1, 1, 1), context_lens=(70, 150, 200), sliding_window=window,
                           dtype=BF16))
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="CPU")
    tensor = feature_tensor(case, feature)
    expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=window,
                                         **tensor)
    for partition in (0, 32):
        backend = TritonBackend(partition_size=partition)
        step = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], sliding_window=window,
                                    backend=backend, **{name: True for name in tensor})
        assert step.plan.split is bool(partition) and step.plan.num_parts == (7 if partition else 1)
        out = kvmulti.paged_attention(case.query, case.cache, case.layout, step, sliding_window=window, **tensor)
        assert_close_to_reference(out, expected, BF16, f"partition_size={partition}")


@pytest.mark.parametrize("feature", list(FEATURES))
def test_fp8_cache(feature):
    check_fp8_against_reference(spec(feature, dtype=BF16, sliding_window=50), "TRITON", torch.float8_e4m3fn)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_the_feature_changes_the_output(feature):
    """The suites above would pass a kernel that ignored the feature only if it did nothing."""
    case = build_case(spec(feature))
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="CPU")
    plain = reference.paged_attention(case.query, case.cache, case.layout, case.metadata)
    featured = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend="TRITON",
                                       **feature_tensor(case, feature))
    assert (plain - featured).abs().max() > 0.1
