"""fp8 KV caches in the GPU kernel families (kvmulti/fp8.py's rule), against the oracle.

Per backend (Triton under TRITON_INTERPRET=1, HIP on the fiber harness, SYCL on the OpenCL CPU
device): writes are bit-identical to ``kvmulti.fp8.quantize`` (uint8 views compared), attention
over an fp8 cache matches the oracle within the query dtype's tolerance, for both formats,
per-tensor and per-head scales, both orders, GQA, windows, softcap, every path (prefill, chunked
prefill, decode, split-KV), and no kernel leaves its tensors (guard buffers) whatever the metadata.
Shapes are small: the kernels are interpreted or emulated here.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import kvmulti  # noqa: E402
from kvmulti import fp8, reference  # noqa: E402
from kvmulti.backends import get_backend  # noqa: E402

from batches import TOLERANCE, CaseSpec, build_case, registered_backends  # noqa: E402
from availability import unavailable  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HKV = 2
HS = 64                  # a head size every backend compiles (HIP: 64/80/96/128/256)
PER_HEAD = torch.tensor([0.05, 0.3])        # per-head scales (k); v uses PER_HEAD * 2


def backend_or_skip(name: str):
    """The backend object, skipped (with the backend's own reasons) where it cannot run here; in CI,
    where every backend is installed, that is a failure, not a skip."""
    backend = get_backend(name)
    reasons = backend.unavailable_reasons() + backend.platform_reasons("cpu")
    if reasons:
        unavailable(f"{name} cannot run on this host: {'; '.join(reasons)}")
    return backend


def scales(kind: str) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """(k_scale, v_scale) as the public ops take them: per-tensor floats or per-head tensors."""
    return (0.07, 0.11) if kind == "tensor" else (PER_HEAD.clone(), PER_HEAD * 2)


def fp8_case(spec: CaseSpec, query_dtype: torch.dtype, seed: int = 1):
    """build_case's batch with an fp8 cache (random fp8 context) and activations of ``query_dtype``."""
    case = build_case(spec)
    gen = torch.Generator().manual_seed(seed)
    for name in ("query", "key", "value"):
        shape = getattr(case, name).shape
        setattr(case, name, (torch.randn(shape, generator=gen) * 3).to(query_dtype))
    return case


def run_and_compare(backend_name: str, spec: CaseSpec, query_dtype: torch.dtype, scale_kind: str,
                    partition_size: int | None = None) -> None:
    """Write with the backend and the oracle (bytes must be equal), then attend with both."""
    backend = backend_or_skip(backend_name)
    if partition_size is not None:
        backend = type(backend)(partition_size=partition_size)
    case = fp8_case(spec, query_dtype)
    k_scale, v_scale = scales(scale_kind)
    ref_cache = case.cache.clone()
    slots = case.metadata.slot_mapping
    reference.write_kv(case.key, case.value, ref_cache, case.layout, slots, k_scale, v_scale)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, slots, backend=backend,
                     k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(case.cache.view(torch.uint8), ref_cache.view(torch.uint8)), f"write differs for {spec}"
    expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata,
                                         sliding_window=spec.sliding_window, softcap=spec.softcap,
                                         k_scale=k_scale, v_scale=v_scale)
    actual = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata,
                                     sliding_window=spec.sliding_window, softcap=spec.softcap, backend=backend,
                                     k_scale=k_scale, v_scale=v_scale)
    assert actual.dtype == query_dtype and actual.shape == expected.shape
    atol, rtol = TOLERANCE[query_dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{backend_name} fp8 attention differs for {spec}\n{m}")


def mixed(dtype: torch.dtype, order: str, **kw) -> CaseSpec:
    """A prefill, a chunked prefill and two decodes; GQA 2."""
    base = dict(order=order, block_size=16, num_kv_heads=HKV, group=2, head_size=HS, dtype=dtype,
                query_lens=(5, 3, 1, 1), context_lens=(0, 17, 30, 9), extra_blocks=1, seed=3)
    base.update(kw)
    return CaseSpec(**base)


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """[T, HKV, HS] fp32: saturation, ±inf, NaN, signed zeros, ties, subnormals, plus random."""
    top = fp8.max_finite(dtype)
    tiny = 2.0 ** (-9 if dtype == E4M3 else -16)          # the format's smallest subnormal
    row = torch.tensor([top * 3, -top * 3, float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 17.0, 19.0,
                        -18.0, tiny * 0.5, tiny * 1.5, -tiny * 2.5, tiny * 0.49, top, top * 1.0001,
                        1e-30, -1e-30, 3.0e-3, 0.1, 1 / 3, 2.0 ** -6, 2.0 ** -14, 7.9, 1e4, 6e4, -5e4, 240.0,
                        232.0, 248.0, 12.5, 13.5])
    gen = torch.Generator().manual_seed(5)
    row = torch.cat([row, -row.flip(0)])
    return torch.cat([row.expand(1, HKV, HS), torch.randn(7, HKV, HS, generator=gen) * 40])


#: every fp8 kernel family but the CPU backend (tests/test_cpu_fp8.py and test_fp8_backends.py check it)
BACKENDS = [name for name in registered_backends() if name != "CPU"]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("key_dtype", [F32, F16, BF16])
def test_write_is_bit_identical_to_the_rule(backend_name, dtype, key_dtype):
    backend = backend_or_skip(backend_name)
    layout = kvmulti.KVCacheLayout(num_blocks=2, block_size=8, num_kv_heads=HKV, head_size=HS, dtype=dtype,
                                   order="HND")
    cache = layout.allocate("cpu").zero_()
    key = special_values(dtype).to(key_dtype)
    value = -key.flip(0)
    slots = torch.arange(key.shape[0]) + 4
    k_scale, v_scale = torch.tensor([1.0, 0.37]), torch.tensor([3.0, 1e-3])
    kvmulti.write_kv(key, value, cache, layout, slots, backend=backend, k_scale=k_scale, v_scale=v_scale)
    flat = lambda t: t.reshape(-1, HKV, t.shape[-1])[4:4 + key.shape[0]]  # noqa: E731
    keys, values = flat(layout.keys(cache)), flat(layout.values(cache))
    assert torch.equal(keys.view(torch.uint8), fp8.quantize(key, k_scale, dtype).view(torch.uint8))
    assert torch.equal(values.view(torch.uint8), fp8.quantize(value, v_scale, dtype).view(torch.uint8))


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_kind", ["tensor", "head"])
def test_mixed_batch_matches_the_oracle(backend_name, order, dtype, scale_kind):
    query_dtype = {("NHD", "tensor"): BF16, ("NHD", "head"): F16, ("HND", "tensor"): F32,
                   ("HND", "head"): BF16}[order, scale_kind]
    run_and_compare(backend_name, mixed(dtype, order), query_dtype, scale_kind)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_window_softcap_and_value_head_size(backend_name, dtype):
    head_size_v = 32 if backend_name == "TRITON" else None      # HIP and SYCL need equal K/V head sizes
    spec = mixed(dtype, "HND", sliding_window=7, softcap=8.0, head_size_v=head_size_v, group=3, block_size=8)
    run_and_compare(backend_name, spec, F16, "head")


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_split_kv_decode(backend_name, dtype):
    spec = mixed(dtype, "NHD", query_lens=(1, 1), context_lens=(70, 33), group=4)
    run_and_compare(backend_name, spec, BF16, "head", partition_size=16)


@pytest.mark.parametrize("family", ["nvidia", "amd"])
@pytest.mark.parametrize("dtype,query_dtype", [(E4M3, BF16), (E5M2, F16), (E4M3, F32)], ids=["e4m3_bf16", "e5m2_fp16",
                                                                                           "e4m3_fp32"])
def test_triton_prefill_tiles(family, dtype, query_dtype, monkeypatch):
    """Triton's prefill tiles of each target family (launch.prefill_tiles) over an fp8 cache: several
    q-blocks and key tiles, a window, chunked and decode rows beside the prompt."""
    from kvmulti.backends.triton import launch
    monkeypatch.setattr(launch, "device_family", lambda device: family)
    spec = mixed(dtype, "HND", query_lens=(70, 1, 3), context_lens=(0, 90, 40), sliding_window=45, group=4)
    run_and_compare("TRITON", spec, query_dtype, "head")


# ------------------------------------------------------------------------------ memory safety
MARGIN = 2048
NAN_CODE = 0x7F            # NaN in both formats: a read of a margin turns an output non-finite


def guarded(shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype, fill: torch.Tensor):
    """(view, buffer): ``fill`` as a tensor of ``shape``/``strides`` at offset MARGIN of a buffer
    whose margins hold NaN (fp8: the NaN code)."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    if fp8.is_fp8(dtype):
        buf = torch.full((span + 2 * MARGIN,), NAN_CODE, dtype=torch.uint8).view(dtype)
    else:
        buf = torch.full((span + 2 * MARGIN,), float("nan"), dtype=dtype)
    view = torch.as_strided(buf, shape, strides, MARGIN)
    view.copy_(fill.to(dtype))
    return view, buf


def margins_untouched(buf: torch.Tensor) -> bool:
    margins = torch.cat([buf[:MARGIN], buf[-MARGIN:]])
    if fp8.is_fp8(buf.dtype):
        return bool((margins.view(torch.uint8) == NAN_CODE).all())
    return bool(torch.isnan(margins).all())


def guarded_fp8_cache(order: str, dtype: torch.dtype, num_blocks: int = 6, block_size: int = 16,
                      head_size: int = HS):
    layout = kvmulti.KVCacheLayout(num_blocks=num_blocks, block_size=block_size, num_kv_heads=HKV,
                                   head_size=head_size, dtype=dtype, order=order)
    data = torch.randn(layout.shape, generator=torch.Generator().manual_seed(0))
    cache, buf = guarded(layout.shape, tuple(layout.expected_strides()), dtype, data)
    return layout, cache, buf


def guarded_scales() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    k, kbuf = guarded((HKV,), (1,), F32, PER_HEAD)
    v, vbuf = guarded((HKV,), (1,), F32, PER_HEAD * 2)
    return k, v, [kbuf, vbuf]


def bad_metadata_cases():
    from test_triton_memory_safety import BAD_METADATA
    return BAD_METADATA


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("split", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("case", bad_metadata_cases(), ids=[c[0] for c in bad_metadata_cases()])
def test_attention_over_fp8_stays_inside_its_tensors(backend_name, case, order, split):
    from test_triton_memory_safety import metadata
    _, qsl, seq_lens, table, num_tokens = case
    backend = type(backend_or_skip(backend_name))(partition_size=16 if split else 0)
    layout, cache, cache_buf = guarded_fp8_cache(order, E4M3)
    before = cache_buf.view(torch.uint8).clone()
    rows, group = 6, 2
    q_shape = (rows, HKV * group, HS)
    query, query_buf = guarded(q_shape, torch.empty(q_shape).stride(), BF16, torch.randn(q_shape))
    out, out_buf = guarded(q_shape, torch.empty(q_shape).stride(), BF16, torch.zeros(q_shape))
    k_scale, v_scale, scale_bufs = guarded_scales()
    step = backend.build_metadata(metadata(qsl, seq_lens, table, num_tokens), layout, HKV * group, None)
    backend.paged_attention(query, cache, step, HS ** -0.5, None, out, k_scale=k_scale, v_scale=v_scale)
    assert margins_untouched(out_buf), "write outside the output"
    assert torch.equal(cache_buf.view(torch.uint8), before), "attention changed the cache"
    assert margins_untouched(query_buf) and all(margins_untouched(b) for b in scale_bufs)
    if not split:   # the split path's unwritten workspace rows may reduce to anything: wrong numbers allowed
        assert torch.isfinite(out.float()).all(), "a NaN margin (outside query/cache/scales) was read"


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_write_skips_slots_outside_the_cache(backend_name, order, dtype):
    backend = backend_or_skip(backend_name)
    layout, cache, cache_buf = guarded_fp8_cache(order, dtype)
    before = cache.view(torch.uint8).clone()
    num_slots = layout.num_blocks * layout.block_size
    # token 1 -> slot 3 and token 4 -> the last slot are valid; token 7 is past key/value's 6 rows.
    slots = torch.tensor([-1, 3, num_slots, -5, num_slots - 1, 2 ** 40, num_slots + 17, 9])
    shape = (6, HKV, HS)
    key, key_buf = guarded(shape, torch.empty(shape).stride(), F16, torch.randn(shape))
    value, value_buf = guarded(shape, torch.empty(shape).stride(), F16, torch.randn(shape))
    k_scale, v_scale, scale_bufs = guarded_scales()
    backend.write_kv(key, value, cache, layout, slots, k_scale=k_scale, v_scale=v_scale)
    assert margins_untouched(cache_buf), "write outside the cache"
    assert all(margins_untouched(b) for b in [key_buf, value_buf, *scale_bufs])
    changed = (cache.view(torch.uint8) != before).any(dim=-1).any(dim=-1).nonzero().tolist()
    assert changed == [[0, 3], [5, layout.block_size - 1]], changed
    for (blk, off), tok in (((0, 3), 1), ((5, layout.block_size - 1), 4)):
        assert torch.equal(layout.keys(cache)[blk, off].view(torch.uint8),
                           fp8.quantize(key[tok:tok + 1], k_scale, dtype)[0].view(torch.uint8))
        assert torch.equal(layout.values(cache)[blk, off].view(torch.uint8),
                           fp8.quantize(value[tok:tok + 1], v_scale, dtype)[0].view(torch.uint8))
