"""fp8 FNUZ caches (``float8_e4m3fnuz`` / ``float8_e5m2fnuz``, kvmulti/fp8.py) on every backend that
serves them (CPU, TRITON, HIP at wave 32 and 64 and its prefill kernel, SYCL): write bits equal a
reference quantiser for every code, its midpoints and the special values, with per-head scales; every
code reads back as torch decodes it; attention matches the oracle within the query dtype's tolerance,
both orders, per-tensor and per-head scales; a cache written by one backend reads the same in every
other. IPEX names FNUZ as a capability reason."""

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
SERVING = ["CPU", "TRITON", "HIP", "SYCL"]
REFUSING = ["IPEX"]
#: (backend, constructor options): HIP's FMA engine (wave 32), MFMA engine (wave 64) and prefill kernel
ENGINES = [("CPU", {}), ("TRITON", {}), ("HIP", dict(cpu_wave=32)), ("HIP", dict(cpu_wave=64)),
           ("HIP", dict(cpu_wave=64, prefill_min_query=1)), ("SYCL", {})]
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


@pytest.mark.parametrize("backend_name,options", ENGINES, ids=lambda x: x if isinstance(x, str) else
                         "-".join(f"{k}={v}" for k, v in x.items()) or "default")
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("dtype", FNUZ, ids=str)
def test_every_code_reads_as_torch_decodes_it(backend_name, options, query_dtype, dtype):
    """All 256 codes as the V of a request's only visible key (K all zero codes: uniform weights), in a
    prompt's first row and a one-token decode: the output is each code's value times v_scale exactly,
    NaN where the code is the format's NaN."""
    backend = type(backend_or_skip(backend_name))(**options)
    layout = kvmulti.KVCacheLayout(2, 16, 4, 64, dtype=dtype, order="NHD")
    cache = layout.allocate("cpu")
    cache.view(torch.uint8).zero_()
    codes = torch.arange(256, dtype=torch.uint8).view(4, 64)
    layout.values(cache)[0, 0].view(torch.uint8).copy_(codes)
    table = torch.tensor([[0], [0]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([4, 1], [4, 1], table, 16)
    query = torch.randn(5, 4, 64).to(query_dtype)
    out = kvmulti.paged_attention(query, cache, layout, md, backend=backend, k_scale=1.0, v_scale=0.5)
    want = (codes.view(dtype).float() * 0.5).to(query_dtype)
    for row in (0, 4):                      # the prompt's first token and the decode token
        got = out[row]
        assert torch.equal(got.isnan(), want.isnan()), (backend_name, options, row)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), (backend_name, options, row)


@pytest.mark.parametrize("backend_name", SERVING)
@pytest.mark.parametrize("dtype,order,scale_kind,query_dtype", [
    (torch.float8_e4m3fnuz, "NHD", "tensor", torch.bfloat16), (torch.float8_e4m3fnuz, "HND", "head", torch.float16),
    (torch.float8_e5m2fnuz, "HND", "tensor", torch.float32), (torch.float8_e5m2fnuz, "NHD", "head", torch.bfloat16)],
    ids=["e4m3fnuz-NHD-tensor", "e4m3fnuz-HND-head", "e5m2fnuz-HND-tensor", "e5m2fnuz-NHD-head"])
def test_attention_matches_the_oracle(backend_name, dtype, order, scale_kind, query_dtype):
    run_and_compare(backend_name, mixed(dtype, order), query_dtype, scale_kind)


@pytest.mark.parametrize("writer", SERVING)
@pytest.mark.parametrize("dtype", FNUZ, ids=str)
def test_a_cache_written_by_one_backend_reads_the_same_in_every_other(writer, dtype):
    for name in SERVING:
        backend_or_skip(name)
    spec = mixed(dtype, "HND", sliding_window=9, softcap=10.0)
    from test_fp8_kernels import fp8_case
    case = fp8_case(spec, torch.bfloat16)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend=writer,
                     k_scale=0.3, v_scale=0.2)
    outs = {name: kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=9,
                                          softcap=10.0, backend=name, k_scale=0.3, v_scale=0.2).float()
            for name in SERVING}
    want = reference.paged_attention(case.query, case.cache, case.layout, case.metadata, sliding_window=9,
                                     softcap=10.0, k_scale=0.3, v_scale=0.2).float()
    for name, out in outs.items():
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{writer} -> {name}: {m}")


@pytest.mark.parametrize("backend_name", REFUSING)
@pytest.mark.parametrize("dtype", FNUZ, ids=str)
def test_a_backend_without_fnuz_kernels_names_it(backend_name, dtype):
    config = AttentionConfig(platform="cpu", dtype=dtype, head_size=64, head_size_v=64, num_kv_heads=2,
                             block_size=16, order="NHD")
    reasons = " ".join(get_backend(backend_name).capability_reasons(config))
    assert f"fp8 FNUZ cache {dtype} not supported" in reasons
