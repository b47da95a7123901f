"""HIP backend behaviour on a CPU host: declared capabilities, reasons, dispatch, the emulator
warning, clear build errors, and caches written by HIP / CPU read identically by the other."""

from __future__ import annotations

import ctypes
import os
import warnings

import pytest
import torch

from batches import CaseSpec, assert_close_to_reference, build_case

import kvmulti
from kvmulti import reference
from kvmulti.backends import get_backend, hip
from kvmulti.backends.base import AttentionConfig
from kvmulti.backends.registry import select_backend

IN_CI = os.environ.get("CI", "").lower() == "true"


def _config(**kw):
    base = dict(platform="cpu", dtype=torch.float16, head_size=128, head_size_v=128, num_kv_heads=2, block_size=16,
                order="HND")
    base.update(kw)
    return AttentionConfig(**base)


@pytest.fixture(scope="module")
def harness():
    reasons = hip.build.cpu_harness_reasons()
    if reasons:
        if IN_CI:
            pytest.fail("HIP CPU harness cannot be built in CI: " + "; ".join(reasons))
        pytest.skip("HIP CPU harness cannot be built here: " + "; ".join(reasons))
    backend = get_backend("HIP")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        hip.library.load_cpu_library()
    return backend


def test_declared_capabilities():
    b = hip.HipBackend()
    assert b.head_sizes == (64, 80, 96, 128, 256) and b.min_block_size == 1
    assert set(b.dtypes) == {torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
                             torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
    for hs in b.head_sizes:
        for bs in (1, 3, 16, 32, 128):
            assert not b.capability_reasons(_config(head_size=hs, head_size_v=hs, block_size=bs))
    assert not b.capability_reasons(_config(sliding_window=True, softcap=True, order="NHD", dtype=torch.bfloat16))
    assert any("head_size 32" in r for r in b.capability_reasons(_config(head_size=32, head_size_v=32)))
    assert any("head_size_v 64" in r for r in b.capability_reasons(_config(head_size_v=64)))
    assert any("latent" in r for r in b.capability_reasons(_config(head_size_v=0, num_kv_heads=1)))
    assert any("dtype" in r for r in b.capability_reasons(_config(dtype=torch.float64)))


def test_platform_reasons_on_this_host(harness):
    b = hip.HipBackend()
    assert b.platform_reasons("cpu") == []          # the CPU harness is buildable here
    assert "not cuda" in " ".join(b.platform_reasons("cuda"))
    assert "not xpu" in " ".join(b.platform_reasons("xpu"))
    if not torch.version.hip:
        assert any("ROCm build" in r for r in b.platform_reasons("rocm"))
        assert b.unavailable_reasons() == []        # usable through the harness
        assert b.describe().startswith("CPU harness (emulator)")


def test_cpu_dispatch_never_picks_hip_unless_named(harness, monkeypatch):
    config = _config()
    monkeypatch.delenv("KVMULTI_ATTENTION_BACKEND", raising=False)
    assert select_backend(config) == "CPU"
    assert select_backend(config, requested="hip") == "HIP"
    monkeypatch.setenv("KVMULTI_ATTENTION_BACKEND", "HIP")
    assert select_backend(config) == "HIP"
    assert kvmulti.available_backends("cpu")["HIP"] == []


def test_emulator_warning_is_emitted_once(harness):
    b = hip.HipBackend()
    layout = kvmulti.KVCacheLayout(2, 4, 1, 64, dtype=torch.float32)
    cache = layout.allocate()
    k = torch.randn(3, 1, 64)
    slots = torch.tensor([0, 5, -1])
    with pytest.warns(RuntimeWarning, match="CPU harness \\(emulator\\)"):
        b.write_kv(k, k, cache, layout, slots)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b.write_kv(k, k, cache, layout, slots)


def test_missing_compiler_is_a_clear_reason_and_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMULTI_HIP_CPU_CXX", "kvmulti-no-such-gxx")
    monkeypatch.setenv("KVMULTI_CACHE_DIR", str(tmp_path))
    reasons = hip.build.cpu_harness_reasons()
    assert reasons and "g++" in reasons[0] and "kvmulti-no-such-gxx" in reasons[0]
    b = hip.HipBackend()
    assert b.platform_reasons("cpu") == reasons
    if not torch.version.hip:
        assert any(r.startswith("CPU harness:") for r in b.unavailable_reasons())
    with pytest.raises(hip.build.HipBuildError, match="g\\+\\+"):
        hip.build.build_cpu_library()


def test_missing_hipcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(hip.build, "hipcc", lambda: None)
    with pytest.raises(hip.build.HipBuildError, match="hipcc not found"):
        hip.build.build_rocm_library(["gfx90a"])


def test_rocm_arch_list_from_env(monkeypatch):
    monkeypatch.setenv("PYTORCH_ROCM_ARCH", "gfx90a;gfx942 gfx1100")
    assert hip.build.rocm_target_archs() == ["gfx90a", "gfx942", "gfx1100"]


def test_undeclared_head_size_fails_cleanly_in_the_launcher(harness):
    """Called directly (bypassing selection), an undeclared head size is an error, not a crash."""
    layout = kvmulti.KVCacheLayout(2, 16, 1, 32, dtype=torch.float32)
    cache = layout.allocate()
    md = kvmulti.CommonAttentionMetadata.from_lens([2], [2], torch.tensor([[0]], dtype=torch.int32), 16)
    out = torch.zeros(2, 1, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(RuntimeError, match="hipErrorInvalidValue"):
            step = harness.build_metadata(md, layout, 1, None)
            harness.paged_attention(torch.randn(2, 1, 32), cache, step, 1.0, None, out)


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_caches_cross_read_between_hip_and_cpu(harness, order, dtype):
    """A cache written by HIP equals the one written by CPU (bit for bit) and each backend's
    attention over the OTHER's cache equals the oracle."""
    spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=dtype,
                    query_lens=(6, 1, 3), context_lens=(0, 37, 12), extra_blocks=1, sliding_window=24, softcap=15.0)
    case = build_case(spec)
    # K/V as non-contiguous slices of a fused qkv projection, and padding slots (-1).
    t, h, d = case.key.shape
    qkv = torch.empty(t, 3 * h * d, dtype=dtype)
    qkv[:, h * d: 2 * h * d] = case.key.reshape(t, -1)
    qkv[:, 2 * h * d:] = case.value.reshape(t, -1)
    key, value = qkv[:, h * d: 2 * h * d].view(t, h, d), qkv[:, 2 * h * d:].view(t, h, d)
    assert not key.is_contiguous()
    slots = case.metadata.slot_mapping.clone()
    slots[2] = -1
    hip_cache, cpu_cache, ref_cache = case.cache.clone(), case.cache.clone(), case.cache.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        kvmulti.write_kv(key, value, hip_cache, case.layout, slots, backend="HIP")
    kvmulti.write_kv(key, value, cpu_cache, case.layout, slots, backend="CPU")
    reference.write_kv(key, value, ref_cache, case.layout, slots)
    assert torch.equal(hip_cache, cpu_cache) and torch.equal(hip_cache, ref_cache)
    assert hip_cache.stride() == case.cache.stride()
    # slot -1 was skipped: that token's slot keeps the original random data
    orig = case.metadata.slot_mapping[2].item()
    blk, off = divmod(orig, spec.block_size)
    assert torch.equal(hip_cache[blk, off], case.cache[blk, off])

    # Full writes (no padding), then attention crosswise.
    hip_cache, cpu_cache = case.cache.clone(), case.cache.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        kvmulti.write_kv(key, value, hip_cache, case.layout, case.metadata.slot_mapping, backend="HIP")
        kvmulti.write_kv(key, value, cpu_cache, case.layout, case.metadata.slot_mapping, backend="CPU")
        expected = reference.paged_attention(case.query, cpu_cache, case.layout, case.metadata,
                                             sliding_window=spec.sliding_window, softcap=spec.softcap)
        cpu_on_hip = kvmulti.paged_attention(case.query, hip_cache, case.layout, case.metadata,
                                             sliding_window=spec.sliding_window, softcap=spec.softcap, backend="CPU")
        hip_on_cpu = kvmulti.paged_attention(case.query, cpu_cache, case.layout, case.metadata,
                                             sliding_window=spec.sliding_window, softcap=spec.softcap, backend="HIP")
    assert_close_to_reference(cpu_on_hip, expected, dtype, "CPU attention over a HIP-written cache")
    assert_close_to_reference(hip_on_cpu, expected, dtype, "HIP attention over a CPU-written cache")


def test_strided_query_and_out_rows_past_num_actual_tokens(harness):
    """A non-contiguous query (slice of fused qkv) and padded rows past num_actual_tokens stay zero."""
    layout = kvmulti.KVCacheLayout(4, 16, 2, 64, dtype=torch.float16, order="NHD")
    cache = layout.allocate()
    cache.copy_(torch.randn(layout.shape).half())
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([3, 1], [20, 9], table, 16)
    fused = torch.randn(6, 3 * 4 * 64).half()           # 4 real tokens + 2 padding rows
    query = fused[:, : 4 * 64].view(6, 4, 64)
    assert not query.is_contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = kvmulti.paged_attention(query, cache, layout, md, backend="HIP")
    expected = reference.paged_attention(query, cache, layout, md)
    assert_close_to_reference(out[:4], expected[:4], torch.float16)
    assert torch.count_nonzero(out[4:]) == 0


def test_declared_head_sizes_match_the_compiled_instantiations(harness):
    lib = hip.library.load_cpu_library()
    sizes = (ctypes.c_int * 16)()
    count = lib.kvmulti_hip_head_sizes(sizes, 16)
    assert tuple(sizes[:count]) == hip.HEAD_SIZES == harness.head_sizes


def test_the_harness_build_has_one_unit_per_attention_pair():
    """launcher.hip's KVM_ATTENTION_PAIRS is indexed 0 .. n - 1, with n the units the CPU harness build
    compiles; every (query, cache) pair the C ABI dispatches is among them (a missing unit fails the link)."""
    import re
    text = (hip.build.source_dir() / "launcher.hip").read_text()
    pairs = text[text.index("#define KVM_ATTENTION_PAIRS(X)"):text.index("namespace kvmulti::launch")]
    found = re.findall(r"X\((\d+), (\w+), ([\w:]+)\)", pairs)
    assert [int(i) for i, _, _ in found] == list(range(hip.build.ATTENTION_UNITS))
    assert {(q, c) for _, q, c in found} == {(q, c) for q in ("float", "__half", "hip_bfloat16")
                                             for c in (q, "kvmulti::Fp8E4M3", "kvmulti::Fp8E5M2",
                                                       "kvmulti::Fp8E4M3Fnuz", "kvmulti::Fp8E5M2Fnuz")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_misaligned_cache_uses_the_scalar_path(harness, dtype):
    """A cache whose base is not 16-byte aligned (a view into a larger buffer) is read element-wise."""
    layout = kvmulti.KVCacheLayout(6, 16, 2, 64, dtype=dtype, order="HND")
    cache = layout.allocate(allocator=lambda n, dt, dev: torch.empty(n + 1, dtype=dt, device=dev)[1:])
    assert cache.data_ptr() % 16 != 0
    cache.copy_(torch.randn(layout.shape).to(dtype))
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([4, 1], [40, 33], table, 16)
    query = torch.randn(5, 4, 64).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = kvmulti.paged_attention(query, cache, layout, md, softcap=9.0, backend="HIP")
    expected = reference.paged_attention(query, cache, layout, md, softcap=9.0)
    assert_close_to_reference(out, expected, dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_misaligned_fp8_cache_on_the_mfma_engine(harness, cache_dtype):
    """An fp8 cache whose base is not 16-byte aligned, read by the MFMA engine (bf16 query, wave 64): K
    chunks and the V rows it stages in LDS are read byte-wise, the result still the oracle's."""
    layout = kvmulti.KVCacheLayout(6, 16, 2, 64, dtype=cache_dtype, order="NHD")
    cache = layout.allocate(allocator=lambda n, dt, dev: torch.empty(n + 3, dtype=dt, device=dev)[3:])
    assert cache.data_ptr() % 16 != 0
    cache.copy_(torch.randn(layout.shape).to(cache_dtype))
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([4, 1], [40, 33], table, 16)
    query = torch.randn(5, 8, 64).to(torch.bfloat16)
    scales = dict(k_scale=torch.tensor([0.4, 1.3]), v_scale=torch.tensor([2.0, 0.6]))
    lib = hip.library.load_cpu_library()
    lib.kvcpu_mfma_count.restype = ctypes.c_ulonglong
    lib.kvcpu_reset_mfma_count()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = kvmulti.paged_attention(query, cache, layout, md, softcap=9.0, backend=hip.HipBackend(cpu_wave=64),
                                      **scales)
    assert lib.kvcpu_mfma_count() > 0
    expected = reference.paged_attention(query, cache, layout, md, softcap=9.0, **scales)
    assert_close_to_reference(out, expected, torch.bfloat16)


def test_named_prebuilt_library_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMULTI_HIP_LIBRARY", str(tmp_path / "missing.so"))
    assert hip.build.prebuilt_rocm_library() == tmp_path / "missing.so"
    if torch.version.hip and torch.cuda.is_available():
        assert any("does not exist" in r for r in hip.HipBackend().platform_reasons("rocm"))


# ------------------------------------------------------------------------ memory safety
# The backend object is called directly (bypassing kvmulti.ops validation) with invalid metadata; the
# query, output and cache are views in the middle of guard buffers whose margins hold a sentinel (NaN
# for the inputs: a read past them would turn an output into NaN; a finite value for the output: a
# write past it shows). Wrong numbers are acceptable; touching anything outside the tensors is not.
GUARD = 4096


def _guarded(n: int, dtype: torch.dtype, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.full((GUARD + n + GUARD,), fill, dtype=dtype)
    return buf, buf[GUARD: GUARD + n]


def _margins_intact(buf: torch.Tensor, fill: float) -> bool:
    m = torch.cat([buf[:GUARD], buf[-GUARD:]]).float()
    return bool(torch.isnan(m).all()) if fill != fill else bool((m == fill).all())


def _bad_metadata(kind: str, num_tokens: int, num_blocks: int) -> kvmulti.CommonAttentionMetadata:
    i32 = dict(dtype=torch.int32)
    qsl, seq, table, reqs = [0, 2, num_tokens], [9, 40], [[0, 1, 2], [3, 1, 0]], 2
    if kind == "qsl_not_monotonic":
        qsl = [0, 5, 1]
    elif kind == "qsl_past_query_rows":
        qsl = [0, 3, num_tokens + 50]
    elif kind == "seq_len_huge":
        seq = [2 ** 31 - 1, 40]
    elif kind == "seq_len_negative":
        seq = [-1000, -1]
    elif kind == "table_too_narrow":
        table = [[0], [1]]
        seq = [9, 300]
    elif kind == "table_fewer_rows":
        table = [[0, 1, 2]]
    elif kind == "block_ids_out_of_range":
        table = [[-1, num_blocks, 2 ** 31 - 1], [-(2 ** 31), 1, num_blocks + 7]]
    elif kind == "num_reqs_too_large":
        reqs = 9
    elif kind == "tokens_past_query_rows":
        qsl = [0, 2, num_tokens + 8]
    elif kind == "window_garbage_entries":   # entries of blocks before a sliding window may be garbage
        table = [[2 ** 31 - 1, -5, 2], [-(2 ** 31), 2 ** 30, 1]]
    md = kvmulti.CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(seq, **i32),
        block_table=torch.tensor(table, **i32), slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        num_reqs=reqs, num_actual_tokens=num_tokens + (8 if kind == "tokens_past_query_rows" else 0),
        max_query_len=num_tokens, max_seq_len=max(max(seq), 1))
    return md


BAD_METADATA = ["qsl_not_monotonic", "qsl_past_query_rows", "seq_len_huge", "seq_len_negative", "table_too_narrow",
                "table_fewer_rows", "block_ids_out_of_range", "num_reqs_too_large", "tokens_past_query_rows",
                "window_garbage_entries"]


# kernel -> (head size, cache dtype or None: the query's); head 80 / 96: padded LDS rows, 256: 16-key tiles;
# fp8 caches: the cache holds codes (query and output keep the dtype): for an fp32 query the prefill kernel's
# fp32 path over widened codes, for 16-bit queries the 16-bit path (head 64: 128-key tiles)
GUARD_KERNELS = {"decode": (64, None), "prefill": (128, None), "prefill-head80": (80, None),
                 "prefill-head96": (96, None), "prefill-head256": (256, None),
                 "prefill-e4m3-head64": (64, torch.float8_e4m3fn), "prefill-e4m3-head96": (96, torch.float8_e4m3fn),
                 "prefill-e5m2-head96": (96, torch.float8_e5m2), "prefill-e5m2-head256": (256, torch.float8_e5m2)}


@pytest.mark.parametrize("kernel", GUARD_KERNELS)
@pytest.mark.parametrize("kind", BAD_METADATA)
@pytest.mark.parametrize("dtype,wave", [(torch.bfloat16, 64), (torch.float32, 64), (torch.float16, 32)])
def test_invalid_metadata_never_touches_memory_outside_the_tensors(harness, kind, dtype, wave, kernel):
    hs, cache_dtype = GUARD_KERNELS[kernel]
    cache_dtype = cache_dtype or dtype
    hq, hkv, bs, nb, t = 8, 2, 16, 4, 5
    layout = kvmulti.KVCacheLayout(nb, bs, hkv, hs, dtype=cache_dtype, order="HND" if wave == 64 else "NHD")
    cache_buf = None

    def allocator(n, dt, dev):
        nonlocal cache_buf
        cache_buf, flat = _guarded(n, dt, float("nan"))
        return flat

    cache = layout.allocate(allocator=allocator, zero=False)
    cache.copy_(torch.randn(layout.shape).to(cache_dtype))
    cache_before = cache.clone()
    fp8 = cache_dtype != dtype
    scales = dict(k_scale=torch.tensor([0.5, 1.5]), v_scale=torch.tensor([2.0, 0.25])) if fp8 else {}
    q_buf, q_flat = _guarded(t * hq * hs, dtype, float("nan"))
    q_flat.copy_(torch.randn(t * hq * hs).to(dtype))
    o_buf, o_flat = _guarded(t * hq * hs, dtype, 7.0)
    o_flat.zero_()
    query, out = q_flat.view(t, hq, hs), o_flat.view(t, hq, hs)
    md = _bad_metadata(kind, t, nb)
    saved = harness.cpu_wave, harness.partition_size, harness.prefill_min_query
    # the prefill kernel (64-row tiles, its own grid) when every step takes it
    harness.prefill_min_query = 1 if kernel.startswith("prefill") else -1
    try:
        for partition in (0, 16):
            harness.cpu_wave, harness.partition_size = wave, partition
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                window = 20 if kind == "window_garbage_entries" else None
                step = harness.build_metadata(md, layout, hq, window)
                harness.paged_attention(query, cache, step, 0.125, 5.0, out, **scales)
            assert _margins_intact(o_buf, 7.0), f"{kind}: wrote outside the output"
            assert _margins_intact(q_buf, float("nan")) and _margins_intact(cache_buf, float("nan"))
            assert torch.equal(cache.view(torch.uint8), cache_before.view(torch.uint8)), \
                f"{kind}: attention wrote into the cache"
            # A read past the query or the cache would have brought a NaN margin into some output.
            assert not torch.isnan(out.float()).any(), f"{kind}: an output saw memory outside the inputs"
    finally:
        harness.cpu_wave, harness.partition_size, harness.prefill_min_query = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_skips_slots_outside_the_cache(harness, dtype):
    hkv, hs, bs, nb = 2, 64, 16, 3
    layout = kvmulti.KVCacheLayout(nb, bs, hkv, hs, dtype=dtype, order="NHD")
    cache_buf = None

    def allocator(n, dt, dev):
        nonlocal cache_buf
        cache_buf, flat = _guarded(n, dt, -3.0)
        return flat

    cache = layout.allocate(allocator=allocator)
    slots = torch.tensor([0, nb * bs, -1, -7, 2 ** 40, nb * bs - 1, 17], dtype=torch.int64)
    key = torch.randn(len(slots), hkv, hs).to(dtype)
    value = torch.randn(len(slots), hkv, hs).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        harness.write_kv(key, value, cache, layout, slots)
        # a slot mapping shorter than the key rows: only its entries are read
        harness.write_kv(torch.cat([key, key]), torch.cat([value, value]), cache, layout, slots)
    assert _margins_intact(cache_buf, -3.0)
    expected = layout.allocate()
    valid = (slots >= 0) & (slots < nb * bs)
    reference.write_kv(key[valid], value[valid], expected, layout, slots[valid])
    assert torch.equal(cache, expected)
