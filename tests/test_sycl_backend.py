"""The SYCL backend (run-time compiled SYCL kernels) against the oracle, on whatever SYCL device this
host has: Intel's OpenCL CPU device in CPU CI (intel-sycl-rt + intel-opencl-rt from PyPI)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from tiers import examples

import kvmulti
from batches import CaseSpec, assert_close_to_reference, batch_cases, build_case, check_against_reference
from kvmulti import reference
from kvmulti.backends import AttentionConfig, available_backends, get_backend, select_backend
from kvmulti.backends import sycl as S

_REASONS = S.runtime.runtime_reasons()
# In CI the runtime is installed by the test command: a missing one must fail there, never skip.
pytestmark = pytest.mark.skipif(bool(_REASONS) and os.environ.get("CI") != "true",
                                reason=f"SYCL runtime unusable here: {'; '.join(_REASONS)}")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def sycl_backend():
    return get_backend("SYCL")


# ------------------------------------------------------------------------------------ oracle
@settings(max_examples=examples(30))
@given(batch_cases(head_sizes=(64, 80), block_sizes=(1, 16, 32), groups=(1, 4, 8)))
def test_sycl_matches_reference(spec):
    check_against_reference(spec, "SYCL")


# Every dtype x order x head size at least once, cycling block size / GQA / window / softcap, so the
# feature grid is covered whatever hypothesis draws.
_GRID = [(dt, order, hs) for dt in (torch.float32, torch.float16, torch.bfloat16) for order in ("NHD", "HND")
         for hs in (64, 80)]


@pytest.mark.parametrize("i", range(len(_GRID)))
def test_feature_grid(i):
    dtype, order, head_size = _GRID[i]
    spec = CaseSpec(order=order, block_size=(1, 16, 32)[i % 3], num_kv_heads=(2, 1)[i % 2], group=(1, 4, 8)[i % 3],
                    head_size=head_size, dtype=dtype, query_lens=(9, 1, 4, 1), context_lens=(0, 45, 20, 70),
                    extra_blocks=i % 3, sliding_window=(None, 7, 30)[i % 3], softcap=(None, 12.5)[i % 2], seed=i)
    check_against_reference(spec, "SYCL")


@pytest.mark.parametrize("block_size,query_lens,context_lens", [(32, (5,), (20,)), (16, (3, 1), (0, 9)),
                                                                (16, (1,), (31,))])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_tiny_caches(order, block_size, query_lens, context_lens):
    spec = CaseSpec(order=order, block_size=block_size, num_kv_heads=2, group=4, head_size=64, dtype=torch.float32,
                    query_lens=query_lens, context_lens=context_lens)
    case = build_case(spec)
    assert case.layout.num_blocks <= 2          # num_blocks == 2 (and 1): no shape guessing anywhere
    check_against_reference(spec, "SYCL")


def test_long_prefill_many_tiles_and_chunks():
    # query_len * group >> ROWS (several tiles per request), contexts >> KC (many key chunks)
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=2, head_size=64, dtype=torch.float16,
                    query_lens=(37, 1, 20), context_lens=(0, 150, 90), sliding_window=None, softcap=None)
    check_against_reference(spec, "SYCL")
    check_against_reference(CaseSpec(**{**spec.__dict__, "sliding_window": 33}), "SYCL")


@pytest.mark.parametrize("group,num_kv_heads", [(3, 2), (32, 1), (24, 1)])
def test_gqa_groups_larger_than_a_tile(group, num_kv_heads):
    # a tile holds ROWS (token, head) rows: groups > ROWS split one token's heads over tiles
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=num_kv_heads, group=group, head_size=64,
                    dtype=torch.float32, query_lens=(3, 1, 6), context_lens=(0, 25, 11), sliding_window=9,
                    softcap=20.0)
    check_against_reference(spec, "SYCL")


def test_head_size_v_differs():
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=64, head_size_v=32,
                    dtype=torch.bfloat16, query_lens=(4, 1), context_lens=(10, 40), sliding_window=17)
    check_against_reference(spec, "SYCL")


@pytest.mark.parametrize("partition", [0, 16])
def test_padded_tokens_are_skipped_and_zero(monkeypatch, sycl_backend, partition):
    monkeypatch.setattr(sycl_backend, "partition_size", partition)     # 16: split-KV + reduce
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=torch.float32,
                    query_lens=(5, 1), context_lens=(0, 30))
    case = build_case(spec)
    md, pad = case.metadata, 3
    key = torch.cat([case.key, torch.randn(pad, *case.key.shape[1:])])
    value = torch.cat([case.value, torch.randn(pad, *case.value.shape[1:])])
    query = torch.cat([case.query, torch.randn(pad, *case.query.shape[1:])])
    slots = torch.cat([md.slot_mapping, torch.full((pad,), -1, dtype=torch.int64)])
    expected_cache = case.cache.clone()
    reference.write_kv(case.key, case.value, expected_cache, case.layout, md.slot_mapping)
    kvmulti.write_kv(key, value, case.cache, case.layout, slots, backend="SYCL")
    assert torch.equal(case.cache, expected_cache)
    out = kvmulti.paged_attention(query, case.cache, case.layout, md, backend="SYCL")
    assert out.shape[0] == md.num_actual_tokens + pad
    assert torch.count_nonzero(out[md.num_actual_tokens:]) == 0
    assert_close_to_reference(out[: md.num_actual_tokens], reference.paged_attention(case.query, case.cache,
                              case.layout, md)[: md.num_actual_tokens], spec.dtype)


def test_strided_key_value_and_query_views():
    # key/value/query as slices of one fused qkv tensor (non-contiguous rows)
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=64, dtype=torch.float16,
                    query_lens=(6, 1), context_lens=(0, 19))
    case = build_case(spec)
    t, hq, hkv = case.query.shape[0], case.query.shape[1], 2
    fused = torch.randn(t, hq + 2 * hkv, 64).to(torch.float16)
    q, k, v = fused[:, :hq], fused[:, hq:hq + hkv], fused[:, hq + hkv:]
    expected_cache = case.cache.clone()
    reference.write_kv(k, v, expected_cache, case.layout, case.metadata.slot_mapping)
    kvmulti.write_kv(k, v, case.cache, case.layout, case.metadata.slot_mapping, backend="SYCL")
    assert torch.equal(case.cache, expected_cache)
    out = kvmulti.paged_attention(q, case.cache, case.layout, case.metadata, backend="SYCL")
    assert_close_to_reference(out, reference.paged_attention(q, case.cache, case.layout, case.metadata), spec.dtype)


# ------------------------------------------------------------------------------------ split-KV
SPLIT_ARG = 19      # the attention kernels' part_acc argument (null: unsplit)


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernels launched while the test runs."""
    seen: list[str] = []
    orig = S.runtime.Session.launch

    def record(self, bundle, kernel, global_size, local_size, args, *rest, **kwargs):
        attention = (S.runtime.K_ATTN, S.runtime.K_ATTN_TERMS, S.runtime.K_PREFILL, S.runtime.K_PREFILL_TERMS)
        split = kernel in attention and args[SPLIT_ARG][1] != 0   # partials: split
        seen.append(S.runtime.KERNEL_NAMES[kernel] + ("[split]" if split else ""))
        return orig(self, bundle, kernel, global_size, local_size, args, *rest, **kwargs)

    monkeypatch.setattr(S.runtime.Session, "launch", record)
    return seen


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.bfloat16, 40), (torch.float16, None)])
def test_split_kv_forced_matches_reference(monkeypatch, sycl_backend, launches, dtype, window):
    monkeypatch.setattr(sycl_backend, "partition_size", 16)
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=dtype,
                    query_lens=(1, 1, 4, 9), context_lens=(150, 7, 60, 0), sliding_window=window, softcap=15.0)
    check_against_reference(spec, "SYCL")
    assert "kvm_paged_attention[split]" in launches and "kvm_split_reduce" in launches
    assert "kvm_paged_attention" not in launches


def test_split_kv_auto_heuristic(monkeypatch, sycl_backend, launches):
    """Long decode contexts with few work-groups take the split path by default; short ones don't."""
    monkeypatch.setattr(sycl_backend, "partition_size", -1)
    monkeypatch.setattr(S.backend, "SPLIT_MIN_SPAN", 64)
    monkeypatch.setattr(kvmulti.settings, "DEFAULT_PARTITION_SIZE", 32)
    spec = CaseSpec(order="NHD", block_size=32, num_kv_heads=1, group=8, head_size=64, dtype=torch.float32,
                    query_lens=(1,), context_lens=(200,))
    check_against_reference(spec, "SYCL")
    assert "kvm_paged_attention[split]" in launches
    launches.clear()
    check_against_reference(CaseSpec(**{**spec.__dict__, "context_lens": (20,)}), "SYCL")
    assert launches == ["kvm_write_kv", "kvm_paged_attention"]


def test_split_and_unsplit_agree(monkeypatch, sycl_backend):
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=80, dtype=torch.float32,
                    query_lens=(1, 2, 1), context_lens=(300, 99, 64), sliding_window=120)
    case = build_case(spec)
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="SYCL")
    outs = []
    for part in (0, 32, 100):
        monkeypatch.setattr(sycl_backend, "partition_size", part)
        outs.append(kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata,
                                            sliding_window=120, backend="SYCL"))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ caches across backends
@pytest.fixture
def usm_mallocs(monkeypatch):
    """Sizes of the USM allocations made while the test runs."""
    sizes: list[int] = []
    orig = S.runtime.Session.malloc_shared
    monkeypatch.setattr(S.runtime.Session, "malloc_shared", lambda self, n: (sizes.append(n), orig(self, n))[1])
    return sizes


@pytest.mark.filterwarnings("ignore:SYCL backend. the KV cache is a plain CPU tensor")
@pytest.mark.parametrize("mode", ["host-memory", "staged", "usm-cache"])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_cache_written_by_sycl_reads_the_same_via_cpu_and_back(monkeypatch, sycl_backend, usm_mallocs, order, mode):
    """host-memory: plain torch CPU tensors used in place (device with usm_system_allocations);
    staged: plain CPU tensors copied through USM; usm-cache: a USM cache used in place while the
    other arguments are staged."""
    monkeypatch.setattr(sycl_backend, "stage_cpu_tensors", None if mode == "host-memory" else True)
    monkeypatch.setattr(sycl_backend, "_warned_staging", False)
    spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=torch.bfloat16,
                    query_lens=(7, 1, 3), context_lens=(0, 33, 12), sliding_window=25, softcap=8.0)
    case = build_case(spec)
    layout, md = case.layout, case.metadata
    usm = mode == "usm-cache"
    sycl_cache = layout.allocate("cpu", allocator=S.usm_allocator) if usm else layout.allocate("cpu")
    cpu_cache = layout.allocate("cpu")
    sycl_cache.copy_(case.cache)
    cpu_cache.copy_(case.cache)
    if usm:
        assert S.runtime.default_session().pointer_type(sycl_cache.data_ptr()) == S.runtime.USM_SHARED
    ptr, cache_bytes = sycl_cache.data_ptr(), sycl_cache.numel() * sycl_cache.element_size()
    usm_mallocs.clear()
    if mode == "staged":
        with pytest.warns(UserWarning, match="copies it through USM"):
            kvmulti.write_kv(case.key, case.value, sycl_cache, layout, md.slot_mapping, backend="SYCL")
    else:
        kvmulti.write_kv(case.key, case.value, sycl_cache, layout, md.slot_mapping, backend="SYCL")
    write_mallocs = list(usm_mallocs)
    kvmulti.write_kv(case.key, case.value, cpu_cache, layout, md.slot_mapping, backend="CPU")
    assert sycl_cache.data_ptr() == ptr and sycl_cache.stride() == cpu_cache.stride()
    assert torch.equal(sycl_cache, cpu_cache)
    kw = dict(sliding_window=25, softcap=8.0)
    # SYCL-written cache read by CPU == CPU-written cache read by SYCL == CPU on CPU
    cpu_reads_sycl = kvmulti.paged_attention(case.query, sycl_cache, layout, md, backend="CPU", **kw)
    sycl_reads_cpu = kvmulti.paged_attention(case.query, cpu_cache, layout, md, backend="SYCL", **kw)
    usm_mallocs.clear()
    sycl_reads_sycl = kvmulti.paged_attention(case.query, sycl_cache, layout, md, backend="SYCL", **kw)
    mallocs = write_mallocs + usm_mallocs           # the SYCL calls on sycl_cache
    cpu_reads_cpu = kvmulti.paged_attention(case.query, cpu_cache, layout, md, backend="CPU", **kw)
    assert torch.equal(cpu_reads_sycl, cpu_reads_cpu)
    assert_close_to_reference(sycl_reads_cpu, cpu_reads_cpu, spec.dtype)
    assert torch.equal(sycl_reads_cpu, sycl_reads_sycl)
    if mode == "staged":
        assert any(n >= cache_bytes for n in mallocs)          # the cache went through USM
    elif mode == "usm-cache":
        assert mallocs and all(n < cache_bytes for n in mallocs)   # ... but a USM cache never does
    elif S.runtime.default_session().device.usm_system:
        assert mallocs == []                                   # nothing staged at all


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_staged_path_matches_reference(monkeypatch, sycl_backend, dtype):
    monkeypatch.setattr(sycl_backend, "stage_cpu_tensors", True)
    spec = CaseSpec(order="NHD", block_size=32, num_kv_heads=2, group=4, head_size=80, dtype=dtype,
                    query_lens=(6, 1, 2), context_lens=(0, 70, 15), sliding_window=21, softcap=9.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_against_reference(spec, "SYCL")


def test_usm_allocator_is_zero_copy_and_freed(monkeypatch):
    freed = []
    orig = S.runtime.Session.free
    monkeypatch.setattr(S.runtime.Session, "free", lambda self, p: (freed.append(p), orig(self, p))[1])
    layout = kvmulti.KVCacheLayout(num_blocks=3, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16,
                                   order="HND")
    cache = layout.allocate("cpu", allocator=S.usm_allocator)
    layout.validate(cache)
    base = cache.data_ptr()
    assert S.runtime.default_session().pointer_type(base) == S.runtime.USM_SHARED
    assert S.runtime.default_session().pointer_type(layout.values(cache).data_ptr()) == S.runtime.USM_SHARED
    assert torch.count_nonzero(cache) == 0
    keys = layout.keys(cache)
    del cache
    gc.collect()
    assert freed == []                      # the view keeps the USM block alive
    keys.fill_(1.5)
    assert float(keys.float().sum()) == 1.5 * keys.numel()
    del keys
    gc.collect()
    assert freed == [base]


# ------------------------------------------------------------------------------------ compiler errors
def test_broken_kernel_source_raises_with_compiler_log():
    session = S.default_session()
    broken = S.kernel_source().replace("const int64_t kpos = k0 + my_key;",
                                       "const int64_t kpos = k0 + kvm_no_such_identifier;")
    assert broken != S.kernel_source()
    opts = S.kernel_options(torch.float32, 64, 64)
    with pytest.raises(S.SyclBuildError) as info:
        session.build(broken, opts)
    message = str(info.value)
    assert "kvm_no_such_identifier" in message and "error" in message
    assert "undeclared identifier" in info.value.log


def test_missing_build_option_is_a_compile_error():
    with pytest.raises(S.runtime.SyclBuildError, match="KVM_DTYPE must be defined"):
        S.runtime.default_session().build(S.runtime.kernel_source(), ["-DKVM_HEAD_SIZE=64"])


# ------------------------------------------------------------------------------------ dispatch / environment
def test_dispatch_on_cpu_host(monkeypatch):
    backend = get_backend("SYCL")
    assert backend.unavailable_reasons() == []
    assert backend.platform_reasons("cpu") == []
    xpu_ok = hasattr(torch.xpu.Stream, "sycl_queue")      # False on a CPU build of torch
    assert (backend.platform_reasons("xpu") == []) == xpu_ok
    assert backend.platform_reasons("cuda")
    assert available_backends("cpu")["SYCL"] == []
    layout = kvmulti.KVCacheLayout(4, 16, 2, 64, dtype=torch.float16)
    config = AttentionConfig.from_layout(layout, "cpu")
    monkeypatch.delenv("KVMULTI_ATTENTION_BACKEND", raising=False)
    assert select_backend(config) == "CPU"           # never picked on a CPU host unless named
    assert select_backend(config, requested="sycl") == "SYCL"
    monkeypatch.setenv("KVMULTI_ATTENTION_BACKEND", "SYCL")
    assert select_backend(config) == "SYCL"
    assert "opencl:cpu" in backend.describe() or "gpu" in backend.describe()


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=240)


def test_runtime_sets_ocl_icd_itself_and_no_device_selector():
    env = {k: v for k, v in os.environ.items() if k not in ("OCL_ICD_FILENAMES", "ONEAPI_DEVICE_SELECTOR")}
    code = ("import os, kvmulti.backends.sycl as s; r = s.runtime_reasons(); "
            "print(repr(r)); print(os.environ.get('OCL_ICD_FILENAMES')); "
            "print('ONEAPI_DEVICE_SELECTOR' in os.environ); print(len(s.list_devices()))")
    res = _run(code, env)
    assert res.returncode == 0, res.stderr
    reasons, icd, selector, ndev = res.stdout.strip().splitlines()[-4:]
    assert reasons == "[]"
    root = S.runtime.find_runtime()[0]
    if (root / "lib" / "libintelocl.so").exists():
        assert icd == str(root / "lib" / "libintelocl.so")
    assert selector == "False" and int(ndev) >= 1


def test_import_without_runtime_reports_reasons():
    # KVMULTI_CPU_NATIVE=0: the changed sys.prefix is part of the CPU kernel's build key, and listing
    # backends constructs the CPU backend, which would build a kernel of its own first
    env = {k: v for k, v in os.environ.items() if k not in ("KVMULTI_SYCL_ROOT", "CMPLR_ROOT")}
    env["KVMULTI_CPU_NATIVE"] = "0"
    code = ("import sys; sys.prefix = '/nonexistent-prefix'\n"
            "import kvmulti, kvmulti.backends.sycl as s\n"
            "from kvmulti.backends import available_backends\n"
            "print(available_backends('cpu')['SYCL']); print(s.SyclBackend().describe())")
    res = _run(code, env)
    assert res.returncode == 0, res.stderr
    assert "SYCL runtime not found" in res.stdout and "kvmulti[sycl]" in res.stdout


# ------------------------------------------------------------------------------------ memory safety
# The backend object is called directly (no validation in kvmulti/ops.py) with invalid metadata;
# query / out / cache are views in the middle of guard buffers whose margins hold a sentinel.
SENTINEL = 1234.5
MARGIN = 64                       # elements on each side (keeps the views 16-byte aligned)
SAFE_LAYOUT = dict(num_blocks=4, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)


def _guarded(shape: tuple[int, ...], strides: tuple[int, ...], dtype: torch.dtype, fill=None):
    """(guard buffer, view of ``shape``/``strides`` at offset MARGIN): margins hold SENTINEL."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    buf = torch.full((span + 2 * MARGIN,), SENTINEL, dtype=dtype)
    view = buf.as_strided(shape, strides, MARGIN)
    view.copy_(torch.randn(shape).to(dtype) if fill is None else fill)
    return buf, view


def _assert_margins(buf: torch.Tensor, span: int, what: str):
    for margin in (buf[:MARGIN], buf[MARGIN + span:]):
        assert torch.all(margin == SENTINEL), f"{what}: a guard margin was written"


def _span(t: torch.Tensor) -> int:
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _metadata(qsl, seq, table, tokens: int):
    qsl, seq = torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq, dtype=torch.int32)
    return kvmulti.CommonAttentionMetadata(qsl, seq, torch.tensor(table, dtype=torch.int32),
                                           torch.full((tokens,), -1, dtype=torch.int64), len(seq), tokens,
                                           max(1, tokens), int(seq.abs().max()), True)


BIG = 2**31 - 1
_BAD_METADATA = {
    # qsl decreasing, and past the 6 query rows; block table fine
    "qsl_not_monotonic_and_past_rows": ([0, 4, 2, 9], [20, 30, 40], [[0, 1], [2, 3], [1, 0]]),
    "seq_lens_huge_and_negative": ([0, 1, 3, 6], [BIG, -50, BIG - 3], [[0, 1], [2, 3], [1, 0]]),
    # one column for 40 keys, and two table rows for three requests
    "table_narrow_and_short": ([0, 1, 2, 6], [40, 33, 60], [[3], [1]]),
    "block_ids_out_of_range": ([0, 2, 3, 6], [30, 20, 35], [[-1, 4, 0], [BIG, -BIG - 1, 1], [4, 2, 7]]),
}


@pytest.mark.parametrize("partition", [0, 16])
@pytest.mark.parametrize("case", sorted(_BAD_METADATA))
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_invalid_metadata_never_touches_memory_outside_the_tensors(monkeypatch, sycl_backend, order, case,
                                                                  partition):
    monkeypatch.setattr(sycl_backend, "partition_size", partition)
    layout = kvmulti.KVCacheLayout(**SAFE_LAYOUT, order=order)
    ref = layout.allocate("cpu")
    cache_buf, cache = _guarded(tuple(ref.shape), tuple(ref.stride()), layout.dtype)
    cache_before = cache.clone()
    tokens, hq = 6, 2 * 4
    q_buf, query = _guarded((tokens, hq, 64), (hq * 64, 64, 1), layout.dtype)
    o_buf, out = _guarded((tokens, hq, 64), (hq * 64, 64, 1), layout.dtype, fill=0.0)
    query_before = query.clone()
    qsl, seq, table = _BAD_METADATA[case]
    md = _metadata(qsl, seq, table, tokens)
    window = 24 if partition else None
    sycl_backend.paged_attention(query, cache, sycl_backend.build_metadata(md, layout, hq, window), 0.125, None, out)
    _assert_margins(cache_buf, _span(cache), "cache")
    _assert_margins(q_buf, _span(query), "query")
    _assert_margins(o_buf, _span(out), "out")
    assert torch.equal(cache, cache_before) and torch.equal(query, query_before)


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_write_kv_skips_out_of_range_slots(sycl_backend, order):
    layout = kvmulti.KVCacheLayout(**SAFE_LAYOUT, order=order)
    ref = layout.allocate("cpu")
    cache_buf, cache = _guarded(tuple(ref.shape), tuple(ref.stride()), layout.dtype)
    expected = cache.clone()
    n_slots = layout.num_blocks * layout.block_size
    slots = torch.tensor([n_slots, 2**62, -7, 5, n_slots - 1, -1, 2**40], dtype=torch.int64)
    key = torch.randn(len(slots), 2, 64)
    value = torch.randn(len(slots), 2, 64)
    valid = (slots >= 0) & (slots < n_slots)
    reference.write_kv(key[valid], value[valid], expected, layout, slots[valid])
    sycl_backend.write_kv(key, value, cache, layout, slots)
    _assert_margins(cache_buf, _span(cache), "cache")
    assert torch.equal(cache, expected)
    # a slot_mapping shorter than key/value: only its rows are read
    sycl_backend.write_kv(key, value, cache, layout, slots[:3])
    _assert_margins(cache_buf, _span(cache), "cache")
    assert torch.equal(cache, expected)


def test_misaligned_cache_view_is_refused(sycl_backend):
    layout = kvmulti.KVCacheLayout(**SAFE_LAYOUT)
    ref = layout.allocate("cpu")
    buf = torch.zeros(ref.numel() + 1, dtype=layout.dtype)
    cache = buf.as_strided(tuple(ref.shape), tuple(ref.stride()), 1)     # 4 bytes past 16-byte alignment
    md = _metadata([0, 1], [5], [[0]], 1)
    out = torch.zeros(1, 8, 64)
    with pytest.raises(S.SyclError, match="not aligned"):
        sycl_backend.paged_attention(torch.randn(1, 8, 64), cache, sycl_backend.build_metadata(md, layout, 8, None),
                                     0.125, None, out)


# ------------------------------------------------------------------------------------ XMX probe
def test_joint_matrix_probe_records_what_the_device_does():
    """A joint_matrix kernel from the kernel_compiler: on Intel's OpenCL CPU device (no
    aspect::ext_intel_matrix) build() succeeds but the bundle holds no such kernel, which is the
    documented reason kernels.cpp has no XMX path (sycl/README.md). A device that does keep the
    kernel must run it and get the right product."""
    session = S.default_session()
    source = open(os.path.join(REPO, "devtools", "sycl_probes", "joint_matrix_probe.cpp")).read()
    name = "kvm_joint_matrix_probe"
    try:
        handle = session.build(source, [], names=(name,))
    except S.SyclBuildError as e:
        assert session.device.type == "cpu", f"joint_matrix probe failed on {session.device.line()}: {e}"
        assert f"kernel '{name}' not found in the bundle" in str(e)
        return
    a, b, c = S.usm_empty(128, torch.float16), S.usm_empty(256, torch.float16), S.usm_empty(128, torch.float32)
    a.copy_(torch.randn(128).half())
    b.copy_(torch.randn(256).half())
    c.zero_()
    session.launch(handle, 0, 16, 16, [(S.runtime.ARG_PTR, a.data_ptr()), (S.runtime.ARG_PTR, b.data_ptr()),
                                       (S.runtime.ARG_PTR, c.data_ptr())], wait=True)
    torch.testing.assert_close(c.view(8, 16), a.float().view(8, 16) @ b.float().view(16, 16), atol=1e-2, rtol=1e-2)


def test_slm_traffic_and_barriers_at_least_4x_lower():
    """devtools/sycl_traffic_model.py (the loop-structure count quoted in sycl/README.md): even a work-group
    that sees a single 32-key chunk moves >= 4x fewer SLM bytes per KV byte and syncs >= 4x less."""
    from devtools import sycl_traffic_model as T
    for span in (32, 512, 4096):
        m = T.summary(rows=4, d=128, dv=128, elem=2, span=span)
        assert m["slm_per_kv_byte_before"] >= 4 * m["slm_per_kv_byte_after"]
        assert m["barriers_per_32_keys_before"] >= 4 * m["barriers_per_32_keys_after"]
    assert T.after_slm_bytes_per_pass(4, 128, S.WG, S.SG) == 82176


def test_a_bundle_compiles_under_a_lock_other_processes_wait_on(monkeypatch, sycl_backend, tmp_path):
    """Session.build holds a file lock per (device, source, options, kernels) while it compiles, so a
    second process building the same bundle waits, then loads it from SYCL's persistent cache."""
    import fcntl
    monkeypatch.setenv("KVMULTI_CACHE_DIR", str(tmp_path))
    session = S.runtime.default_session()
    held = []

    def compile_checking_the_lock(key, source, options, names):
        (lock_dir,) = (tmp_path / "sycl" / "bundle-locks").iterdir()
        with open(lock_dir / ".lock", "w") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(lock_dir.name)
            else:
                fcntl.flock(other, fcntl.LOCK_UN)
        return 12345

    monkeypatch.setattr(session, "_compile", compile_checking_the_lock)
    source = "// a bundle no other test builds\n" + S.build.kernel_source()
    assert session.build(source, ["-DKVM_TEST_LOCK=1"]) == 12345
    assert len(held) == 1, "the bundle's lock was not held during its compile"
