"""Non-causal (encoder-only) attention: every new token sees all ``seq_len`` keys of its request; with a
sliding window W only those with |query position - key position| < W (vLLM CPU_ATTN's rule).

The oracle against a dense softmax written here, the CPU backend (native kernel and torch path)
and the TRITON backend (Triton's interpreter on CPU tensors, as tests/test_triton_backend.py:
single pass, both prefill-loop families and split-KV) against the oracle, with and without windows
(HIP: tests/test_hip_features.py; SYCL: tests/test_sycl_features.py; both refuse a window with it);
the backend without it (IPEX) names it as a capability reason."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvmulti  # noqa: E402
from kvmulti import reference  # noqa: E402
from kvmulti.backends import triton as triton_backend  # noqa: E402
from kvmulti.backends.cpu.backend import CPUBackend  # noqa: E402
from kvmulti.backends.triton import TritonBackend  # noqa: E402

from batches import CaseSpec, assert_close_to_reference, build_case, record_triton_launches  # noqa: E402
from availability import require_native_cpu_kernel  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def spec(**kw) -> CaseSpec:
    base = dict(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=64, dtype=F32, seed=11,
                query_lens=(9, 1, 5, 20), context_lens=(0, 40, 17, 0))
    base.update(kw)
    return CaseSpec(**base)


def non_causal_case(case_spec: CaseSpec):
    """The spec's batch, its new keys and values written to the cache, its metadata non-causal."""
    case = build_case(case_spec)
    reference.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping)
    case.metadata.causal = False
    return case


def dense(case, visible=None) -> torch.Tensor:
    """Each request's rows attend to every one of its seq_len cached keys: one unmasked softmax
    (``visible(q_pos - k_pos)`` -> bool: masked to the positions it allows)."""
    layout, md = case.layout, case.metadata
    keys, values = layout.keys(case.cache), layout.values(case.cache)
    group = case.query.shape[1] // layout.num_kv_heads
    out = torch.zeros(case.query.shape[0], case.query.shape[1], layout.value_size)
    qsl = md.query_start_loc_cpu.tolist()
    for i, seq_len in enumerate(md.seq_lens_cpu.tolist()):
        q = case.query[qsl[i]:qsl[i + 1]].float()
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        mask = torch.ones(q.shape[0], seq_len, dtype=torch.bool)
        if visible is not None:
            mask = visible(q_pos - torch.arange(seq_len)[None, :])
        # a key no row sees is read as zeros (its table entry may be out of range)
        blocks = md.block_table[i].tolist()
        slots = [(blocks[p // layout.block_size], p % layout.block_size) if mask[:, p].any() else None
                 for p in range(seq_len)]
        k, v = (torch.stack([kv[s] if s else torch.zeros_like(kv[0, 0]) for s in slots]).float()
                .repeat_interleave(group, dim=1) for kv in (keys, values))
        scores = torch.einsum("qhd,khd->hqk", q, k) * layout.head_size ** -0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out[qsl[i]:qsl[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def test_oracle_is_the_unmasked_softmax_and_differs_from_causal():
    case = non_causal_case(spec())
    got = reference.paged_attention(case.query, case.cache, case.layout, case.metadata)
    torch.testing.assert_close(got, dense(case), atol=2e-5, rtol=2e-5)
    case.metadata.causal = True
    causal = reference.paged_attention(case.query, case.cache, case.layout, case.metadata)
    assert (causal - got).abs().max() > 0.1      # the cases would not tell the two apart otherwise


# Encoder-only batches (no context: every key is one of the request's own tokens) and mixed ones.
ENCODER = dict(query_lens=(130, 9, 33, 1), context_lens=(0, 0, 0, 0))
WINDOWS = [1, 5, 16, 40, 300]   # 300: wider than every request


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("lens", [{}, ENCODER], ids=["mixed", "encoder"])
def test_oracle_window_is_symmetric(window, lens):
    case = non_causal_case(spec(sliding_window=window, **lens))
    got = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=window)
    torch.testing.assert_close(got, dense(case, lambda d: d.abs() < window), atol=2e-5, rtol=2e-5)
    if window <= 16:   # the keys after a row's window tell the symmetric rule from a one-sided one
        assert (got - dense(case, lambda d: d < window)).abs().max() > 0.1


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch_path"])
@pytest.mark.parametrize("case_spec", [spec(), spec(dtype=BF16, order="HND", block_size=1, softcap=20.0)],
                         ids=["fp32", "bf16_hnd_bs1_softcap"])
def test_cpu_matches_oracle(native, case_spec):
    backend = CPUBackend(native_kernel=native)
    if native:
        require_native_cpu_kernel()
    check_backend(case_spec, backend)


def check_backend(case_spec: CaseSpec, backend) -> None:
    """``backend`` against the oracle on the spec's batch made non-causal (its window, sinks and ALiBi, if any)."""
    case = non_causal_case(case_spec)
    kw = dict(softcap=case_spec.softcap, sliding_window=case_spec.sliding_window, sinks=case.sinks,
              alibi_slopes=case.alibi_slopes)
    expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, **kw)
    actual = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend=backend, **kw)
    assert_close_to_reference(actual, expected, case_spec.dtype, f"{backend} non-causal {case_spec}")


WINDOWED = [
    spec(sliding_window=5),
    spec(sliding_window=16, group=4, num_kv_heads=1, **ENCODER),
    spec(sliding_window=1, **ENCODER),
    spec(sliding_window=40, dtype=BF16, order="HND", block_size=1, softcap=20.0, **ENCODER),
    spec(sliding_window=300, **ENCODER),
]
WINDOWED_IDS = ["mixed_w5", "encoder_gqa4_w16", "encoder_w1", "encoder_bf16_hnd_bs1_softcap_w40", "encoder_w300"]


@pytest.mark.parametrize("partition", [None, 32], ids=["default", "split32"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch_path"])
@pytest.mark.parametrize("case_spec", WINDOWED, ids=WINDOWED_IDS)
def test_cpu_window_matches_oracle(native, case_spec, partition):
    backend = CPUBackend(partition_size=partition, native_kernel=native)
    if native:
        require_native_cpu_kernel()
    check_backend(case_spec, backend)


triton_only = pytest.mark.skipif(not triton_backend.interpreting(),
                                 reason="CPU-tensor Triton tests need TRITON_INTERPRET=1 (GPU hosts: test_triton_gpu.py)")


@triton_only
@pytest.mark.parametrize("case_spec", [
    spec(),
    spec(dtype=F16, order="HND", softcap=20.0, group=4, num_kv_heads=1),
    spec(dtype=BF16, block_size=1, head_size=80, head_size_v=64),
], ids=["fp32", "fp16_hnd_softcap_gqa4", "bf16_bs1_hs80_hsv64"])
def test_triton_single_pass_matches_oracle(case_spec):
    check_backend(case_spec, TritonBackend(partition_size=0))


@triton_only
@pytest.mark.parametrize("case_spec", WINDOWED[:3], ids=WINDOWED_IDS[:3])
def test_triton_single_pass_window_matches_oracle(case_spec):
    check_backend(case_spec, TritonBackend(partition_size=0))


@triton_only
@pytest.mark.parametrize("family", ["nvidia", "amd"])
def test_triton_prefill_loop_matches_oracle(family, monkeypatch):
    from kvmulti.backends.triton import launch
    monkeypatch.setattr(launch, "device_family", lambda device: family)
    launches = record_triton_launches(monkeypatch)
    check_backend(spec(dtype=BF16, query_lens=(70, 1, 9), context_lens=(0, 30, 20)), "TRITON")
    for window in (3, 20, 100):   # windows shorter than a key tile, longer, wider than the requests
        check_backend(spec(dtype=BF16, sliding_window=window, query_lens=(150, 1, 9), context_lens=(0, 30, 20)),
                      "TRITON")
    for attention in [ln for ln in launches if ln.kernel == "unified_attention"]:
        assert attention.args["PREFILL"] and attention.args["CAUSAL"] is False


@triton_only
def test_triton_split_kv_matches_oracle():
    backend = TritonBackend(partition_size=32)
    case = non_causal_case(spec(query_lens=(1, 3, 6), context_lens=(70, 120, 40)))
    step = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], backend=backend)
    assert step.plan.split and step.plan.num_parts > 1
    out = kvmulti.paged_attention(case.query, case.cache, case.layout, step)
    expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata)
    assert_close_to_reference(out, expected, F32, "TRITON split-KV non-causal")
    for window in (2, 50):
        case = non_causal_case(spec(sliding_window=window, query_lens=(1, 3, 6), context_lens=(70, 120, 40)))
        step = kvmulti.prepare_step(case.metadata, case.layout, case.query.shape[1], backend=backend,
                                    sliding_window=window)
        assert step.plan.split and step.plan.num_parts > 1
        out = kvmulti.paged_attention(case.query, case.cache, case.layout, step, sliding_window=window)
        expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata,
                                             sliding_window=window)
        assert_close_to_reference(out, expected, F32, f"TRITON split-KV non-causal window {window}")


def _config(**kw) -> kvmulti.AttentionConfig:
    return kvmulti.AttentionConfig("cpu", F32, 64, 64, 2, 16, "NHD", causal=False, **kw)


@pytest.mark.parametrize("name", ["CPU", "TRITON"])
def test_backends_serve_non_causal_with_a_window(name):
    from kvmulti.backends.registry import get_backend
    assert not get_backend(name).capability_reasons(_config())
    assert not get_backend(name).capability_reasons(_config(sliding_window=True))


@pytest.mark.parametrize("name", ["IPEX"])
def test_other_backends_name_non_causal_as_the_reason(name):
    from kvmulti.backends.registry import get_backend
    reasons = get_backend(name).capability_reasons(_config())
    assert reasons == ["non-causal attention not supported (metadata.causal is False)"]
