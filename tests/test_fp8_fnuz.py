"""fp8 FNUZ caches (``float8_e4m3fnuz`` / ``float8_e5m2fnuz``, kvmulti/fp8.py) on the backends that
serve them (CPU, TRITON): write bits equal a reference quantiser for every code, its midpoints and
the special values, with per-head scales; attention matches the oracle within the query dtype's
tolerance, both orders, per-tensor and per-head scales. Backends without FNUZ kernels (HIP, SYCL,
IPEX) name it as a capability reason."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvmulti  # noqa: E402
from kvmulti import fp8, reference  # noqa: E402
from kvmulti.backends import AttentionConfig, get_backend  # noqa: E402

from fp8_codes import probe_values, reference_code  # noqa: E402
from test_fp8_kernels import backend_or_skip, mixed, run_and_compare  # noqa: E402

FNUZ = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
SERVING = ["CPU", "TRITON"]
REFUSING = ["HIP", "SYCL", "IPEX"]
HEADS = 2
SCALES = torch.tensor([0.5, 4.0])            # powers of two: value * scale / scale is exact


def _reference_codes(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    nan = 0x80
    return torch.tensor([nan if (c := reference_code(v, dtype)) is None else c for v in values.tolist()],
                        dtype=torch.uint8)


@pytest.mark.parametrize("dtype", FNUZ, ids=str)
def test_the_oracle_quantises_like_the_reference(dtype):
    values = probe_values(dtype)
    got = fp8.quantize(values[:, None, None], torch.ones(1), dtype).view(torch.uint8).reshape(-1)
    assert torch.equal(got, _reference_codes(values, dtype))
    assert fp8.max_finite(dtype) == {torch.float8_e4m3fnuz: 240.0, torch.float8_e5m2fnuz: 57344.0}[dtype]


@pytest.mark.parametrize("backend_name", SERVING)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", FNUZ, ids=str)
def test_write_bits_equal_the_reference_quantiser(backend_name, order, dtype):
    backend = backend_or_skip(backend_name)
    values = probe_values(dtype)
    head = 16
    tokens = -(-values.numel() // head)
    padded = torch.cat([values, torch.zeros(tokens * head - values.numel())])
    key = (padded.view(tokens, 1, head) * SCALES[:, None]).to(torch.float32)       # [T, H, D]: head h scaled
    value = -key.flip(0)
    layout = kvmulti.KVCacheLayout(-(-tokens // 16) + 1, 16, HEADS, head, dtype=dtype, order=order)
    cache = layout.allocate("cpu")
    slots = torch.arange(tokens) + 16
    kvmulti.write_kv(key, value, cache, layout, slots, backend=backend, k_scale=SCALES, v_scale=SCALES.clone())
    rows = lambda part: part.reshape(-1, HEADS, head)[16:16 + tokens].view(torch.uint8)  # noqa: E731
    want = _reference_codes(padded, dtype).view(tokens, 1, head).expand(tokens, HEADS, head)
    assert torch.equal(rows(layout.keys(cache)), want)
    assert torch.equal(rows(layout.values(cache)), _reference_codes(-padded, dtype).view(tokens, 1, head)
                       .expand(tokens, HEADS, head).flip(0))


def test_triton_decodes_every_code_as_torch_does():
    backend_or_skip("TRITON")
    from kvmulti.triton_kernels.fp8 import decode
    codes = torch.arange(256, dtype=torch.uint8)
    for dtype in FNUZ:
        got, want = decode(codes, dtype), codes.view(dtype).float()
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), dtype


@pytest.mark.parametrize("backend_name", SERVING)
@pytest.mark.parametrize("dtype,order,scale_kind,query_dtype", [
    (torch.float8_e4m3fnuz, "NHD", "tensor", torch.bfloat16), (torch.float8_e4m3fnuz, "HND", "head", torch.float16),
    (torch.float8_e5m2fnuz, "HND", "tensor", torch.float32), (torch.float8_e5m2fnuz, "NHD", "head", torch.bfloat16)],
    ids=["e4m3fnuz-NHD-tensor", "e4m3fnuz-HND-head", "e5m2fnuz-HND-tensor", "e5m2fnuz-NHD-head"])
def test_attention_matches_the_oracle(backend_name, dtype, order, scale_kind, query_dtype):
    run_and_compare(backend_name, mixed(dtype, order), query_dtype, scale_kind)


def test_a_cache_written_by_one_backend_reads_the_same_in_the_other():
    for name in SERVING:
        backend_or_skip(name)
    spec = mixed(torch.float8_e4m3fnuz, "HND", sliding_window=9, softcap=10.0)
    from test_fp8_kernels import fp8_case
    case = fp8_case(spec, torch.bfloat16)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="CPU",
                     k_scale=0.3, v_scale=0.2)
    outs = [kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=9,
                                    softcap=10.0, backend=name, k_scale=0.3, v_scale=0.2).float() for name in SERVING]
    want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=9,
                                     softcap=10.0, k_scale=0.3, v_scale=0.2).float()
    for out in outs:
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend_name", REFUSING)
@pytest.mark.parametrize("dtype", FNUZ, ids=str)
def test_backends_without_fnuz_kernels_name_it(backend_name, dtype):
    config = AttentionConfig(platform="cpu", dtype=dtype, head_size=64, head_size_v=64, num_kv_heads=2,
                             block_size=16, order="NHD")
    reasons = " ".join(get_backend(backend_name).capability_reasons(config))
    assert f"fp8 FNUZ cache {dtype} not supported" in reasons
