"""The roofline model (devtools/roofline.py) on synthetic loop mixes: each bound is named when it is
the one that limits, fractions stay below 1, and no estimate beats the cited DRAM efficiency."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # devtools/ lives at the repo root
from devtools import roofline as R  # noqa: E402

MI300X = R.TARGETS["gfx942"]
KV_BYTES = 32 * 4096 * 8 * 128 * 2 * 2          # the decode case's K/V: 537 MB
ITER_BYTES = 32 * 2 * 128 * 2                   # 32 keys of K and V at head 128, bf16


def decode_launch(**changes) -> R.KernelLaunch:
    """A decode-shaped launch on MI300X: 2048 programs of 4 waves, 16 iterations of 16 KiB each,
    4 iterations' loads in flight, a lean loop (2 % more DRAM bytes than the K/V: queries, tables)."""
    base = dict(kernel="synthetic", target="gfx942", case="decode", programs=2048, waves_per_program=4,
                iterations=16, loop=R.LoopMix({"valu": 20, "salu": 4, "vmem": 8, "mfma": 2}, ITER_BYTES,
                                              {"mfma": 2 * 16 * 32 * 128 * 2}),
                resident_per_unit=8, bytes_in_flight=4 * ITER_BYTES, dram_bytes=KV_BYTES * 1.02,
                useful_bytes=KV_BYTES, useful_flops=0.0)
    base.update(changes)
    return R.KernelLaunch(**base)


def test_memory_bound_loop_is_named_memory():
    e = R.estimate(decode_launch(), MI300X)
    assert e.bound == "memory"
    assert e.bounds["memory"] > 10 * max(e.bounds["issue"], e.bounds["latency"], e.bounds["grid"])
    assert e.fraction == pytest.approx(1 / 1.02) and e.fraction < 1


def test_issue_bound_loop_is_named_issue_and_its_pipe():
    launch = decode_launch(loop=R.LoopMix({"valu": 2000, "salu": 4, "vmem": 8}, ITER_BYTES))
    e = R.estimate(launch, MI300X)
    assert e.bound == "issue" and max(e.issue_pipes, key=e.issue_pipes.get) == "valu"
    assert 0 < e.fraction < 0.5
    # 2048 x 4 waves x 16 iterations over 1216 SIMDs, 2000 VALU x 4 cycles each, at 2.1 GHz
    assert e.bounds["issue"] == pytest.approx(2048 * 4 * 16 / 1216 * 2000 * 4 / 2.1e9)


def test_latency_bound_loop_is_named_latency():
    e = R.estimate(decode_launch(bytes_in_flight=1024), MI300X)
    assert e.bound == "latency"
    # Little's law: 2048 resident programs x 1 KiB in flight per 800 ns
    assert e.bounds["latency"] == pytest.approx(2048 * 16 * ITER_BYTES * 800e-9 / (2048 * 1024))
    assert 0 < e.fraction < 1


def test_grid_tail_is_named_grid():
    # one program more than the device holds: a second round of whole programs
    slots = MI300X.units * 8
    launch = decode_launch(programs=slots + 1, bytes_in_flight=1024, dram_bytes=(slots + 1) * 16 * ITER_BYTES,
                           useful_bytes=(slots + 1) * 16 * ITER_BYTES)
    e = R.estimate(launch, MI300X)
    assert e.bound == "grid"
    assert e.bounds["grid"] == pytest.approx(2 * e.bounds["latency"], rel=1e-3)
    assert 0 < e.fraction < 1


def test_second_launch_adds_to_every_bound():
    one = R.estimate(decode_launch(), MI300X)
    two = R.estimate(decode_launch(second_launch_bytes=10e6), MI300X)
    extra = 10e6 / MI300X.bandwidth + MI300X.launch_gap_s
    assert two.second_launch_s == pytest.approx(extra)
    for b in R.BOUNDS:
        assert two.bounds[b] == pytest.approx(one.bounds[b] + extra)
    assert two.fraction < one.fraction


def test_matrix_and_vector_pipes_issue_in_parallel():
    """The issue bound is the busiest pipe, not the sum: MFMA of some waves overlaps VALU of others."""
    flops = 8 * 16 * 16 * 16 * 2
    only_valu = R.LoopMix({"valu": 100}, ITER_BYTES)
    only_mfma = R.LoopMix({"mfma": 8}, ITER_BYTES, {"mfma": 4 * flops})
    both = R.LoopMix({"valu": 100, "mfma": 8}, ITER_BYTES, {"mfma": 4 * flops})
    t = {name: R.issue_pipes(decode_launch(loop=mix), MI300X) for name, mix in
         (("valu", only_valu), ("mfma", only_mfma), ("both", both))}
    # an MFMA takes one VALU issue slot (4 cycles) on CDNA; its 16-cycle pass runs beside the VALU
    assert t["both"]["valu"] == pytest.approx(t["valu"]["valu"] * (100 + 8) / 100)
    assert t["both"]["mfma"] == pytest.approx(t["mfma"]["mfma"])
    assert max(t["both"].values()) < t["valu"]["valu"] + t["mfma"]["mfma"]


def test_prefill_is_judged_against_the_matrix_peak():
    flops = 4 * 64 * 64 * 128            # QK^T and P.V of a 64 x 64 tile at head 128
    useful = 1e12
    iterations = useful / (4096 * flops)
    launch = decode_launch(case="prefill", programs=4096, iterations=iterations,
                           loop=R.LoopMix({"valu": 40, "mfma": 64, "lds": 16, "vmem": 8}, 64 * 256 * 2,
                                          {"mfma": flops}),
                           useful_flops=useful, useful_bytes=0.0, dram_bytes=1e9)
    e = R.estimate(launch, MI300X)
    assert e.judged_against == "matrix peak" and e.bound == "issue"
    assert max(e.issue_pipes, key=e.issue_pipes.get) == "mfma"
    assert e.fraction == pytest.approx(1.0, rel=1e-6)      # all executed flops useful, matrix pipe bound
    # the same loop with four times the VALU work: the vector pipe limits it
    slow = R.estimate(dataclasses.replace(launch, loop=dataclasses.replace(
        launch.loop, instructions={"valu": 700, "mfma": 64, "lds": 16, "vmem": 8})), MI300X)
    assert slow.bound == "issue" and max(slow.issue_pipes, key=slow.issue_pipes.get) == "valu"
    assert slow.fraction < 0.5


def test_inconsistent_inputs_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        R.estimate(decode_launch(loop=R.LoopMix({"wgmma": 1}, ITER_BYTES)), MI300X)
    with pytest.raises(ValueError, match="without their flops"):
        R.estimate(decode_launch(loop=R.LoopMix({"mfma": 8}, ITER_BYTES)), MI300X)
    with pytest.raises(ValueError, match="useful"):
        R.estimate(decode_launch(dram_bytes=KV_BYTES / 2), MI300X)
    with pytest.raises(ValueError, match="matrix peak"):    # claims more useful flops than it executes
        R.estimate(decode_launch(case="prefill", useful_flops=1e15), MI300X)


def test_every_target_cites_its_figures():
    for t in R.TARGETS.values():
        assert 0 < t.dram_efficiency <= 1 and t.dram_efficiency_source and t.latency_source and t.sources
        assert set(t.matrix_rate) and all(0 < r <= 1 for r in t.matrix_rate.values())
        assert t.bandwidth == pytest.approx(t.peak_bandwidth * t.dram_efficiency)


@settings(max_examples=examples(300), deadline=None)
@given(target=st.sampled_from(sorted(R.TARGETS)), programs=st.integers(1, 20000), waves=st.sampled_from([1, 2, 4, 8]),
       iterations=st.floats(1, 4096), alu=st.integers(0, 5000), extra=st.floats(1.0, 3.0),
       resident=st.integers(1, 16), in_flight=st.floats(64, 1 << 20), second=st.floats(0, 1e8),
       case=st.sampled_from(R.CASES), matrix_share=st.floats(0.01, 1.0))
def test_no_estimate_beats_the_cited_dram_efficiency_or_the_matrix_peak(target, programs, waves, iterations, alu,
                                                                         extra, resident, in_flight, second, case,
                                                                         matrix_share):
    t = R.TARGETS[target]
    alu_class = "valu" if t.vendor == "amd" else "alu"
    matrix = next(iter(t.matrix_rate))
    executed = programs * iterations * 1e6
    useful_bytes = programs * iterations * ITER_BYTES
    launch = R.KernelLaunch(
        kernel="random", target=target, case=case, programs=programs, waves_per_program=waves, iterations=iterations,
        loop=R.LoopMix({alu_class: alu, matrix: 4}, ITER_BYTES, {matrix: 1e6}), resident_per_unit=resident,
        bytes_in_flight=in_flight, dram_bytes=useful_bytes * extra, useful_bytes=useful_bytes,
        useful_flops=executed * matrix_share * t.matrix_rate[matrix], second_launch_bytes=second)
    e = R.estimate(launch, t)
    assert 0 < e.fraction <= 1 + 1e-12
    assert e.time_s == max(e.bounds.values()) and e.bounds[e.bound] == pytest.approx(e.time_s, rel=1e-9)
    # the bandwidth the estimate implies never exceeds peak x the cited efficiency
    assert useful_bytes / e.time_s <= t.peak_bandwidth * t.dram_efficiency * (1 + 1e-9)
    assert launch.useful_flops / e.time_s <= t.matrix_peak * (1 + 1e-9)


def test_the_serial_part_of_a_loop_follows_its_loads_round_trip():
    """Without a tile in flight across the loop head, a wave's iteration is its loads' round trip
    followed by its instructions: the latency bound grows by the stream, and can become the limit."""
    busy = R.LoopMix({"valu": 600, "salu": 50, "vmem": 16}, ITER_BYTES)
    # one one-wave program per CU: 304 resident programs, 7 full rounds of them
    n = 7 * 304
    launch = decode_launch(loop=busy, bytes_in_flight=ITER_BYTES, waves_per_program=1, resident_per_unit=1,
                           programs=n, dram_bytes=n * 16 * ITER_BYTES, useful_bytes=n * 16 * ITER_BYTES)
    overlapped = R.estimate(launch, MI300X)
    drained = R.estimate(dataclasses.replace(launch, serial_share=1.0), MI300X)
    stream = 666 * 4 / MI300X.clock_hz
    assert drained.bounds["latency"] == pytest.approx(overlapped.bounds["latency"] + n * 16 * stream / 304)
    assert drained.bounds["issue"] == overlapped.bounds["issue"]
    assert drained.bound == "latency" and overlapped.bound == "issue"
    half = R.estimate(dataclasses.replace(launch, serial_share=0.5), MI300X)
    assert half.bounds["latency"] == pytest.approx(overlapped.bounds["latency"] + n * 16 * stream / 2 / 304)


def test_exiting_programs_hold_slots():
    slots = MI300X.units * 8
    full = decode_launch(bytes_in_flight=1024, programs=slots, dram_bytes=slots * 16 * ITER_BYTES,
                         useful_bytes=slots * 16 * ITER_BYTES)
    e0 = R.estimate(full, MI300X)
    e1 = R.estimate(dataclasses.replace(full, exiting_programs=6144, exit_s=3e-6), MI300X)
    assert e1.bounds["grid"] == pytest.approx(e0.bounds["grid"] + 6144 * 3e-6 / slots)
    assert e1.bounds["latency"] == pytest.approx(e0.bounds["latency"] + 6144 * 3e-6 / slots)
    # with free slots (fewer programs than slots) the exiting ones fill those first
    part = R.estimate(decode_launch(bytes_in_flight=1024, exiting_programs=100, exit_s=3e-6), MI300X)
    assert part.bounds["latency"] == R.estimate(decode_launch(bytes_in_flight=1024), MI300X).bounds["latency"]
    assert e1.bounds["memory"] == e0.bounds["memory"] and e1.bounds["issue"] == e0.bounds["issue"]


# ------------------------------------------------------------------------- evidence the adapters read
def test_hip_serial_share_reads_which_instructions_wait_for_this_trips_loads():
    from devtools import hip_compile_check as cc
    drained = ["global_load_dwordx4 v[0:3], v[8:9], off", "v_add_u32 v9, v9, v10", "s_waitcnt vmcnt(0)",
               "v_mfma_f32_16x16x16bf16_1k v[0:3], v[0:1], v[2:3], v[0:3]", "v_exp_f32 v1, v1", "s_add_u32 s0, s0, 1"]
    # the next trip's load is issued before this trip's work, which waits only for the older one
    pipelined = ["s_waitcnt vmcnt(1)", "v_mfma_f32_16x16x16bf16_1k v[0:3], v[0:1], v[2:3], v[0:3]",
                 "global_load_dwordx4 v[4:7], v[8:9], off", "v_exp_f32 v1, v1", "s_add_u32 s0, s0, 1"]
    assert cc.serial_share(drained) == pytest.approx(3 / 5)     # the MFMA, exp and scalar add wait
    assert cc.serial_share(pipelined) == 0.0
    assert cc.mfma_flops(drained + ["v_mfma_f32_32x32x8bf16_1k a[0:15], v[0:1], v[2:3], a[0:15]"]) == \
        2 * 16 * 16 * 16 + 2 * 32 * 32 * 8


def test_triton_sass_loop_classes():
    from devtools import triton_cross_compile as xc
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;",
        "        /*0020*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8], R24 ;",
        "        /*0030*/                   MUFU.EX2 R5, R5 ;",
        "        /*0040*/                   FFMA R6, R5, R7, R6 ;",
        "        /*0050*/                   LDS.128 R8, [R9] ;",
        "        /*0060*/              @!P0 BRA 0x10 ;",
        "        /*0070*/                   EXIT ;"])
    assert xc._sass_loop_mix(sass) == {"ldg": 1, "wgmma": 1, "sfu": 1, "alu": 1, "lds": 1, "branch": 1}


def test_sycl_hot_loop_and_its_loads_in_flight():
    from devtools import sycl_gpu_evidence as G
    asm = "\n".join([
        "        mov (16|M0)              r2.0<1>:d     0:w",
        "_0_10:",
        "        load.ugm.d32x4.a64 (16|M0)  r8:4        [r2:2]             {I@1,$5} // $1",
        "        load.ugm.d32x4.a64 (16|M0)  r12:4       [r2:2]             {I@1,$6} // $2",
        "        mad (16|M0)              r20.0<1>:f    r8.0<1;0>:f   r9.0<1;0>:f   r10.0<1;0>:f {$5.dst} // $3",
        "        mul (32|M0)              r22.0<1>:f    r12.0<1;1,0>:f   r13.0<1;1,0>:f {$6.dst} // $4",
        "        math.exp (16|M0)         r24.0<1>:f    r22.0<1;1,0>:f // $5",
        "(W&f0.0) jmpi                                _0_10                                   // $6",
    ])
    mix, load_bytes, in_flight, flops = G.hot_loop_mix(asm)
    assert mix == {"send": 2, "alu": 3, "math": 1, "branch": 1}      # the SIMD32 mul counts 2
    assert load_bytes == 512 and in_flight == 512 and flops == 0
    # an 8-deep, 8-row dpas at SIMD16: 8 x 16 x 16 bf16 multiply-accumulates
    assert G.dpas_flops(["dpas.8x8 (16|M0)  r10:f  r10:f  r20:bf  r30.0:bf {Atomic}"]) == 2 * 8 * 16 * 16


# ------------------------------------------------------------------------------------------ adapters
HIP_ROW = dict(kind="attention", dtype="bf16", cache=None, head_size=128, target="gfx942", wave=64,
               kernel="paged_attention<bf16,128,wave64>", matrix_instructions=64, waves_per_simd=2,
               hot_loop_instructions={"mfma": 32, "valu": 806, "salu": 113, "lds": 16, "vmem": 16},
               bytes_in_flight_per_lane=192, hot_loop_serial_share=0.67, hot_loop_mfma_flops=32 * 8192)


def test_hip_adapter_launch_shapes():
    from devtools import roofline_hip as H
    decode = H.launch(HIP_ROW, R.DECODE)
    # 32 tokens x 8 KV heads x 8 partitions of 512 keys; a wave takes 128 keys: 4 tiles of 32
    assert (decode.programs, decode.iterations, decode.exiting_programs) == (2048, 4, 0)
    assert decode.resident_per_unit == 2 and decode.bytes_in_flight == 192 * 64 * 4
    assert decode.second_launch_bytes > 0
    prefill = H.launch(HIP_ROW, R.PREFILL)
    # 4-token tiles of 16 rows: 3 of every 4 blocks of the (tokens, KV heads) grid exit
    assert prefill.programs == 8 * 512 * 8 and prefill.exiting_programs == 3 * prefill.programs
    assert prefill.second_launch_bytes == 0 and prefill.loop.matrix_flops["mfma"] == 4 * 32 * 8192


def test_todays_hip_prefill_figures_are_issue_bound_under_a_quarter_of_mi300x_peak():
    """The decode kernel serving prefill, with the gfx940 hot-loop figures it shipped with (for MI300X)."""
    from devtools import roofline_hip as H
    e = R.estimate(H.launch(HIP_ROW, R.PREFILL), MI300X)
    assert e.bound == "issue" and max(e.issue_pipes, key=e.issue_pipes.get) == "valu"
    assert 0 < e.fraction < 0.25


def test_hip_prefill_from_the_compiler_is_issue_bound_under_a_quarter_of_mi300x_peak():
    """The same from clang-19's gfx942 assembly of today's kernels (CI has clang-19; elsewhere it skips)."""
    import os
    from devtools import hip_compile_check as cc
    from devtools import roofline_hip as H
    if cc.clang() is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("clang-19 missing (CI=true: this check must run)")
        pytest.skip("clang-19 missing (Debian: apt-get install clang-19)")
    rows = [r for r in cc.report_rows(archs=("gfx942",)) if r["target"] == "gfx942" and r["kind"] == "attention"
            and r["dtype"] == "bf16" and not r["cache"] and r["head_size"] == 128 and "prefill" not in r["symbol"]]
    assert len(rows) == 1
    e = R.estimate(H.launch(rows[0], R.PREFILL), MI300X)
    assert e.bound == "issue" and 0 < e.fraction < 0.25, e.row()


def test_triton_adapter_launch_shapes():
    from devtools import roofline_triton as T
    row = dict(target="sm_90", spec="model_decode_sm_90", kernel="unified_attention", num_warps=4, num_stages=3,
               occupancy=3, kv_tiles_in_flight_at_dot=1.0, prefetched_tile=False, hot_loop_serial_share=None,
               constexprs=dict(BLOCK_M="16", BLOCK_Q="4", TILE_N="64", HEAD_PAD="128", HEAD_PAD_V="128",
                               SPLIT="False", PART_SIZE="16"),
               hot_loop_instructions={"alu": 441, "mma": 32, "ldg": 22, "lds": 35, "sfu": 10, "branch": 9})
    decode = T.launch(row, R.DECODE)
    assert (decode.programs, decode.iterations) == (32 * 8, 4096 / 64)
    assert decode.serial_share == 0.0 and decode.bytes_in_flight == 64 * 256 * 2
    assert decode.loop.matrix_flops == {"mma": 4 * 16 * 64 * 128}
    assert T.pick_rows([row], R.DECODE) == [row] and T.pick_rows([row], R.PREFILL) == []
    e = R.estimate(decode, R.TARGETS["sm_90"])
    assert e.bound == "memory" and 0 < e.fraction <= 1


def test_sycl_adapter_launch_shapes():
    from devtools import roofline_sycl as S
    row = dict(kernel="kvm_paged_attention", target="pvc", regs_or_grf_mode="256 GRF", spills=0,
               slm_bytes=33280, simd_width=16, matrix_instructions=16, hot_loop_load_bytes=12352,
               hot_loop_bytes_in_flight=256, hot_loop_dpas_flops=65536,
               hot_loop_instructions={"alu": 2754, "send": 145, "math": 96, "branch": 196, "dpas": 16})
    decode = S.launch(row, R.DECODE)
    # 32 tiles x 8 KV heads x 8 partitions; one row group: 8 sub-groups split 512 keys in 16-key steps
    assert (decode.programs, decode.iterations, decode.resident_per_unit) == (2048, 4, 3)
    assert decode.loop.matrix_flops == {"dpas": 8 * 65536}
    prefill = S.launch(row, R.PREFILL)
    # 64-row tiles (16 tokens x 4 heads) = 8 row groups, one per sub-group; the last one sees 16 t + 16 keys
    assert prefill.programs == 8 * 128 * 8 and prefill.second_launch_bytes == 0
    assert prefill.iterations == pytest.approx(sum(t + 1 for t in range(128)) / 128)
    # the host launches kvm_paged_prefill for these tiles: 4 row groups of 16 rows, each split over 2
    # sub-groups; the last row group (tokens 12-15 of tile t) sees 16 t + 16 keys, in 32-key strides
    assert S.kernel_for(R.PREFILL) == "kvm_paged_prefill" and S.kernel_for(R.DECODE) == "kvm_paged_attention"
    assert [S.prefill_splits(rgp) for rgp in (1, 2, 3, 4, 8)] == [5, 3, 2, 2, 1]
    wide = S.launch(dict(row, kernel="kvm_paged_prefill", hot_loop_dpas_flops=131072), R.PREFILL)
    assert wide.programs == 8 * 128 * 8
    assert wide.iterations == pytest.approx(sum(math.ceil((16 * t + 16) / 32) for t in range(128)) / 128)
    assert wide.loop.matrix_flops == {"dpas": 8 * 131072}
    assert [l.kernel for l in S.launches([row, dict(row, kernel="kvm_paged_prefill")], R.PREFILL)] == \
        ["sycl kvm_paged_prefill (pvc)"]


def test_list_schedule_takes_programs_in_order():
    assert R.list_schedule([1.0] * 8, 4) == 2.0
    assert R.list_schedule([1.0, 1.0, 1.0, 4.0], 2) == 5.0       # the longest last: a tail
    assert R.list_schedule([4.0, 1.0, 1.0, 1.0], 2) == 4.0       # the longest first
    assert R.list_schedule([3.0], 8) == 3.0


def test_grid_bound_takes_program_iterations_and_prologue():
    its = tuple([4] * 1023 + [64])                    # one long program, dispatched last
    plain = decode_launch(programs=1024, iterations=sum(its) / len(its))
    ordered = dataclasses.replace(plain, program_iterations=its)
    e0, e1 = R.estimate(plain, MI300X), R.estimate(ordered, MI300X)
    assert e1.bounds["grid"] > e0.bounds["grid"]
    e2 = R.estimate(dataclasses.replace(ordered, prologue_s=1e-6), MI300X)
    assert e2.bounds["grid"] > e1.bounds["grid"]
    with pytest.raises(ValueError, match="program_iterations"):
        R.estimate(dataclasses.replace(plain, program_iterations=(1, 2)), MI300X)


def test_lockstep_matrix_waits_for_the_programs_waves_on_a_port():
    h200 = R.H200
    loop = R.LoopMix({"alu": 100, "wgmma": 12}, 32768, {"wgmma": 4 * 128 * 64 * 128})
    base = dict(kernel="synthetic", target="sm_90", case="prefill", programs=1, iterations=1, loop=loop,
                resident_per_unit=1, bytes_in_flight=32768, dram_bytes=1.0, useful_bytes=0.0, useful_flops=0.0)
    free = R.KernelLaunch(waves_per_program=8, **base)
    locked = dataclasses.replace(free, lockstep_matrix=True)
    matrix = lambda ln: R.wave_stream(ln.loop, ln, h200) - 100 / h200.clock_hz   # noqa: E731
    assert matrix(locked) == pytest.approx(2 * matrix(free))              # 2 warps per sub-partition
    four = R.KernelLaunch(waves_per_program=4, **base)
    assert matrix(dataclasses.replace(four, lockstep_matrix=True)) == pytest.approx(matrix(four))
