"""The native CPU kernel (cpu/*.cpp) against the oracle, and the torch fallback beside it.

The native path must really be taken: under CI=true a failed build FAILS these tests (it is not a
skip); elsewhere they skip with the build's reason.
"""

import contextlib
import os
import subprocess
from pathlib import Path
import sys

import pytest
import torch
from hypothesis import given, settings
from tiers import examples

import kvmulti
from kvmulti import reference
from kvmulti.backends.cpu import backend as cpu_backend
from kvmulti.backends.cpu import native as cpu_native
from kvmulti.backends.registry import get_backend

from batches import CaseSpec, batch_cases, build_case, check_against_reference, assert_close_to_reference

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="module")
def native():
    if not get_backend("CPU").native_kernel:
        pytest.skip("native CPU kernel disabled (KVMULTI_CPU_NATIVE=0)")
    module, reason = cpu_native.status()
    if module is None:
        if IN_CI:
            pytest.fail(f"the native CPU kernel must build in CI: {reason}")
        pytest.skip(f"native CPU kernel not built here: {reason}")
    return module


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def env(name, value):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def native_path():
    """Count native calls inside the block, so each check proves the native path ran."""
    calls = {"attention": 0, "write": 0}
    module = cpu_native.load()

    class Counting:
        """The native module, counting its kernel calls."""

        def __getattr__(self, name):
            return getattr(module, name)

        def paged_attention(self, *args):
            calls["attention"] += 1
            return module.paged_attention(*args)

        def write_kv(self, *args):
            calls["write"] += 1
            return module.write_kv(*args)

    with patched(cpu_native, "load", lambda: Counting() if module is not None else None):
        yield calls
    assert calls["attention"] > 0 and calls["write"] > 0, f"native path not taken: {calls}"


def check_native(spec):
    with native_path():
        check_against_reference(spec, "CPU")


def test_native_builds_and_describes(native):
    assert native.best_isa() in native.available_isas()
    assert get_backend("CPU").describe().startswith("cpu: native (")


@settings(max_examples=examples(60))
@given(batch_cases(block_sizes=(1, 16, 32, 128), head_sizes=(16, 64, 80)))
def test_native_matches_reference(native, spec):
    check_native(spec)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
@settings(max_examples=examples(12))
@given(spec=batch_cases(block_sizes=(1, 16, 128), head_sizes=(16, 80)))
def test_other_isa_variants_match_reference(native, isa, spec):
    if isa not in native.available_isas():
        pytest.skip(f"{isa} not supported on this CPU")
    with patched(get_backend("CPU"), "isa", isa):
        check_native(spec)


@settings(max_examples=examples(20))
@given(batch_cases(block_sizes=(1, 16, 32), max_context=400, max_query=40))
def test_forced_partitions_match_reference(native, spec):
    with patched(get_backend("CPU"), "partition_size", 64):   # split every span > 64 keys
        check_native(spec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_long_context_uses_partitions(native, order, dtype):
    # Automatic partitioning splits contexts longer than 512 keys on any thread count.
    spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=dtype,
                    query_lens=(1, 3, 1), context_lens=(3000, 2100, 700), sliding_window=None, softcap=None)
    check_native(spec)
    spec = CaseSpec(order=order, block_size=32, num_kv_heads=1, group=8, head_size=64, dtype=dtype,
                    query_lens=(1, 1), context_lens=(2500, 900), sliding_window=1500, softcap=20.0)
    check_native(spec)


@pytest.mark.parametrize("block_size,layout_blocks", [(32, 1), (16, 2)])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_tiny_caches(native, order, block_size, layout_blocks):
    spec = CaseSpec(order=order, block_size=block_size, num_kv_heads=2, group=4, head_size=64, dtype=torch.float32,
                    query_lens=(5,) if layout_blocks == 1 else (3, 1),
                    context_lens=(20,) if layout_blocks == 1 else (0, 9))
    assert build_case(spec).layout.num_blocks == layout_blocks
    check_native(spec)


def test_head_size_v_differs(native):
    for dtype in (torch.float32, torch.bfloat16):
        spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=2, head_size=64, head_size_v=32,
                        dtype=dtype, query_lens=(4, 1), context_lens=(10, 40), sliding_window=7)
        check_native(spec)


def test_non_causal(native):
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=64, dtype=torch.float32,
                    query_lens=(6, 3), context_lens=(0, 30), sliding_window=None)
    case = build_case(spec)
    with native_path():
        kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend="CPU")
        case.metadata.causal = False
        actual = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata, backend="CPU")
    expected = reference.paged_attention(case.query, case.cache, case.layout, case.metadata)
    assert_close_to_reference(actual, expected, spec.dtype, "non-causal")


def test_write_kv_strided_inputs_and_padding(native):
    layout = kvmulti.KVCacheLayout(num_blocks=4, block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                                   order="HND")
    cache = layout.allocate()
    ref_cache = cache.clone()
    qkv = torch.randn(5, 6, 32).to(torch.bfloat16)                 # fused [q(2) | k(2) | v(2)] heads
    key, value = qkv[:, 2:4], qkv[:, 4:6]                           # non-contiguous views
    slots = torch.tensor([3, -1, 17, 63, -1])
    md = kvmulti.CommonAttentionMetadata.from_lens([1], [4], torch.tensor([[0]], dtype=torch.int32), 16)
    q = torch.randn(1, 4, 32).to(torch.bfloat16)
    with native_path():
        kvmulti.write_kv(key, value, cache, layout, slots, backend="CPU")
        out = kvmulti.paged_attention(q, cache, layout, md, backend="CPU")   # reads it back
    reference.write_kv(key, value, ref_cache, layout, slots)
    assert torch.equal(cache, ref_cache)
    assert_close_to_reference(out, reference.paged_attention(q, cache, layout, md), torch.bfloat16)


# ---- the fallback -------------------------------------------------------------------------------
@settings(max_examples=examples(15))
@given(batch_cases(block_sizes=(1, 16, 128)))
def test_fallback_matches_reference(spec):
    called = []
    real = cpu_backend.paged_attention_torch
    with patched(get_backend("CPU"), "native_kernel", False), patched(cpu_backend, "paged_attention_torch",
                                                  lambda *a: (called.append(1), real(*a))):
        check_against_reference(spec, "CPU")
    assert called, "the torch path did not run with KVMULTI_CPU_NATIVE=0"


def test_fallback_is_described(monkeypatch):
    monkeypatch.setenv("KVMULTI_CPU_NATIVE", "0")
    from kvmulti.backends.cpu import CPUBackend
    assert CPUBackend().describe().startswith("cpu: vectorised torch: native kernel disabled (KVMULTI_CPU_NATIVE=0")


def test_no_compiler_falls_back_with_reason(tmp_path):
    code = ("import kvmulti; from kvmulti.backends.registry import get_backend; "
            "print(get_backend('CPU').describe()); "
            "import torch; print(kvmulti.available_backends('cpu')['CPU'])")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), KVMULTI_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("KVMULTI_CPU_NATIVE", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("cpu: vectorised torch: no C++ compiler"), lines
    assert lines[1] == "[]", lines   # the backend stays usable through its fallback


def test_a_killed_builds_leftover_lock_file_does_not_block_later_loads(native):
    """torch's cpp_extension locks a build directory with a file that only a clean exit removes;
    a build killed mid-way used to leave every later process waiting forever."""
    build_dir = Path(native.__file__).parent
    (build_dir / "lock").touch()
    code = "from kvmulti.backends.cpu import native; assert native.load() is not None; print('loaded')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0 and result.stdout.strip() == "loaded", result.stderr
    assert not (build_dir / "lock").exists()


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("head_size", [64, 128])
def test_bf16_direct_path_row_counts(native, order, head_size):
    # The bf16 decode path runs row blocks of 1, 2 or 4 rows (3 as 4 with a padding row) for up to 8
    # rows per item: group 3 (3 and 6 rows), group 1 with 3 / 5 tokens, windows, softcap, partitions.
    for group, qlens, ctx, window, softcap in [(3, (1, 2), (40, 300), None, None),
                                               (1, (3, 5, 1), (70, 9, 129), 33, 15.0),
                                               (2, (1, 3), (1000, 64), None, 30.0)]:
        spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=group, head_size=head_size,
                        dtype=torch.bfloat16, query_lens=qlens, context_lens=ctx, sliding_window=window,
                        softcap=softcap)
        check_native(spec)
        with patched(get_backend("CPU"), "partition_size", 64):
            check_native(spec)


MANY_ROW_CASES = [   # (group, query lens, context lens, window, softcap, head size): rows in the lanes
    (4, (16, 5), (0, 40), None, None, 64),       # a prefill tile of 64 rows, a verification of 20
    (4, (4, 4), (100, 300), None, None, 64),     # verification: 16 rows (one 16-lane vector)
    (2, (30, 9), (70, 9), 33, 15.0, 64),         # windows skip tiles, softcap
    (1, (40,), (0,), None, None, 80),            # head size 80: dv tails of the register tiles
    (8, (20, 3), (5, 100), 20, None, 16),        # 8 query heads per KV head, head size 16
    (8, (37,), (5,), None, None, 72)]            # 296 rows: three items; 36 bf16 pairs / 72 values a row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_many_row_tiles_match_reference(native, order, dtype):
    # Prefill and verification items (more rows per KV head than the direct path takes): every ISA
    # variant this CPU runs, whole items and items split into 64-key partitions.
    for isa in native.available_isas():
        for group, qlens, ctx, window, softcap, head_size in MANY_ROW_CASES:
            spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=group, head_size=head_size,
                            dtype=dtype, query_lens=qlens, context_lens=ctx, sliding_window=window, softcap=softcap)
            with patched(get_backend("CPU"), "isa", isa):
                check_native(spec)
                with patched(get_backend("CPU"), "partition_size", 64):
                    check_native(spec)


# The test builds below compile only the variants they run (each variant costs minutes on 2 cores).
PORTABLE_16_LANES = ("-DKV_GENERIC_LANES=16 -DKV_PORTABLE_VECTORS -DKV_BF16DOT_EMULATE -DKV_WS_POISON "
                     + cpu_native.skip_flags(()))
PORTABLE_CHECK = """
import torch, kvmulti
from kvmulti.backends.cpu import native as cpu_native
from kvmulti.backends.registry import get_backend
from batches import CaseSpec, check_against_reference
module, reason = cpu_native.status()
assert module is not None, reason
assert LANES is None or module.lanes("generic") == LANES, module.lanes("generic")
for order in ("NHD", "HND"):
    for group, qlens, ctx, window, softcap, dtype in [
            (4, (1, 1), (300, 70), None, None, torch.bfloat16),      # decode: one row block of 4 per KV head
            (3, (1, 2), (40, 300), None, None, torch.bfloat16),      # 3 rows as 4, 6 rows as 4 + 2
            (1, (3, 5, 1), (70, 9, 129), 33, 15.0, torch.bfloat16),  # windows, softcap
            (2, (6, 1), (20, 90), None, None, torch.float32),        # rows in the lanes, fp32 FMAs
            (4, (16, 5), (0, 40), None, None, torch.bfloat16),       # rows in the lanes, bf16 dots
            (2, (30, 9), (70, 9), 33, 15.0, torch.bfloat16)]:
        spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=group, head_size=64, dtype=dtype,
                        query_lens=qlens, context_lens=ctx, sliding_window=window, softcap=softcap)
        check_against_reference(spec, "CPU")
        get_backend("CPU").partition_size = 64
        check_against_reference(spec, "CPU")
        get_backend("CPU").partition_size = -1
from test_fp8_backends import FORMATS, check_fp8      # fp8 caches: the 16-lane direct and general paths
for fmt in FORMATS.values():
    codes = torch.arange(256, dtype=torch.uint8).view(fmt)
    want = codes.float()
    for lut in ((False, True) if LANES == 16 else (False,)):   # 16 emulated lanes build the byte tables too
        got = module.fp8_to_f32(codes, "generic", lut=lut)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), lut
    for dtype, order, group, qlens, ctx, window, softcap in [
            (torch.bfloat16, "NHD", 4, (1, 1), (300, 70), None, None),
            (torch.float16, "HND", 3, (1, 2), (40, 90), 33, 15.0),
            (torch.float32, "NHD", 2, (6, 1), (20, 90), None, None),
            (torch.bfloat16, "HND", 4, (16, 5), (0, 40), None, None)]:   # fp8 through the bf16-dot tiles
        spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=group, head_size=64, dtype=dtype,
                        query_lens=qlens, context_lens=ctx, sliding_window=window, softcap=softcap)
        check_fp8(spec, fmt, True, "CPU")
print("ok")
"""


@pytest.mark.slow
@pytest.mark.exhaustive
def test_portable_16_lane_build_runs_the_avx512_lane_logic(native):
    # The AVX-512 variants cannot run on an AVX2 host; the generic variant built with 16 portable
    # lanes (and vdpbf16ps emulated) runs the same lane logic: transposing tree, key-major scores,
    # per-lane row folds, the bf16-dot QK path. A separate process: the build flags are per process.
    env = dict(os.environ, KVMULTI_CPU_EXTRA_CFLAGS=PORTABLE_16_LANES, KVMULTI_CPU_ISA="generic",
               PYTHONPATH=os.path.dirname(__file__))
    env.pop("KVMULTI_CPU_NATIVE", None)
    result = subprocess.run([sys.executable, "-c", "LANES = 16\n" + PORTABLE_CHECK], env=env, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.exhaustive
def test_kernels_never_read_workspace_they_did_not_write(native):
    # Each thread's kernel scratch is kept between calls, not cleared. Built with KV_WS_POISON, the
    # scratch is filled with NaN before every call: any read of a part the call did not write first
    # shows as NaN or a wrong number in the cases below (this CPU's best variant; the portable
    # 16-lane build above is poisoned too). KV_PREFETCH_MIN_BYTES=0: these small calls take the
    # software-prefetch paths too (the default skips them below 512 KiB of K/V).
    skip = cpu_native.skip_flags({native.best_isa()})
    env = dict(os.environ, KVMULTI_CPU_EXTRA_CFLAGS=f"-DKV_WS_POISON -DKV_PREFETCH_MIN_BYTES=0 {skip}",
               PYTHONPATH=os.path.dirname(__file__))
    env.pop("KVMULTI_CPU_NATIVE", None)
    env.pop("KVMULTI_CPU_ISA", None)
    result = subprocess.run([sys.executable, "-c", "LANES = None\n" + PORTABLE_CHECK], env=env, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_host_isas_read_the_cpu_flags_the_kernel_tests():
    avx2 = "flags\t\t: fpu sse2 avx avx2 fma f16c"
    zen4 = avx2 + " avx512f avx512dq avx512bw avx512vl avx512vbmi avx512_bf16"
    assert cpu_native.host_isas(avx2) == ("avx2",)
    assert cpu_native.host_isas(zen4) == ("avx512bf16", "avx512", "avx2")
    assert cpu_native.host_isas(zen4.replace(" avx512vbmi", "")) == ("avx512", "avx2")
    assert cpu_native.host_isas(avx2.replace(" f16c", "")) == ()
    assert cpu_native.host_isas("processor\t: 0") is None     # no flags line: build every variant
    assert cpu_native.skip_flags(("avx2",)) == "-DKV_SKIP_AVX512 -DKV_SKIP_AVX512BF16"


def test_jit_build_holds_the_variants_this_cpu_runs(native):
    """A JIT build leaves out what this CPU cannot run, and keeps everything it can."""
    if not (cpu_native.origin() or "").startswith("JIT"):
        pytest.skip(f"the kernel is not a JIT build here: {cpu_native.origin()}")
    host = cpu_native.host_isas()
    if host is None:
        pytest.skip("this CPU's features cannot be read from /proc/cpuinfo: every variant is built")
    assert native.available_isas() == [*host, "generic"]
