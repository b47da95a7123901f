"""kvmulti's HIP-on-CPU harness: its self-test, and the HIP kernels run through it vs the oracle.

The HIP kernels (hip/kvmulti_attention.hip, unmodified) are compiled with g++ against
hip/cpu_harness and must equal kvmulti.reference on hypothesis-generated mixed batches.
"""

from __future__ import annotations

import ctypes
import os
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batches import ALL_DTYPES, CaseSpec, batch_cases, build_case, check_against_reference

from kvmulti.backends import get_backend, hip

IN_CI = os.environ.get("CI", "").lower() == "true"


def _require_gxx():
    reasons = hip.build.cpu_harness_reasons()
    if reasons:
        if IN_CI:
            pytest.fail("HIP CPU harness cannot be built in CI: " + "; ".join(reasons))
        pytest.skip("HIP CPU harness cannot be built here: " + "; ".join(reasons))


@pytest.fixture(scope="module", params=["asm-switch", "ucontext"])
def selftest_lib(request):
    """The self-test kernels built with the harness, once per context-switch implementation."""
    _require_gxx()
    src = hip.build.source_dir() / "cpu_harness" / "selftest" / "selftest.hip"
    flags = ("-DKVCPU_FORCE_UCONTEXT",) if request.param == "ucontext" else ()
    path = hip.build.build_harness_library(src, [], f"libkvcpu_selftest_{request.param}.so",
                                     "the CPU-harness self-test kernels", extra_flags=flags)
    lib = ctypes.CDLL(str(path))
    lib.selftest_run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.selftest_run.restype = ctypes.c_int
    lib.kvcpu_set_warp_size.argtypes = [ctypes.c_int]
    lib.kvcpu_last_error.restype = ctypes.c_char_p
    lib.kvcpu_static_shared_bytes.restype = ctypes.c_longlong
    return lib


def _run(lib, which, x, blocks, threads, out_len=None):
    out = np.zeros(out_len or x.size, dtype=np.float32)
    lib.kvcpu_clear_error()
    err = lib.selftest_run(which, x.ctypes.data, out.ctypes.data, blocks, threads)
    return err, out, lib.kvcpu_last_error().decode()


def test_static_shared_memory_is_poisoned(selftest_lib):
    # The kernels' __shared__ variables were gathered into the section the harness poisons per block.
    assert selftest_lib.kvcpu_static_shared_bytes() >= 64 * 4


@pytest.mark.parametrize("dynamic", [False, True])
def test_barrier_bug_is_caught_and_correct_kernel_passes(selftest_lib, dynamic):
    blocks, n = 3, 64
    x = np.random.default_rng(0).standard_normal(blocks * n).astype(np.float32)
    rows = x.reshape(blocks, n)
    expected = (rows + (np.roll(rows, 1, axis=1) if dynamic else np.roll(rows, -1, axis=1))).ravel()
    good, bad = (2, 3) if dynamic else (0, 1)
    err, out, msg = _run(selftest_lib, good, x, blocks, n)
    assert err == 0, msg
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    err, out, msg = _run(selftest_lib, bad, x, blocks, n)
    # Without __syncthreads() a thread reads its neighbour's slot before the neighbour wrote it.
    assert err != 0 or not np.allclose(out, expected, rtol=1e-6, equal_nan=False), \
        "missing-barrier kernel was not caught"
    wrong = ~np.isclose(out, expected)
    assert wrong.sum() >= n // 4, f"only {wrong.sum()} of {out.size} results wrong"


def test_divergent_barrier_is_detected(selftest_lib):
    x = np.arange(64, dtype=np.float32)
    err, _, msg = _run(selftest_lib, 4, x, 1, 64)
    assert err != 0
    assert "deadlock" in msg and "__syncthreads" in msg


@pytest.mark.parametrize("wave", [32, 64])
def test_wave_shuffles(selftest_lib, wave):
    selftest_lib.kvcpu_set_warp_size(wave)
    blocks, threads = 2, 128
    x = np.random.default_rng(1).standard_normal(blocks * threads).astype(np.float32)
    err, out, msg = _run(selftest_lib, 5, x, blocks, threads, out_len=4 * x.size)
    assert err == 0, msg
    out = out.reshape(-1, 4)
    waves = x.reshape(-1, wave)
    np.testing.assert_allclose(out[:, 0], np.repeat(waves.sum(1), wave), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 1], np.repeat(waves.sum(1), wave), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[:, 2], waves[:, ::-1].ravel())
    np.testing.assert_array_equal(out[:, 3], np.tile(np.arange(wave), x.size // wave))
    err, _, msg = _run(selftest_lib, 6, x[:threads], 1, threads)
    assert err != 0 and "deadlock" in msg and "shuffle" in msg


# ------------------------------------------------------------------------ kernels vs oracle
@pytest.fixture(scope="module")
def hip_backend():
    _require_gxx()
    backend = get_backend("HIP")
    assert not backend.platform_reasons("cpu")
    return backend


def _run_case(backend, spec, wave=64, partition_size=-1):
    """check_against_reference through the public ops with backend="HIP" (the CPU harness here),
    with the registry's HIP instance set to emulate ``wave`` and use ``partition_size``. Returns
    the plan the per-step hook made (the last one)."""
    saved = backend.cpu_wave, backend.partition_size
    backend.cpu_wave, backend.partition_size = wave, partition_size
    steps = []
    real = type(backend).build_metadata
    backend.build_metadata = lambda *a: steps.append(real(backend, *a)) or steps[-1]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)
            check_against_reference(spec, "HIP")
    finally:
        backend.cpu_wave, backend.partition_size = saved
        del backend.build_metadata
    return steps[-1].plan


MIXED = dict(block_sizes=(1, 16, 32), head_sizes=(64, 128), groups=(1, 4, 8), kv_heads=(1, 2), dtypes=ALL_DTYPES,
             max_reqs=4, max_context=70, max_query=12)


@settings(max_examples=40)
@given(spec=batch_cases(**MIXED), wave=st.sampled_from([32, 64]))
def test_hip_kernels_match_reference(hip_backend, spec, wave):
    assert _run_case(hip_backend, spec, wave=wave, partition_size=0).num_partitions == 1


@settings(max_examples=25)
@given(spec=batch_cases(**MIXED), wave=st.sampled_from([32, 64]), partition=st.sampled_from([5, 16, 48]))
def test_partitioned_decode_matches_reference(hip_backend, spec, wave, partition):
    """Split-KV path (forced with a small partition size) + its reduce kernel."""
    plan = _run_case(hip_backend, spec, wave=wave, partition_size=partition)
    max_span = max(spec.seq_lens) if spec.sliding_window is None else min(max(spec.seq_lens), spec.sliding_window)
    assert plan.num_partitions == -(-max_span // partition) or max_span <= partition


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_two_block_caches(hip_backend, order, dtype):
    """num_blocks == 2 (a shape[0] == 2 cache must not be mistaken for a K/V-first layout)."""
    spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=dtype,
                    query_lens=(3, 1), context_lens=(0, 9), sliding_window=None)
    assert build_case(spec).layout.num_blocks == 2
    _run_case(hip_backend, spec, wave=32)
    spec = CaseSpec(order=order, block_size=32, num_kv_heads=1, group=8, head_size=128, dtype=dtype,
                    query_lens=(5, 2), context_lens=(20, 0), extra_blocks=0, sliding_window=6, softcap=8.0)
    assert build_case(spec).layout.num_blocks == 2
    _run_case(hip_backend, spec, wave=64, partition_size=4)


@pytest.mark.parametrize("head_size", [80, 96, 256])
def test_other_declared_head_sizes(hip_backend, head_size):
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=2, head_size=head_size, dtype=torch.float16,
                    query_lens=(4, 1, 2), context_lens=(0, 33, 17), sliding_window=20, softcap=12.0)
    _run_case(hip_backend, spec, wave=32)


def test_auto_split_heuristic_long_decode(hip_backend):
    """A long decode on few heads takes the split-KV path by the default heuristic."""
    spec = CaseSpec(order="NHD", block_size=32, num_kv_heads=1, group=1, head_size=64, dtype=torch.float32,
                    query_lens=(1,), context_lens=(1100,))
    assert _run_case(hip_backend, spec, wave=32, partition_size=-1).num_partitions == 3   # ceil(1101 / 512)


@pytest.mark.parametrize("wave", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_span_several_tiles(hip_backend, wave, dtype):
    """Spans longer than one tile (kNumWarps * wave keys): the online softmax across tiles and the
    barrier that protects the tile buffers (removing it makes this test fail on the harness)."""
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=2, head_size=64, dtype=dtype,
                    query_lens=(3, 1, 2), context_lens=(300, 500, 260), sliding_window=None, softcap=20.0)
    _run_case(hip_backend, spec, wave=wave, partition_size=0)
    spec = CaseSpec(order="NHD", block_size=32, num_kv_heads=1, group=4, head_size=128, dtype=dtype,
                    query_lens=(2, 1), context_lens=(400, 330), sliding_window=290)
    _run_case(hip_backend, spec, wave=wave, partition_size=0)


@pytest.mark.parametrize("group", [12, 16])
def test_gqa_groups_larger_than_one_block(hip_backend, group):
    """Groups of more than 8 query heads per KV head are split over several blocks (8 + 4, 8 + 8)."""
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=group, head_size=64, dtype=torch.float32,
                    query_lens=(4, 1), context_lens=(30, 150), sliding_window=100, softcap=25.0)
    _run_case(hip_backend, spec, wave=32, partition_size=0)
    _run_case(hip_backend, spec, wave=64, partition_size=32)


@pytest.mark.parametrize("window", [None, 1, 5, 37])
@pytest.mark.parametrize("partition", [0, 3, 7])
def test_token_tiles_with_windows_and_partitions(hip_backend, window, partition):
    """With group 1 a block computes 8 consecutive query tokens (2 with group 4): each row masks the
    keys outside its own causal / window / partition range."""
    spec = CaseSpec(order="NHD", block_size=4, num_kv_heads=2, group=1, head_size=64, dtype=torch.float32,
                    query_lens=(21, 13, 1), context_lens=(0, 9, 30), sliding_window=window)
    _run_case(hip_backend, spec, wave=32, partition_size=partition)
    spec = CaseSpec(order="HND", block_size=1, num_kv_heads=1, group=4, head_size=64, dtype=torch.float16,
                    query_lens=(7, 3), context_lens=(5, 0), sliding_window=window)
    _run_case(hip_backend, spec, wave=64, partition_size=partition)
