"""kvmulti's HIP-on-CPU harness: its self-test, and the HIP kernels run through it vs the oracle.

The HIP kernels (hip/kvmulti_attention.hip, unmodified) are compiled with g++ against
hip/cpu_harness and must equal kvmulti.reference on hypothesis-generated mixed batches.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from batches import (ALL_DTYPES, TOLERANCE, CaseSpec, assert_close_to_reference, batch_cases, build_case,
                     check_against_reference)

import kvmulti
from kvmulti import reference
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
    lib.selftest_mfma.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.selftest_mfma.restype = ctypes.c_int
    lib.selftest_wmma.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.selftest_wmma.restype = ctypes.c_int
    lib.kvcpu_set_wmma_family.argtypes = [ctypes.c_int]
    lib.kvcpu_set_wmma_family.restype = ctypes.c_int
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


# ------------------------------------------------------------------- matrix builtins vs AMD's tables
# AMD's register-layout tables (amd_matrix_instruction_calculator --register-layout --csv), copied
# from shared/ref/amd_matrix_layouts into the repository: the independent oracle for the emulation.
REF_TABLES = sorted((Path(__file__).resolve().parents[1] / "hip" / "cpu_harness" / "selftest" / "ref").glob("*.txt"))
MFMA_TABLES = [t for t in REF_TABLES if t.name.startswith("CDNA")]
WMMA_TABLES = [t for t in REF_TABLES if t.name.startswith("RDNA")]
_ENTRY = re.compile(r"^v(\d+)\{(\d+)\}(?:\.\[(\d+):(\d+)\])?$")
_HEADER = re.compile(r"^([ABD])\[[MK]\]\[[KN]\],")

Placement = tuple[int, int, int]   # (vgpr, lane, low bit)


def _layout_tables(path: Path) -> dict[str, dict[tuple[int, int], tuple[Placement, ...]]]:
    """{"A"|"B"|"D": {(row, col): placements}} from one reference file: every (vgpr, lane, low bit) that holds
    the entry (RDNA3's A / B entries sit in two lanes). A table starts at a "## A" line or at its header row
    ("A[M][K],0,1,...")."""
    tables: dict[str, dict] = {}
    current = None
    for line in path.read_text().splitlines():
        m = re.match(r"^## ([ABD])$", line) or _HEADER.match(line)
        if m:
            current = tables.setdefault(m.group(1), {})
            continue
        cells = line.split(",")
        if current is None or not cells[0].isdigit():
            continue
        for col, cell in enumerate(cells[1:]):
            places = []
            for part in cell.split():
                e = _ENTRY.match(part)
                assert e, f"{path.name}: cannot parse {cell!r}"
                places.append((int(e.group(1)), int(e.group(2)), int(e.group(4) or 0)))
            assert places, f"{path.name}: empty cell at row {cells[0]}, column {col}"
            current[(int(cells[0]), col)] = tuple(places)
    return tables


def _operand_kind(table: Path) -> str:
    """The operand type of a reference file's instruction: "f32", "bf16" or "f16"."""
    return "f32" if "16x16x4" in table.stem else "bf16" if "bf16" in table.name else "f16"


def _bits(x: float, kind: str) -> int:
    if kind == "f32":
        return int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    if kind == "bf16":
        return int(np.array([x], dtype=np.float32).view(np.uint32)[0] >> 16)
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


_SELFTEST_KIND = {"f16": 0, "bf16": 1, "f32": 3}   # selftest_mfma's instruction selector
_KDIM = {"f16": 16, "bf16": 16, "f32": 4}


def _run_table_mfma(lib, tables, kind: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Places A (16 x K) and B (K x 16) in lane registers as AMD's tables say, runs the harness's MFMA
    builtin, and reads D back from where the table says each entry is."""
    return _run_table_instruction(lib.selftest_mfma, lib, tables, _SELFTEST_KIND[kind], kind, a, b, lanes=64,
                                  vgprs=2, d_vgprs=4)


def _run_table_instruction(run, lib, tables, selector: int, kind: str, a: np.ndarray, b: np.ndarray, *,
                           lanes: int, vgprs: int, d_vgprs: int) -> np.ndarray:
    """Places A and B in ``lanes`` lanes' registers (A in VGPRs 0 .. vgprs - 1, B in the next ``vgprs``) where
    the tables say, runs the self-test's instruction ``selector`` through ``run`` and reads D back from where
    the D table says each entry is."""
    regs = np.zeros((lanes, 2 * vgprs), dtype=np.uint32)
    for (i, k), places in tables["A"].items():
        for v, lane, lo in places:
            regs[lane, v] |= np.uint32(_bits(a[i, k], kind) << lo)
    for (k, j), places in tables["B"].items():
        for v, lane, lo in places:
            regs[lane, vgprs + v] |= np.uint32(_bits(b[k, j], kind) << lo)
    d = np.full((lanes, d_vgprs), np.nan, dtype=np.float32)
    lib.kvcpu_clear_error()
    err = run(selector, regs.ctypes.data, d.ctypes.data)
    assert err == 0, lib.kvcpu_last_error().decode()
    out = np.full((16, 16), np.nan, dtype=np.float32)
    for (i, j), places in tables["D"].items():
        assert len(places) == 1
        v, lane, _ = places[0]
        out[i, j] = d[lane, v]
    return out


def _layout_mismatches(lib, tables, kind: str, run_table=None) -> list[str]:
    """Entries where the emulation disagrees with the tables: with B = I (A's K columns picked out) the D
    entry the table names for (i, k) must be A[i][k]; with A = I likewise for B[k][j]; a random product
    must be exact (small integers)."""
    run_table = run_table or _run_table_mfma
    kd = _KDIM[kind]
    rng = np.random.default_rng(7)
    x = rng.integers(-8, 9, size=(16, kd)).astype(np.float32)
    y = rng.integers(-8, 9, size=(kd, 16)).astype(np.float32)
    pick = np.eye(kd, 16, dtype=np.float32)        # B: D[i][k] = A[i][k] for k < K
    d = run_table(lib, tables, kind, x, pick)
    bad = [f"A{(i, k)}" for i in range(16) for k in range(kd) if d[i, k] != x[i, k]]
    d = run_table(lib, tables, kind, pick.T.copy(), y)   # A: D[k][j] = B[k][j] for k < K
    bad += [f"B{(k, j)}" for k in range(kd) for j in range(16) if d[k, j] != y[k, j]]
    d = run_table(lib, tables, kind, x, y)
    bad += [f"D{(i, j)}" for i in range(16) for j in range(16) if d[i, j] != (x @ y)[i, j]]
    return bad


@pytest.mark.parametrize("table", MFMA_TABLES, ids=[t.stem for t in MFMA_TABLES])
def test_mfma_emulation_matches_amd_register_layouts(selftest_lib, table):
    """Entry by entry against AMD's table (see _layout_mismatches)."""
    assert len(MFMA_TABLES) == 6   # CDNA2 + CDNA3, f16 + bf16 + f32: the instructions the kernels use
    tables = _layout_tables(table)
    kind = _operand_kind(table)
    kd = _KDIM[kind]
    for name, n in (("A", 16 * kd), ("B", 16 * kd), ("D", 256)):
        assert len(tables[name]) == n, f"{table.name}: {name} table has {len(tables[name])} entries"
        assert len(set(tables[name].values())) == n, f"{table.name}: {name} entries not distinct"
    selftest_lib.kvcpu_set_warp_size(64)
    bad = _layout_mismatches(selftest_lib, tables, kind)
    assert not bad, f"the emulation's lane mapping differs from {table.name} at {bad[:8]}"


@pytest.mark.parametrize("table", [t for t in MFMA_TABLES if t.name.startswith("CDNA3")],
                         ids=lambda t: t.stem)
def test_mfma_layout_check_rejects_a_mutated_mapping(selftest_lib, table):
    """The check has teeth: the same table with two A lanes and two D lanes swapped must disagree."""
    tables = _layout_tables(table)
    a, d = tables["A"], tables["D"]
    a[(0, 1)], a[(1, 0)] = a[(1, 0)], a[(0, 1)]
    d[(2, 3)], d[(3, 2)] = d[(3, 2)], d[(2, 3)]
    selftest_lib.kvcpu_set_warp_size(64)
    bad = _layout_mismatches(selftest_lib, tables, _operand_kind(table))
    assert any(e.startswith("A") for e in bad) and any(e.startswith("D") for e in bad), bad


def test_mfma_reached_by_part_of_a_wave_is_detected(selftest_lib):
    selftest_lib.kvcpu_set_warp_size(64)
    regs = np.zeros((64, 4), dtype=np.uint32)
    d = np.zeros((64, 4), dtype=np.float32)
    selftest_lib.kvcpu_clear_error()
    assert selftest_lib.selftest_mfma(2, regs.ctypes.data, d.ctypes.data) != 0
    assert "deadlock" in selftest_lib.kvcpu_last_error().decode()

# WMMA (wave32): RDNA3's tables are gfx11's layout, RDNA4's gfx12's; selftest_wmma's selector is
# 2 (family 12) + 1 (bf16).
def _wmma_family(table: Path) -> int:
    return 11 if table.name.startswith("RDNA3") else 12


def _run_table_wmma(family: int):
    def run(lib, tables, kind: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        selector = (2 if family == 12 else 0) + (kind == "bf16")
        return _run_table_instruction(lib.selftest_wmma, lib, tables, selector, kind, a, b, lanes=32, vgprs=8,
                                      d_vgprs=8)
    return run


def _wmma_layout_mismatches(lib, table: Path, tables) -> list[str]:
    family = _wmma_family(table)
    lib.kvcpu_set_warp_size(32)
    assert lib.kvcpu_set_wmma_family(family) == 0
    try:
        return _layout_mismatches(lib, tables, _operand_kind(table), _run_table_wmma(family))
    finally:
        lib.kvcpu_set_wmma_family(11)


@pytest.mark.parametrize("table", WMMA_TABLES, ids=[t.stem for t in WMMA_TABLES])
def test_wmma_emulation_matches_amd_register_layouts(selftest_lib, table):
    """Every entry of A, B and D of the four WMMA instructions against AMD's RDNA3 / RDNA4 table."""
    assert len(WMMA_TABLES) == 4   # RDNA3 + RDNA4, f16 + bf16
    tables = _layout_tables(table)
    dup = 2 if _wmma_family(table) == 11 else 1   # gfx11: A / B entries in lanes l and l + 16
    for name, n, places in (("A", 256, dup), ("B", 256, dup), ("D", 256, 1)):
        assert len(tables[name]) == n, f"{table.name}: {name} table has {len(tables[name])} entries"
        assert {len(p) for p in tables[name].values()} == {places}, f"{table.name}: {name} placements"
        flat = [x for p in tables[name].values() for x in p]
        assert len(set(flat)) == n * places, f"{table.name}: {name} entries not distinct"
    bad = _wmma_layout_mismatches(selftest_lib, table, tables)
    assert not bad, f"the emulation's lane mapping differs from {table.name} at {bad[:8]}"


@pytest.mark.parametrize("table", [t for t in WMMA_TABLES if "bf16" not in t.name], ids=lambda t: t.stem)
@pytest.mark.parametrize("operand", ["A", "B", "D"])
def test_wmma_layout_check_rejects_a_moved_element(selftest_lib, table, operand):
    """The check has teeth: the table with one entry of one operand moved (swapped with its neighbour in
    the same row) must disagree at both moved entries."""
    tables = _layout_tables(table)
    t = tables[operand]
    t[(3, 5)], t[(3, 6)] = t[(3, 6)], t[(3, 5)]
    bad = _wmma_layout_mismatches(selftest_lib, table, tables)
    assert {f"{operand}(3, 5)", f"{operand}(3, 6)"} <= set(bad), bad


def test_wmma_needs_a_32_lane_wave_and_the_emulated_family(selftest_lib):
    """The emulation fails loudly on a 64-lane wave, for a builtin of the other family and with WMMA off."""
    regs = np.zeros((32, 16), dtype=np.uint32)
    d = np.zeros((32, 8), dtype=np.float32)
    try:
        for wave, family, kind, why in ((64, 11, 0, "32-lane"), (32, 12, 0, "other layout family"),
                                        (32, 11, 3, "other layout family"), (32, 0, 2, "disabled")):
            selftest_lib.kvcpu_set_warp_size(wave)
            assert selftest_lib.kvcpu_set_wmma_family(family) == 0
            selftest_lib.kvcpu_clear_error()
            assert selftest_lib.selftest_wmma(kind, regs.ctypes.data, d.ctypes.data) != 0
            assert why in selftest_lib.kvcpu_last_error().decode()
        assert selftest_lib.kvcpu_set_wmma_family(10) != 0
    finally:
        selftest_lib.kvcpu_set_wmma_family(11)



# ------------------------------------------------------------------------ kernels vs oracle
@pytest.fixture(scope="module")
def hip_backend():
    _require_gxx()
    backend = get_backend("HIP")
    assert not backend.platform_reasons("cpu")
    return backend


def _run_case(backend, spec, wave=64, partition_size=-1, prefill_min_query=-1):
    """check_against_reference through the public ops with backend="HIP" (the CPU harness here),
    with the registry's HIP instance set to emulate ``wave`` and use ``partition_size`` and
    ``prefill_min_query`` (1: the prefill kernel serves every step). Returns the plan the per-step hook
    made (the last one)."""
    saved = backend.cpu_wave, backend.partition_size, backend.prefill_min_query
    backend.cpu_wave, backend.partition_size, backend.prefill_min_query = wave, partition_size, prefill_min_query
    steps = []
    real = type(backend).build_metadata
    backend.build_metadata = lambda *a: steps.append(real(backend, *a)) or steps[-1]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)
            check_against_reference(spec, "HIP")
    finally:
        backend.cpu_wave, backend.partition_size, backend.prefill_min_query = saved
        del backend.build_metadata
    return steps[-1].plan


MIXED = dict(block_sizes=(1, 16, 32), head_sizes=(64, 128), groups=(1, 4, 8), kv_heads=(1, 2), dtypes=ALL_DTYPES,
             max_reqs=4, max_context=70, max_query=12)


@settings(max_examples=examples(40))
@given(spec=batch_cases(**MIXED), wave=st.sampled_from([32, 64]))
def test_hip_kernels_match_reference(hip_backend, spec, wave):
    assert _run_case(hip_backend, spec, wave=wave, partition_size=0).num_partitions == 1


@settings(max_examples=examples(25))
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


@pytest.mark.parametrize("wave", [32, 64])
@pytest.mark.parametrize("head_size", [80, 96, 256])
def test_other_declared_head_sizes(hip_backend, head_size, wave):
    """wave 64 + 16-bit: the MFMA engine's padded fragments (80, 96: K dims padded to 96, V to 128;
    256: two V chunks per lane); wave 32: the FMA engine."""
    dtype = torch.float16 if wave == 32 else torch.bfloat16
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=2, head_size=head_size, dtype=dtype,
                    query_lens=(4, 1, 2), context_lens=(0, 33, 17), sliding_window=20, softcap=12.0)
    _run_case(hip_backend, spec, wave=wave)


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


def _mfma_library():
    lib = hip.library.load_cpu_library()
    lib.kvcpu_mfma_count.restype = ctypes.c_ulonglong
    lib.kvcpu_set_mfma_enabled.argtypes = [ctypes.c_int]
    return lib


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mfma_path_runs_on_the_harness(hip_backend, dtype):
    """16-bit on wave64 takes the MFMA engine: the harness counts exactly the emulated instructions the
    tiling implies; with MFMA disabled the same case runs the FMA engine (wave64, 16 rows) instead."""
    lib = _mfma_library()
    # decode, 2 KV heads x GQA 4, head 128, 41 keys: 2 tiles of 32 keys per block (one block per KV
    # head), each 2 x (8 QK + 8 PV) MFMAs.
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=128, dtype=dtype,
                    query_lens=(1,), context_lens=(40,), sliding_window=None)
    lib.kvcpu_reset_mfma_count()
    _run_case(hip_backend, spec, wave=64, partition_size=0)
    assert lib.kvcpu_mfma_count() == 2 * 2 * 2 * (8 + 8)
    lib.kvcpu_reset_mfma_count()
    _run_case(hip_backend, spec, wave=32, partition_size=0)
    assert lib.kvcpu_mfma_count() == 0   # wave32 (RDNA): FMA engine
    lib.kvcpu_set_mfma_enabled(0)
    try:
        spec = CaseSpec(order="NHD", block_size=3, num_kv_heads=2, group=8, head_size=64, dtype=dtype,
                        query_lens=(5, 1, 2), context_lens=(7, 60, 30), sliding_window=19, softcap=10.0)
        _run_case(hip_backend, spec, wave=64, partition_size=0)
        _run_case(hip_backend, spec, wave=64, partition_size=16)
        assert lib.kvcpu_mfma_count() == 0
    finally:
        lib.kvcpu_set_mfma_enabled(1)


@pytest.mark.parametrize("block_size", [1, 16, 32, 128])
def test_decode_tiles_with_scalar_and_shuffled_block_ids(hip_backend, block_size):
    """The MFMA decode loop reads a 16-key sub-tile's block id as one wave-uniform scalar when the block size
    is a multiple of 16 (else it shuffles each key's entry out of the 64-entry block-table window and loads
    without the 16-byte alignment): every
    visible tile is computed exactly once, for waves with 1 .. 9 tiles, across windows. 1 KV head x GQA 4,
    head 128: one block per request and KV head, 2 x (8 QK + 8 PV) MFMAs per 32-key tile."""
    lib = _mfma_library()
    contexts = (40, 300, 1150) if block_size > 1 else (40, 300)   # 1150: a wave's share crosses a window at 1024
    spec = CaseSpec(order="NHD" if block_size != 32 else "HND", block_size=block_size, num_kv_heads=1, group=4,
                    head_size=128, dtype=torch.bfloat16, query_lens=(1,) * len(contexts),
                    context_lens=tuple(c - 1 for c in contexts), sliding_window=None, softcap=30.0)
    lib.kvcpu_reset_mfma_count()
    _run_case(hip_backend, spec, wave=64, partition_size=0)
    assert lib.kvcpu_mfma_count() == sum(-(-c // 32) for c in contexts) * 2 * (8 + 8)


# ------------------------------------------------------------ fp8 caches on the MFMA engine (16-bit queries)
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _run_fp8_case(backend, spec, cache_dtype, per_head, wave=64, partition_size=0, prefill_min_query=-1):
    """test_fp8_backends.check_fp8 (the write bit-identical to the oracle's, attention within the query
    dtype's tolerance of the oracle over the same bytes) through backend="HIP" with the registry's HIP
    instance emulating ``wave`` with ``partition_size`` and ``prefill_min_query``; returns the MFMA
    instructions the harness ran."""
    from test_fp8_backends import check_fp8
    lib = _mfma_library()
    saved = backend.cpu_wave, backend.partition_size, backend.prefill_min_query
    backend.cpu_wave, backend.partition_size, backend.prefill_min_query = wave, partition_size, prefill_min_query
    lib.kvcpu_reset_mfma_count()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)
            check_fp8(spec, cache_dtype, per_head, "HIP")
    finally:
        backend.cpu_wave, backend.partition_size, backend.prefill_min_query = saved
    return lib.kvcpu_mfma_count()


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_cache_takes_the_mfma_engine(hip_backend, fmt, dtype):
    """An fp8 cache with a 16-bit query on wave64 runs the MFMA engine with 16 rows per block: the same
    case as test_mfma_path_runs_on_the_harness gives the same count (head 128: 2 K chunks of 16 codes x 4
    widened fragments + 8 PV fragments per 16-key sub-tile). fp32 queries, wave32 and MFMA disabled run
    the FMA engine (16 rows on wave64); every run matches the oracle."""
    cache_dtype = FP8_FORMATS[fmt]
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=128, dtype=dtype,
                    query_lens=(1,), context_lens=(40,), sliding_window=None)
    assert _run_fp8_case(hip_backend, spec, cache_dtype, per_head=True) == 2 * 2 * 2 * (8 + 8)
    # head 64 (rows of 64 codes): one 64-key iteration of 4 sub-tiles per block, each one chunk of 16 codes
    # (4 fragments) for QK and 8 PV fragments (half of them padding)
    small = dataclasses.replace(spec, head_size=64)
    assert _run_fp8_case(hip_backend, small, cache_dtype, per_head=False) == 2 * 1 * 4 * (4 + 8)
    assert _run_fp8_case(hip_backend, dataclasses.replace(spec, dtype=torch.float32), cache_dtype, True) == 0
    assert _run_fp8_case(hip_backend, spec, cache_dtype, per_head=True, wave=32) == 0
    lib = _mfma_library()
    lib.kvcpu_set_mfma_enabled(0)
    try:
        mixed = CaseSpec(order="NHD", block_size=3, num_kv_heads=2, group=8, head_size=64, dtype=dtype,
                         query_lens=(5, 1, 2), context_lens=(7, 60, 30), sliding_window=19, softcap=10.0)
        assert _run_fp8_case(hip_backend, mixed, cache_dtype, per_head=True) == 0
        assert _run_fp8_case(hip_backend, mixed, cache_dtype, per_head=False, partition_size=16) == 0
    finally:
        lib.kvcpu_set_mfma_enabled(1)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("per_head", [False, True], ids=["tensor_scale", "head_scales"])
def test_fp8_mfma_mixed_batches_match_the_oracle(hip_backend, fmt, order, per_head):
    """Prefill, chunked prefill / verification and decodes in one launch over an fp8 cache, GQA 4 and 2,
    per-tensor and per-head scales, both orders; fp16 and bf16 queries (each format meets both)."""
    dtype = torch.float16 if (order == "NHD") == per_head else torch.bfloat16
    for group, block_size in ((4, 16), (2, 5)):
        spec = CaseSpec(order=order, block_size=block_size, num_kv_heads=2, group=group, head_size=128, dtype=dtype,
                        query_lens=(5, 3, 1, 1), context_lens=(0, 17, 30, 9), extra_blocks=1, seed=group)
        assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head) > 0


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_mfma_window_softcap_and_split_kv(hip_backend, fmt, dtype):
    """Sliding window + softcap (applied after k_scale and the score scale), a GQA group of 3 (blocks of 3
    heads x 5 tokens), block size 5, then the same batch split into partitions of 16 keys."""
    spec = CaseSpec(order="HND", block_size=5, num_kv_heads=2, group=3, head_size=64, dtype=dtype,
                    query_lens=(7, 1, 4, 1), context_lens=(0, 33, 12, 70), sliding_window=9, softcap=8.0, seed=7)
    for partition in (0, 16):
        assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=True, partition_size=partition) > 0


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("head_size", [80, 96, 256])
def test_fp8_mfma_other_head_sizes(hip_backend, fmt, head_size):
    """Padded fragments with fp8 chunks of 16 codes: 80 and 96 -> 128 dims for QK (2 chunks per lane
    group), V pieces past the head masked; 256: 4 QK chunks, 2 V pieces per lane and key, one sub-tile."""
    dtype = torch.bfloat16 if head_size == 96 else torch.float16
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=head_size, dtype=dtype,
                    query_lens=(4, 1, 2), context_lens=(0, 33, 17), sliding_window=20, softcap=12.0, seed=3)
    assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=head_size != 80) > 0


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_fp8_mfma_long_contexts_span_several_tiles(hip_backend, fmt):
    """Several 32-key iterations per wave (the online softmax across tiles, the per-wave V buffer reused
    every sub-tile) and block-table windows of 64 blocks (block size 1)."""
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=1, group=4, head_size=128, dtype=torch.bfloat16,
                    query_lens=(3, 1), context_lens=(300, 500), softcap=20.0)
    assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=True) > 0
    spec = CaseSpec(order="NHD", block_size=1, num_kv_heads=2, group=8, head_size=64, dtype=torch.float16,
                    query_lens=(2, 1), context_lens=(150, 90), sliding_window=120)
    assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=False) > 0


def _harness_attention(backend, query, cache, layout, md, *, sliding_window=None, softcap=None, k_scale=None,
                       v_scale=None):
    """``paged_attention`` on ``backend`` (HIP on the CPU harness): (output, MFMAs the harness counted)."""
    lib = _mfma_library()
    lib.kvcpu_reset_mfma_count()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)
        out = kvmulti.paged_attention(query, cache, layout, md, sliding_window=sliding_window, softcap=softcap,
                                      k_scale=k_scale, v_scale=v_scale, backend=backend)
    return out, lib.kvcpu_mfma_count()


def _fp8_attention(cache, layout, md, query, k_scale, v_scale):
    """(HIP on the harness at wave 64, the oracle) over the same fp8 bytes; asserts the MFMA engine ran."""
    out, mfmas = _harness_attention(hip.HipBackend(partition_size=0, cpu_wave=64), query, cache, layout, md,
                                    k_scale=k_scale, v_scale=v_scale)
    assert mfmas > 0
    return out, reference.paged_attention(query, cache, layout, md, k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_mfma_widens_every_value_code_exactly(fmt, dtype, hip_backend):
    """All 256 codes as the values of two decodes' only key: its softmax weight is exactly 1 and v_scale a
    power of two, so the output is v_scale * float(code) bit for bit -- subnormals, ±max, ±0, NaN and
    e5m2's ±inf included -- as in the oracle. The other keys of the 16-key sub-tiles the kernel reads --
    the blocks' other slots, and block 0 for keys past the table -- hold NaN codes (K and V): they are
    outside the rows' ranges, so they must not reach the output."""
    cache_dtype = FP8_FORMATS[fmt]
    layout = kvmulti.KVCacheLayout(3, 16, 1, 128, dtype=cache_dtype, order="NHD")
    cache = layout.allocate("cpu")
    cache.view(torch.uint8).fill_(0x7F)                      # NaN in both formats
    gen = torch.Generator().manual_seed(4)
    layout.keys(cache)[1:, 0, 0] = torch.randn(2, 128, generator=gen).to(cache_dtype)
    layout.values(cache).view(torch.uint8)[1:, 0, 0] = torch.arange(256, dtype=torch.uint8).view(2, 128)
    md = kvmulti.CommonAttentionMetadata.from_lens([1, 1], [1, 1], torch.tensor([[1], [2]], dtype=torch.int32), 16)
    query = torch.randn(2, 4, 128, generator=gen).to(dtype)
    out, want = _fp8_attention(cache, layout, md, query, 0.75, 0.5)
    assert want.isnan().any() and want.isfinite().any() and (want.isinf().any() == (fmt == "e5m2"))
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_mfma_special_key_codes_match_the_oracle(hip_backend, fmt, order, dtype):
    """Keys made of every finite code of the format (subnormals, ±max, ±0) among random ones; a NaN code
    in one key of a decode (its rows: NaN) and in the last key of a prefill (only the last query sees it:
    the others stay finite); e5m2: +inf and -inf codes (a row whose score is +inf is NaN, -inf drops the
    key). Compared with the oracle, NaN positions included."""
    cache_dtype = FP8_FORMATS[fmt]
    layout = kvmulti.KVCacheLayout(8, 16, 2, 128, dtype=cache_dtype, order=order)
    cache = layout.allocate("cpu")
    gen = torch.Generator().manual_seed(9)
    cache.copy_(torch.randn(layout.shape, generator=gen).to(cache_dtype))
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[torch.isfinite(codes.view(cache_dtype).float())]
    keys = layout.keys(cache).view(torch.uint8)                # [block, slot, head, dim]
    keys[0, :16, 1] = finite.repeat(9)[: 16 * 128].view(16, 128)          # request 0, KV head 1: every finite code
    nan = 0x7F
    keys[2, 4, 0, 7] = nan                                     # request 1 (decode), KV head 0
    keys[4, 7, 1, 100] = nan                                   # request 2 (prefill of 8): its last key
    if fmt == "e5m2":
        keys[6, 2, 0, 3] = 0x7C                                # request 3: +inf ...
        keys[6, 9, 1, 5] = 0xFC                                # ... and -inf
    table = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([1, 1, 8, 1], [20, 21, 8, 30], table, 16)
    query = torch.randn(11, 8, 128, generator=gen).to(dtype)
    out, want = _fp8_attention(cache, layout, md, query, torch.tensor([0.02, 0.05]), 0.3)
    nan_rows = want.isnan().all(dim=-1)
    assert nan_rows[1, :4].all() and not nan_rows[1, 4:].any() and nan_rows[9, 4:].all() and not nan_rows[2:9].any()
    assert want[0].isfinite().all()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol, equal_nan=True)


# ------------------------------------------------- non-finite bytes in slots no row may read
# The kernels load whole tiles: keys past a request's seq_len (the tail of its last block), keys of the
# tile past the block's key range, and keys before a sliding window come in with the visible ones. None
# of them may influence the output whatever the cache holds there (e.g. the unwritten tail of a cache
# allocated with torch.empty): a masked score is set by select, and their V is zeroed before P V
# (0 x inf and 0 x NaN would be NaN).
POISON_CACHES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, **FP8_FORMATS}
# (query dtype, cache, wave, engine): MFMA = 16-bit query on wave64 (16-bit or fp8 cache); FMA = fp32
# queries, or wave32
POISON_ENGINES = [
    (torch.float16, "fp16", 64, "mfma"), (torch.bfloat16, "bf16", 64, "mfma"),
    (torch.bfloat16, "e4m3", 64, "mfma"), (torch.float16, "e5m2", 64, "mfma"),
    (torch.float32, "fp32", 64, "fma"), (torch.float16, "fp16", 32, "fma"), (torch.bfloat16, "bf16", 32, "fma"),
    (torch.float32, "e4m3", 64, "fma"), (torch.float16, "e5m2", 32, "fma"),
]
POISON_SCENARIOS = {
    # three decodes, the last blocks' tails unwritten, block-table entries past the range pointing at
    # whole poisoned blocks
    "decode": dict(query_lens=(1, 1, 1), context_lens=(40, 6, 129), sliding_window=None, partition=0),
    # prefill + chunked prefill + decode in one launch
    "mixed": dict(query_lens=(7, 5, 1), context_lens=(0, 21, 50), sliding_window=None, partition=0),
    # sliding window (slots before each request's first visible key poisoned), also split into partitions
    "window": dict(query_lens=(6, 1, 3), context_lens=(0, 70, 33), sliding_window=9, partition=16),
}


def _poison_codes(cache_dtype, poison):
    """The byte pattern of one cache element holding ``poison`` ("nan" / "inf")."""
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        if poison == "nan":
            return torch.tensor([0x7F], dtype=torch.uint8)             # NaN in both formats
        assert cache_dtype == torch.float8_e5m2
        return torch.tensor([0x7C], dtype=torch.uint8)                 # e5m2 +inf (e4m3fn has no inf)
    return torch.tensor([float(poison)], dtype=cache_dtype).view(torch.uint8)


def _poisoned_case(spec, cache_dtype, poison):
    """(layout, cache, metadata, query, k_scale, v_scale): the batch's keys written by the oracle, every
    slot no row may read -- past each request's seq_len, before its first visible key, every slot of the
    spare blocks, which the block-table entries outside the requests' ranges now point at -- filled with
    ``poison`` (K and V, every head)."""
    from test_fp8_backends import fp8_case
    fp8_cache = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    case = fp8_case(spec, cache_dtype, per_head=True) if fp8_cache else build_case(spec)
    k_scale, v_scale = (case.k_scale, case.v_scale) if fp8_cache else (None, None)
    layout, md, bs = case.layout, case.metadata, spec.block_size
    table = md.block_table.clone()
    used = {int(b) for b in table.flatten() if 0 <= int(b) < layout.num_blocks}
    spare = [b for b in range(layout.num_blocks) if b not in used]
    assert spare, "the spec needs extra_blocks"
    outside = (table < 0) | (table >= layout.num_blocks)
    table[outside] = torch.tensor(spare, dtype=torch.int32).repeat(int(outside.sum()))[: int(outside.sum())]
    md = kvmulti.CommonAttentionMetadata.from_lens(list(spec.query_lens), list(spec.seq_lens), table, bs)
    cache = case.cache
    reference.write_kv(case.key, case.value, cache, layout, md.slot_mapping, k_scale, v_scale)
    readable = torch.zeros(layout.num_blocks, bs, dtype=torch.bool)
    for i, (seq, q) in enumerate(zip(spec.seq_lens, spec.query_lens)):
        for pos in range(reference.lowest_visible_position(seq, q, spec.sliding_window), seq):
            readable[int(table[i, pos // bs]), pos % bs] = True
    codes = _poison_codes(cache_dtype, poison)
    raw = cache.view(torch.uint8)                            # [block, slot, head, bytes] (logical)
    elements = raw.unflatten(-1, (-1, codes.numel()))
    assert (~readable).sum() > 0
    elements[~readable] = codes
    query = case.query
    return layout, cache, md, query, k_scale, v_scale


# (engine, poison) pairs that exist: e4m3fn has no inf code, so it is poisoned with NaN only.
POISON_CASES = [(engine, poison) for engine in POISON_ENGINES for poison in ("nan", "inf")
                if not (poison == "inf" and POISON_CACHES[engine[1]] == torch.float8_e4m3fn)]


@pytest.mark.parametrize("scenario", POISON_SCENARIOS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("engine,poison", POISON_CASES,
                         ids=[f"{str(e[0])[6:]}-{e[1]}-w{e[2]}-{e[3]}-{p}" for e, p in POISON_CASES])
def test_unreadable_slots_with_non_finite_bytes_do_not_leak(hip_backend, engine, poison, order, scenario):
    """Every slot no row may read holds NaN or +inf (fp8: the NaN code 0x7F, e5m2's +inf 0x7C): the output
    must equal the oracle's, which reads only the visible keys and is finite, on both engines."""
    dtype, cache_name, wave, kind = engine
    cache_dtype = POISON_CACHES[cache_name]
    sc = POISON_SCENARIOS[scenario]
    head_size = 128 if scenario == "decode" else 64
    spec = CaseSpec(order=order, block_size=16 if scenario != "window" else 5, num_kv_heads=2, group=4,
                    head_size=head_size, dtype=dtype, query_lens=sc["query_lens"], context_lens=sc["context_lens"],
                    extra_blocks=2, sliding_window=sc["sliding_window"], softcap=8.0 if scenario == "window" else None,
                    seed=len(scenario))
    layout, cache, md, query, k_scale, v_scale = _poisoned_case(spec, cache_dtype, poison)
    want = reference.paged_attention(query, cache, layout, md, sliding_window=spec.sliding_window,
                                     softcap=spec.softcap, k_scale=k_scale, v_scale=v_scale)
    assert bool(want.isfinite().all())
    out, mfmas = _harness_attention(hip.HipBackend(partition_size=sc["partition"], cpu_wave=wave), query, cache,
                                    layout, md, sliding_window=spec.sliding_window, softcap=spec.softcap,
                                    k_scale=k_scale, v_scale=v_scale)
    assert (mfmas > 0) == (kind == "mfma")
    bad = int((~out.isfinite()).sum())
    assert bad == 0, f"{bad} of {out.numel()} outputs non-finite"
    assert_close_to_reference(out, want, dtype, f"{spec} over {cache_name} poisoned with {poison}")


# ------------------------------------------------------------------------------- the prefill kernel
# paged_prefill_kernel (hip/kvmulti_prefill.hip): 64 query rows per work-group (16 per wave), K/V tiles of 64
# keys staged once in LDS for all four waves. The launcher serves fp16 / bf16 queries over a cache of their
# type at head 128 on wave64 with it; prefill_min_query=1 makes it take every such step, so small batches
# cover several token tiles, several key tiles, tiles skipped whole, the diagonal and window edges.
def _mfma_count(backend, spec, **kw):
    lib = _mfma_library()
    lib.kvcpu_reset_mfma_count()
    _run_case(backend, spec, **kw)
    return lib.kvcpu_mfma_count()


def test_prefill_kernel_is_chosen_by_the_longest_query_and_skips_tiles(hip_backend):
    """Group 1, head 128, fp16: a work-group takes 64 tokens; each wave computes 4 sub-tiles x (8 QK + 8 PV)
    = 64 MFMAs per 64-key tile it does not skip. 70 + 3 tokens with a window of 33 over 20 cached keys: token
    tile 0 (positions 20..83) visits key tiles 0 and 1, where waves 0 and 1 (positions 20..51) skip tile 1;
    token tile 1 (6 rows, wave 0) visits both; the 3-token request one: 9 wave-tiles. The default threshold:
    a longest query of 64 takes the prefill kernel (one tile, 4 waves: 256), 63 the decode kernel."""
    spec = CaseSpec(order="NHD", block_size=1, num_kv_heads=1, group=1, head_size=128, dtype=torch.float16,
                    query_lens=(70, 3), context_lens=(20, 0), sliding_window=33, softcap=8.0)
    assert _mfma_count(hip_backend, spec, wave=64, partition_size=0, prefill_min_query=1) == 9 * 64
    one = CaseSpec(order="HND", block_size=16, num_kv_heads=1, group=1, head_size=128, dtype=torch.float16,
                   query_lens=(64,), context_lens=(0,))
    assert _mfma_count(hip_backend, one, wave=64, partition_size=0) == 4 * 64
    shorter = dataclasses.replace(one, query_lens=(63,))
    assert _mfma_count(hip_backend, shorter, wave=64, partition_size=0) not in (0, 4 * 64)
    assert _mfma_count(hip_backend, one, wave=64, partition_size=0, prefill_min_query=0) not in (0, 4 * 64)


PREFILL_CASES = {
    # varlen prefill + chunked prefill + decode in one launch, GQA 4, several token and key tiles
    "varlen-chunked-gqa4-bf16": (dict(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=128,
                                      dtype=torch.bfloat16, query_lens=(40, 1, 9, 23), context_lens=(0, 30, 50, 70)),
                                 64, 0),
    # one long prompt: 3 token tiles, the diagonal of each, causal tiles skipped
    "causal-gqa1-fp16": (dict(order="NHD", block_size=16, num_kv_heads=1, group=1, head_size=128,
                              dtype=torch.float16, query_lens=(150,), context_lens=(0,)), 64, 0),
    # sliding window + softcap, block size 1 (several block-table windows)
    "window-softcap-gqa1-bs1": (dict(order="NHD", block_size=1, num_kv_heads=1, group=1, head_size=128,
                                     dtype=torch.bfloat16, query_lens=(70, 3), context_lens=(90, 0),
                                     sliding_window=33, softcap=8.0), 64, 0),
    # GQA 8 (8 tokens x 8 heads per tile), block size 128, window, split into partitions of 32 keys
    "gqa8-bs128-window-split": (dict(order="HND", block_size=128, num_kv_heads=2, group=8, head_size=128,
                                     dtype=torch.bfloat16, query_lens=(17, 9), context_lens=(100, 0),
                                     sliding_window=50), 64, 32),
    # GQA 3 (21 tokens x 3 heads), block size 5, window + softcap
    "gqa3-bs5-window-softcap": (dict(order="HND", block_size=5, num_kv_heads=2, group=3, head_size=128,
                                     dtype=torch.float16, query_lens=(25, 1, 4), context_lens=(0, 33, 12),
                                     sliding_window=9, softcap=8.0), 64, 0),
    # GQA 12: two head chunks (12 + 0: one chunk of 12 heads x 5 tokens)
    "gqa12-bs32": (dict(order="NHD", block_size=32, num_kv_heads=1, group=12, head_size=128, dtype=torch.bfloat16,
                        query_lens=(9, 1), context_lens=(5, 20)), 64, 0),
}


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_kernel_matches_reference(hip_backend, name):
    spec, wave, partition = PREFILL_CASES[name]
    _run_case(hip_backend, CaseSpec(**spec), wave=wave, partition_size=partition, prefill_min_query=1)


# fp32 queries over an fp32 or fp8 cache: the same kernel on v_mfma_f32_16x16x4f32 (fp32 operands; fp8 codes
# widened to fp32 when staged), at fp32's tolerance. The cases of PREFILL_CASES that together cover varlen +
# chunked + decode, causal, window, softcap, split-KV, GQA 1 / 4 / 8, block sizes 1 / 16 / 32 / 128 and both
# orders (head 128; the other heads: test_prefill_kernel_fp32_head_sizes_match_the_oracle).
FP32_PREFILL_CASES = ["varlen-chunked-gqa4-bf16", "causal-gqa1-fp16", "window-softcap-gqa1-bs1",
                      "gqa8-bs128-window-split", "gqa12-bs32"]


@pytest.mark.parametrize("cache", ["fp32", *FP8_FORMATS])
@pytest.mark.parametrize("name", FP32_PREFILL_CASES)
def test_prefill_kernel_fp32_queries_match_the_oracle(hip_backend, name, cache):
    spec, wave, partition = PREFILL_CASES[name]
    spec = CaseSpec(**{**spec, "dtype": torch.float32})
    if cache == "fp32":
        assert _mfma_count(hip_backend, spec, wave=wave, partition_size=partition, prefill_min_query=1) > 0
    else:
        per_head = bool(FP32_PREFILL_CASES.index(name) % 2)
        assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[cache], per_head=per_head, wave=wave,
                             partition_size=partition, prefill_min_query=1) > 0


# fp32 MFMAs per wave and key tile: sub-tiles x (QK chunks x 4 k-steps + PV pieces x 8 x 4 k-steps). The
# tiles: 64 keys at head 64, 32 at heads 80 / 96 / 128, 16 at head 256 (K + V of a tile within 32 KiB; rows of
# 20 / 24 chunks take 32 chunks' room).
FP32_PREFILL_TILE = {64: (64, 4 * (4 * 4 + 32)), 80: (32, 2 * (5 * 4 + 32)), 96: (32, 2 * (6 * 4 + 32)),
                     128: (32, 2 * (8 * 4 + 32)), 256: (16, 1 * (16 * 4 + 2 * 32))}


@pytest.mark.parametrize("cache", ["fp32", *FP8_FORMATS])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_prefill_kernel_fp32_takes_the_fp32_mfma(hip_backend, head_size, cache):
    """One causal prompt of 64 tokens, group 1: wave w (rows 16w .. 16w + 15) visits the key tiles up to
    key 16w + 15 -- with KT-key tiles, sum over w of (16w + 15) // KT + 1 wave-tiles, each the table's MFMA
    count, over an fp32 cache and over fp8 codes (the same fp32 tiles). The attention kernel runs no MFMA
    for fp32 queries (every head below the threshold). The oracle checks each run."""
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=1, group=1, head_size=head_size,
                    dtype=torch.float32, query_lens=(64,), context_lens=(0,))
    kt, per_tile = FP32_PREFILL_TILE[head_size]
    want = sum((16 * w + 15) // kt + 1 for w in range(4)) * per_tile
    if cache == "fp32":
        assert _mfma_count(hip_backend, spec, wave=64, partition_size=0) == want
        assert _mfma_count(hip_backend, spec, wave=64, partition_size=0, prefill_min_query=0) == 0
    else:
        assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[cache], per_head=cache == "e4m3") == want
        assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[cache], per_head=True, prefill_min_query=0) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_prefill_kernel_without_mfma_takes_the_fma_engine(hip_backend, dtype):
    """MFMA disabled: the same kernel runs the FMA engine over 16-row slices (its path on targets without
    MFMA)."""
    lib = _mfma_library()
    lib.kvcpu_set_mfma_enabled(0)
    try:
        spec = CaseSpec(order="NHD", block_size=3, num_kv_heads=2, group=8, head_size=128, dtype=dtype,
                        query_lens=(13, 1, 2), context_lens=(7, 60, 30), sliding_window=19, softcap=10.0)
        assert _mfma_count(hip_backend, spec, wave=64, partition_size=0, prefill_min_query=1) == 0
        assert _mfma_count(hip_backend, spec, wave=64, partition_size=16, prefill_min_query=1) == 0
    finally:
        lib.kvcpu_set_mfma_enabled(1)


# fp8 caches through the prefill kernel (codes widened once per tile when staged in LDS): each case of
# PREFILL_CASES over e4m3fn and e5m2, the query dtype and scale kind alternating so each format meets both.
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_kernel_over_fp8_caches_matches_the_oracle(hip_backend, fmt, name):
    spec, wave, partition = PREFILL_CASES[name]
    i = list(PREFILL_CASES).index(name) + list(FP8_FORMATS).index(fmt)
    spec = CaseSpec(**{**spec, "dtype": (torch.float16, torch.bfloat16)[i % 2]})
    assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=bool(i // 2 % 2), wave=wave,
                         partition_size=partition, prefill_min_query=1) > 0


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_kernel_serves_fp8_caches(hip_backend, fmt, dtype):
    """The prefill kernel takes fp8 caches too: the case of
    test_prefill_kernel_is_chosen_by_the_longest_query_and_skips_tiles gives its 9 wave-tiles of 64 MFMAs
    (the decode kernel would count differently); every key order and the oracle agree."""
    spec = CaseSpec(order="NHD", block_size=1, num_kv_heads=1, group=1, head_size=128, dtype=dtype,
                    query_lens=(70, 3), context_lens=(20, 0), sliding_window=33, softcap=8.0)
    assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=True, partition_size=0,
                         prefill_min_query=1) == 9 * 64
    hnd = dataclasses.replace(spec, order="HND", block_size=16)
    assert _run_fp8_case(hip_backend, hnd, FP8_FORMATS[fmt], per_head=False, partition_size=0,
                         prefill_min_query=1) == 9 * 64


# Every head size the launcher compiles runs the prefill kernel (16-bit and fp8 caches). MFMAs per wave and
# 64-key tile (4 sub-tiles of QK chunks x fragments + 8 PV fragments per 16 head dims, padded to 16 lanes):
# head 64: 4 x (4 + 8), 80 / 96: 4 x (6 + 8); head 256 takes 32-key tiles: 2 x (16 + 16).
PREFILL_HEAD_MFMAS = {64: 48, 80: 56, 96: 56, 128: 64, 256: 64}


@pytest.mark.parametrize("head_size", [64, 80, 96, 256])
def test_prefill_kernel_serves_every_head_size(hip_backend, head_size):
    """The case of test_prefill_kernel_is_chosen_by_the_longest_query_and_skips_tiles at each head size: 9
    wave-tiles of 64 keys (head 256: 12 of 32 keys -- token tile 0's waves see 2, 2, 3, 2 tiles, tile 1's
    wave 0 two, the short request one), over the query's cache type and over e4m3 / e5m2 (fp8 at head 64:
    128-key tiles taken as two 64-key steps, each skipped like a 64-key tile; the oracle checks every run)."""
    spec = CaseSpec(order="NHD", block_size=1, num_kv_heads=1, group=1, head_size=head_size,
                    dtype=torch.float16, query_lens=(70, 3), context_lens=(20, 0), sliding_window=33, softcap=8.0)
    want = (12 if head_size == 256 else 9) * PREFILL_HEAD_MFMAS[head_size]
    assert _mfma_count(hip_backend, spec, wave=64, partition_size=0, prefill_min_query=1) == want
    bf16 = dataclasses.replace(spec, dtype=torch.bfloat16, order="HND", block_size=16)
    counts = [_run_fp8_case(hip_backend, bf16, FP8_FORMATS["e4m3"], per_head=True, partition_size=0,
                            prefill_min_query=1),
              _run_fp8_case(hip_backend, spec, FP8_FORMATS["e5m2"], per_head=False, partition_size=0,
                            prefill_min_query=1)]
    for count in counts:
        assert count == want, (head_size, count, want)


# varlen + chunked + decode, GQA 1 / 4 / 8, windows, softcap, split-KV, block sizes 1 / 16 / 32 / 128, both
# orders, at each head size; fp16 / bf16 over their own cache and over fp8.
PREFILL_HEAD_CASES = {
    "varlen-chunked-gqa4-bs16": dict(order="HND", block_size=16, num_kv_heads=2, group=4,
                                     query_lens=(40, 1, 9, 23), context_lens=(0, 30, 50, 70)),
    "causal-window-softcap-gqa1-bs1": dict(order="NHD", block_size=1, num_kv_heads=1, group=1,
                                           query_lens=(70, 3), context_lens=(90, 0), sliding_window=33, softcap=8.0),
    "gqa8-bs128-window": dict(order="HND", block_size=128, num_kv_heads=2, group=8, query_lens=(17, 9),
                              context_lens=(100, 0), sliding_window=50),
    "gqa4-bs32-long": dict(order="NHD", block_size=32, num_kv_heads=1, group=4, query_lens=(81, 2),
                           context_lens=(40, 60)),
}


@pytest.mark.parametrize("head_size", [64, 80, 96, 256])
@pytest.mark.parametrize("name", PREFILL_HEAD_CASES)
def test_prefill_kernel_head_sizes_match_the_oracle(hip_backend, head_size, name):
    i = list(PREFILL_HEAD_CASES).index(name)
    spec = CaseSpec(head_size=head_size, dtype=(torch.float16, torch.bfloat16)[(i + head_size // 16) % 2],
                    **PREFILL_HEAD_CASES[name])
    partition = 32 if name == "gqa8-bs128-window" else 0
    _run_case(hip_backend, spec, wave=64, partition_size=partition, prefill_min_query=1)
    fmt = list(FP8_FORMATS)[i % 2]
    assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=bool(i // 2), partition_size=partition,
                         prefill_min_query=1) > 0


@pytest.mark.parametrize("head_size", [80, 96, 256])
@pytest.mark.parametrize("name", PREFILL_HEAD_CASES)
def test_prefill_kernel_fp32_head_sizes_match_the_oracle(hip_backend, head_size, name):
    """fp32 queries at the heads beyond 64 / 128 (rows of 20 / 24 chunks, head 256's 16-key tiles) over an
    fp32 cache and over fp8 codes (e4m3 / e5m2 alternating, tensor / per-head scales), split-KV in one case;
    every run takes the prefill kernel's MFMA path."""
    i = list(PREFILL_HEAD_CASES).index(name)
    spec = CaseSpec(head_size=head_size, dtype=torch.float32, **PREFILL_HEAD_CASES[name])
    partition = 32 if name == "gqa8-bs128-window" else 0
    assert _mfma_count(hip_backend, spec, wave=64, partition_size=partition, prefill_min_query=1) > 0
    fmt = list(FP8_FORMATS)[(i + head_size // 16) % 2]
    assert _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=bool(i // 2), partition_size=partition,
                         prefill_min_query=1) > 0


# fp8 caches at heads 64 / 80 / 96 (128-key tiles at 64, padded rows at 80 / 96), both formats and both
# query types: each case against the oracle, and the prefill kernel's MFMA count (its 64-key steps) differs
# from the decode kernel's on the same batch.
@pytest.mark.parametrize("head_size", [64, 80, 96])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("name", PREFILL_HEAD_CASES)
def test_prefill_kernel_over_fp8_small_heads_matches_the_oracle(hip_backend, head_size, fmt, name):
    i = list(PREFILL_HEAD_CASES).index(name) + list(FP8_FORMATS).index(fmt)
    spec = CaseSpec(head_size=head_size, dtype=(torch.float16, torch.bfloat16)[(i + head_size // 16) % 2],
                    **PREFILL_HEAD_CASES[name])
    partition = 32 if name == "gqa8-bs128-window" else 0
    prefill = _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=bool(i % 2), partition_size=partition,
                            prefill_min_query=1)
    decode = _run_fp8_case(hip_backend, spec, FP8_FORMATS[fmt], per_head=bool(i % 2), partition_size=partition,
                           prefill_min_query=0)
    assert prefill > 0 and decode > 0 and prefill != decode, (prefill, decode)


PREFILL_POISON_ENGINES = [(torch.float16, "fp16", 64, "mfma"), (torch.bfloat16, "bf16", 64, "mfma"),
                          (torch.bfloat16, "e4m3", 64, "mfma"), (torch.float16, "e5m2", 64, "mfma"),
                          (torch.float16, "e4m3", 64, "mfma"), (torch.bfloat16, "e5m2", 64, "mfma"),
                          (torch.float32, "fp32", 64, "mfma"), (torch.float32, "e4m3", 64, "mfma"),
                          (torch.float32, "e5m2", 64, "mfma"), (torch.float16, "fp16", 32, "wmma"),
                          (torch.bfloat16, "bf16", 32, "wmma"), (torch.bfloat16, "bf16", 32, "fma"),
                          (torch.float32, "fp32", 32, "fma")]


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("scenario", ["mixed", "window"])
@pytest.mark.parametrize("engine", PREFILL_POISON_ENGINES, ids=[f"{e[1]}-w{e[2]}-{e[3]}" for e in PREFILL_POISON_ENGINES])
def test_prefill_unreadable_slots_with_nan_do_not_leak(hip_backend, engine, scenario, head_size):
    """The prefill kernel loads whole 64-key tiles (head 256: 32; fp8 at head 64: 128; WMMA and the FMA tile engine
    (no WMMA for 16-bit caches): 16 - 64): every slot no row may read holds NaN, the output must equal the oracle's
    (finite)."""
    dtype, cache_name, wave, kind = engine
    cache_dtype = POISON_CACHES[cache_name]
    sc = POISON_SCENARIOS[scenario]
    spec = CaseSpec(order="HND" if scenario == "mixed" else "NHD", block_size=16 if scenario == "mixed" else 5,
                    num_kv_heads=2, group=4, head_size=head_size, dtype=dtype, query_lens=sc["query_lens"],
                    context_lens=sc["context_lens"], extra_blocks=2, sliding_window=sc["sliding_window"],
                    softcap=8.0 if scenario == "window" else None, seed=len(scenario))
    layout, cache, md, query, k_scale, v_scale = _poisoned_case(spec, cache_dtype, "nan")
    want = reference.paged_attention(query, cache, layout, md, sliding_window=spec.sliding_window,
                                     softcap=spec.softcap, k_scale=k_scale, v_scale=v_scale)
    wmma, tiles = _wmma_library(), _fma_tile_library()
    wmma.kvcpu_reset_wmma_count()
    tiles.kvcpu_reset_fma_tile_count()
    with _emulated_wmma(0 if kind == "fma" and cache_name in ("fp16", "bf16") else 11):
        out, mfmas = _harness_attention(hip.HipBackend(partition_size=sc["partition"], cpu_wave=wave,
                                                       prefill_min_query=1),
                                        query, cache, layout, md, sliding_window=spec.sliding_window,
                                        softcap=spec.softcap, k_scale=k_scale, v_scale=v_scale)
    assert (mfmas > 0) == (kind == "mfma")
    assert (wmma.kvcpu_wmma_count() > 0) == (kind == "wmma" and head_size <= 128)   # head 256: attention kernel
    assert (tiles.kvcpu_fma_tile_count() > 0) == (kind == "fma" and head_size <= 128)
    assert bool(out.isfinite().all())
    assert_close_to_reference(out, want, dtype, f"prefill {spec} over {cache_name} poisoned with NaN")


# ------------------------------------------------------------------ the prefill kernel's WMMA engine (wave32)
# 16-bit queries at heads up to 128 take paged_prefill_kernel on wave32 through WMMA (gfx11 / gfx12 operand
# layout, as kvcpu_set_wmma_family says; 0: no WMMA, the FMA tile engine serves the step). Its
# tiles: 32 keys (head 128: 16), each wave 16 rows.
def _wmma_library():
    lib = hip.library.load_cpu_library()
    lib.kvcpu_wmma_count.restype = ctypes.c_ulonglong
    lib.kvcpu_set_wmma_family.argtypes = [ctypes.c_int]
    lib.kvcpu_set_wmma_family.restype = ctypes.c_int
    return lib


@contextlib.contextmanager
def _emulated_wmma(family: int):
    """The harness emulating a wave32 device of WMMA layout ``family`` (11, 12; 0: none) inside the block."""
    lib = _wmma_library()
    assert lib.kvcpu_set_wmma_family(family) == 0
    try:
        yield lib
    finally:
        lib.kvcpu_set_wmma_family(11)


def _wmma_count(backend, spec, family: int = 11, cache_dtype=None, per_head: bool = False, **kw) -> int:
    """WMMA instructions of one oracle-checked run at wave 32 (cache_dtype: an fp8 cache)."""
    with _emulated_wmma(family) as lib:
        lib.kvcpu_reset_wmma_count()
        if cache_dtype is None:
            _run_case(backend, spec, wave=32, **kw)
        else:
            _run_fp8_case(backend, spec, cache_dtype, per_head=per_head, wave=32, **kw)
        return lib.kvcpu_wmma_count()


# WMMAs per wave and key tile: 16-key sub-tiles x (QK steps + PV steps) = sub-tiles x 2 x head / 16.
WMMA_PREFILL_TILE = {64: (32, 2 * 2 * 4), 80: (32, 2 * 2 * 5), 96: (32, 2 * 2 * 6), 128: (16, 2 * 8)}


@pytest.mark.parametrize("family", [11, 12])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
def test_prefill_kernel_wave32_takes_wmma(hip_backend, head_size, family):
    """One causal prompt of 64 tokens, group 1: wave w (rows 16w .. 16w + 15) visits the key tiles up to key
    16w + 15, each the table's WMMA count; the decode kernel (threshold 0) and the harness without WMMA run
    none. The oracle checks each run."""
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=1, group=1, head_size=head_size,
                    dtype=(torch.float16, torch.bfloat16)[head_size // 16 % 2], query_lens=(64,), context_lens=(0,))
    kt, per_tile = WMMA_PREFILL_TILE[head_size]
    want = sum((16 * w + 15) // kt + 1 for w in range(4)) * per_tile
    assert _wmma_count(hip_backend, spec, family, partition_size=0) == want
    if family == 11:
        assert _wmma_count(hip_backend, spec, family, partition_size=0, prefill_min_query=0) == 0
        assert _wmma_count(hip_backend, spec, 0, partition_size=0) == 0
        with _mfma_library_counting() as mfma:
            _run_case(hip_backend, spec, wave=32, partition_size=0)
            assert mfma.kvcpu_mfma_count() == 0


@contextlib.contextmanager
def _mfma_library_counting():
    lib = _mfma_library()
    lib.kvcpu_reset_mfma_count()
    yield lib


# Each case of PREFILL_CASES at wave 32: gfx11's layout on every case, gfx12's and no WMMA (the attention
# kernel) on every other one.
WAVE32_PREFILL_RUNS = [(name, 11) for name in PREFILL_CASES] + [(name, (0, 12)[i % 2])
                                                                  for i, name in enumerate(PREFILL_CASES)]


@pytest.mark.parametrize("name, family", WAVE32_PREFILL_RUNS, ids=[f"{n}-{f}" for n, f in WAVE32_PREFILL_RUNS])
def test_prefill_kernel_wave32_matches_reference(hip_backend, name, family):
    spec, _, partition = PREFILL_CASES[name]
    count = _wmma_count(hip_backend, CaseSpec(**spec), family, partition_size=partition, prefill_min_query=1)
    assert (count > 0) == (family != 0), count


# What the WMMA engine does not serve on wave32 (no WMMA, the oracle checks): fp32 queries take the prefill
# kernel's FMA tile engine (launcher.hip's prefill_served), fp8 caches and head 256 the attention kernel.
@pytest.mark.parametrize("family", [11, 12])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_prefill_wave32_without_wmma_elsewhere(hip_backend, fmt, family):
    i = list(FP8_FORMATS).index(fmt) + family
    spec = CaseSpec(head_size=128, dtype=(torch.float16, torch.bfloat16)[i % 2],
                    **PREFILL_HEAD_CASES[list(PREFILL_HEAD_CASES)[i % len(PREFILL_HEAD_CASES)]])
    tiles = _fma_tile_library()
    tiles.kvcpu_reset_fma_tile_count()
    assert _wmma_count(hip_backend, dataclasses.replace(spec, dtype=torch.float32), family, partition_size=0,
                       prefill_min_query=1) == 0
    assert tiles.kvcpu_fma_tile_count() > 0
    tiles.kvcpu_reset_fma_tile_count()
    assert _wmma_count(hip_backend, spec, family, cache_dtype=FP8_FORMATS[fmt], per_head=bool(i % 2),
                       partition_size=0, prefill_min_query=1) == 0
    assert _wmma_count(hip_backend, dataclasses.replace(spec, head_size=256), family, partition_size=0,
                       prefill_min_query=1) == 0
    assert _wmma_count(hip_backend, spec, family, partition_size=0, prefill_min_query=1) > 0
    assert tiles.kvcpu_fma_tile_count() == 0


# ------------------------------------------------------------------ the prefill kernel's FMA tile engine
# Where no matrix instruction serves a prefill step (wave32 without WMMA, fp32 queries on wave32, wave64 with MFMA
# disabled), paged_prefill_kernel runs its FMA tile engine at heads up to 128 over a cache of the query's type
# (hip/kvmulti_prefill_fma.hip): the work-group's 64 rows share each K/V tile in LDS, a wave skips the tiles none
# of its 16 rows sees. The harness counts the tiles the waves compute.
def _fma_tile_library():
    lib = hip.library.load_cpu_library()
    lib.kvcpu_fma_tile_count.restype = ctypes.c_ulonglong
    return lib


def _fma_tiles(backend, spec, family: int = 0, wave: int = 32, cache_dtype=None, **kw) -> int:
    """FMA tiles of one oracle-checked run (WMMA layout ``family``, 0: none; wave64: MFMA disabled)."""
    lib, mfma = _fma_tile_library(), _mfma_library()
    lib.kvcpu_reset_fma_tile_count()
    mfma.kvcpu_set_mfma_enabled(0)
    try:
        with _emulated_wmma(family):
            if cache_dtype is None:
                _run_case(backend, spec, wave=wave, **kw)
            else:
                _run_fp8_case(backend, spec, cache_dtype, per_head=False, wave=wave, **kw)
    finally:
        mfma.kvcpu_set_mfma_enabled(1)
    return lib.kvcpu_fma_tile_count()


def test_fma_tile_engine_skips_the_tiles_a_wave_does_not_see(hip_backend):
    """One 64-token causal prompt, group 1, head 128: wave w's rows (tokens 16 w .. 16 w + 15) see keys up to
    16 w + 15. 16-key tiles (a 16-bit cache on wave32): wave w computes tiles 0 .. w, 10 in all; 8-key tiles
    (fp32): tiles 0 .. 2 w + 1, 20; 32-key tiles (16-bit on wave64): waves 0, 1 one tile, waves 2, 3 two, 6.
    An fp8 cache keeps the attention kernel."""
    one = CaseSpec(order="HND", block_size=16, num_kv_heads=1, group=1, head_size=128, dtype=torch.bfloat16,
                   query_lens=(64,), context_lens=(0,))
    assert _fma_tiles(hip_backend, one, partition_size=0, prefill_min_query=1) == 10
    assert _fma_tiles(hip_backend, dataclasses.replace(one, dtype=torch.float32), family=11, partition_size=0,
                      prefill_min_query=1) == 20
    assert _fma_tiles(hip_backend, one, wave=64, partition_size=0, prefill_min_query=1) == 6
    assert _fma_tiles(hip_backend, one, family=11, cache_dtype=torch.float8_e4m3fn, partition_size=0,
                      prefill_min_query=1) == 0
    assert _fma_tiles(hip_backend, one, partition_size=0, prefill_min_query=0) == 0   # the decode kernel


@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
@pytest.mark.parametrize("name", PREFILL_HEAD_CASES)
def test_fma_tile_engine_matches_the_oracle(hip_backend, head_size, name):
    """Every case at every head the engine serves: a 16-bit cache on wave32 without WMMA and on wave64 without
    MFMA, and fp32; split-KV in one case. Over fp8 codes (formats alternating) the attention kernel serves the
    same steps."""
    i = list(PREFILL_HEAD_CASES).index(name)
    spec = CaseSpec(head_size=head_size, dtype=(torch.float16, torch.bfloat16)[(i + head_size // 16) % 2],
                    **PREFILL_HEAD_CASES[name])
    kw = dict(partition_size=32 if name == "gqa8-bs128-window" else 0, prefill_min_query=1)
    assert _fma_tiles(hip_backend, spec, **kw) > 0
    assert _fma_tiles(hip_backend, spec, wave=64, **kw) > 0
    assert _fma_tiles(hip_backend, dataclasses.replace(spec, dtype=torch.float32), family=11, **kw) > 0
    fmt = list(FP8_FORMATS)[(i + head_size // 16) % len(FP8_FORMATS)]
    assert _fma_tiles(hip_backend, spec, family=11, cache_dtype=FP8_FORMATS[fmt], **kw) == 0
