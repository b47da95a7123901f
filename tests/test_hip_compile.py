"""Compile check of every HIP kernel instantiation for AMD (hipcc: gfx90a, gfx940, gfx1030; clang-19
without device libraries: gfx942, gfx1100, gfx1201 -- -Werror, no register spills / scratch, no
device-library call) and NVIDIA (sm_80, sm_90 through hip/compat) -- devtools/hip_compile_check.py.
The gate checks gfx942, gfx1100 and sm_90 (tests/tiers.py); the exhaustive tier every target.

Outside CI a missing compiler skips with the reason; with CI=true it FAILS (the README's test command
installs hipcc and clang-19; nvcc comes from PyPI)."""

from __future__ import annotations

import ctypes
import os

import pytest

from devtools import hip_compile_check as cc
from kvmulti.backends import hip

IN_CI = os.environ.get("CI", "").lower() == "true"


def _require(amd: bool, nvidia: bool) -> None:
    missing = cc.missing_tools(amd=amd, nvidia=nvidia)
    if missing:
        msg = "compile check needs " + ", ".join(missing)
        if IN_CI:
            pytest.fail(msg + " (CI=true: this check must run)")
        pytest.skip(msg)


def test_amd_targets_compile_werror_without_spills(tmp_path):
    _require(amd=True, nvidia=False)
    report = cc.run(amd=True, nvidia=False, out=tmp_path)
    assert report.ok, report.summary()
    # The hipcc-built library exports the C ABI the backend binds (no GPU needed for these calls).
    lib = hip.library._bind(ctypes.CDLL(str(tmp_path / cc.AMD_LIBRARY)), harness=False)
    ps, parts = ctypes.c_int(), ctypes.c_int()
    assert lib.kvmulti_hip_plan(4, 8, 2, 100, 16, ctypes.byref(ps), ctypes.byref(parts)) == 0
    assert (ps.value, parts.value) == (16, 7)
    assert lib.kvmulti_hip_wave_size(64) == 64 and lib.kvmulti_hip_wave_size(32) == 32
    sizes = (ctypes.c_int * 8)()
    count = lib.kvmulti_hip_head_sizes(sizes, 8)
    assert list(sizes)[:count] == list(hip.HEAD_SIZES)
    names = " ".join(r.name for r in report.results)
    for arch in cc.amd_archs():
        assert arch in names
    passes = [r for r in report.results if "device pass" in r.name]
    assert len(passes) == len(cc.amd_archs()) and all(r.kernels == cc.EXPECTED_KERNELS for r in passes)


def test_nvidia_targets_compile_through_compat_header():
    _require(amd=False, nvidia=True)
    report = cc.run(amd=False, nvidia=True)
    assert report.ok, report.summary()
    assert [r.kernels for r in report.results] == [cc.EXPECTED_KERNELS] * len(cc.nvidia_archs())


def test_device_pass_cache_key_follows_sources_flags_and_compiler(tmp_path, monkeypatch):
    """A kept device pass is found again only for the same launcher source, the same headers and .hip files
    under the HIP folder, the same flags and the same hipcc (--version)."""
    hip_dir = tmp_path / "hip"
    (hip_dir / "sub").mkdir(parents=True)
    source, header = hip_dir / "launcher.hip", hip_dir / "sub" / "tile.h"
    source.write_text("kernels")
    header.write_text("tile 64")
    monkeypatch.setenv("KVMULTI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cc, "HIP_DIR", hip_dir)
    monkeypatch.setattr(cc, "SOURCE", source)
    monkeypatch.setattr(cc, "_compiler_version", lambda arch="gfx90a": "clang version 15")
    flags = ["-O3", "--offload-arch=gfx940", "-S"]
    base = cc._device_pass_cache(flags)
    assert base.parent == tmp_path / "cache" / "hip_check" and base == cc._device_pass_cache(list(flags))
    header.write_text("tile 128")
    assert cc._device_pass_cache(flags) != base
    header.write_text("tile 64")
    source.write_text("kernels, one more")
    assert cc._device_pass_cache(flags) != base
    source.write_text("kernels")
    assert cc._device_pass_cache(flags) == base
    assert cc._device_pass_cache(["-O3", "--offload-arch=gfx90a", "-S"]) != base
    monkeypatch.setattr(cc, "_compiler_version", lambda arch="gfx90a": "clang version 16")
    assert cc._device_pass_cache(flags) != base


def test_open_problems_are_reported_and_closed_ones_fail(monkeypatch):
    """A problem OPEN_PROBLEMS lists for the row's target and kernel kind is open, not failing; any other
    fails; an open entry that no row shows any longer fails too."""
    row = _row(target="gfx942", spills=3)
    assert cc.problem_kind(cc.row_problems(row)[0]) == "spills"
    monkeypatch.setattr(cc, "OPEN_PROBLEMS", {("gfx942", "spills", "attention"): "why"})
    assert cc.open_problems(row) and cc.failing_problems(row) == []
    assert cc.failing_problems(dict(row, kind="prefill")) != []              # another kernel kind
    assert cc.failing_problems(dict(row, target="gfx90a")) != []             # another target
    assert cc.failing_problems(dict(row, bytes_in_flight_per_lane=16)) != []  # another kind of problem
    failures, opened = cc.split_open("gfx942", [row])
    assert failures == [] and len(opened) == 1
    failures, opened = cc.split_open("gfx942", [dict(row, spills=0)])
    assert opened == [] and any("no longer occurs" in f for f in failures)


def test_clang_targets_compile_without_device_libraries():
    """gfx942 / gfx11 / gfx12 go to clang-19 with -nogpulib (the kernels' builtins stand in for the device
    library), the others to hipcc with ROCm's device libraries; a device-library name left in the assembly
    is a call the check reports."""
    assert cc.CLANG_ARCHS == ("gfx942", "gfx1100", "gfx1201")
    for arch in cc.CLANG_ARCHS:
        assert {"-nogpulib", "-DKVM_NO_DEVICE_LIBS", f"--offload-arch={arch}"} <= set(cc.device_flags(arch))
    assert "-nogpulib" not in cc.device_flags("gfx940")
    asm = "\n".join(["  s_getpc_b64 s[0:1]", "  s_add_u32 s0, s0, __ocml_tanh_f32@rel32@lo+4",
                     "  s_swappc_b64 s[30:31], s[0:1]", "  s_add_u32 s2, s2, __ockl_get_local_id@rel32@lo+4",
                     "  s_add_u32 s4, s4, __ocml_tanh_f32@rel32@hi+12", "  v_exp_f32_e32 v1, v0"])
    assert cc.device_library_calls(asm) == ["__ockl_get_local_id", "__ocml_tanh_f32"]
    assert cc.device_library_calls("  v_exp_f32_e32 v1, v0\n  s_endpgm") == []


def test_resource_usage_parser_flags_spills_and_scratch():
    log = "\n".join([
        "k.hip:1:1: remark: Function Name: _ZN7kvmulti22paged_attention_kernelIfLi64ELi64EEEvNS_20PagedAttentionParamsE",
        "k.hip:1:1: remark:     SGPRs: 40 [-Rpass-analysis=kernel-resource-usage]",
        "k.hip:1:1: remark:     VGPRs: 128 [-Rpass-analysis=kernel-resource-usage]",
        "k.hip:1:1: remark:     ScratchSize [bytes/lane]: 16 [-Rpass-analysis=kernel-resource-usage]",
        "k.hip:1:1: remark:     VGPRs Spill: 3 [-Rpass-analysis=kernel-resource-usage]",
        "k.hip:1:1: remark:     LDS Size [bytes/block]: 4112 [-Rpass-analysis=kernel-resource-usage]",
    ])
    (name, fields), = cc.parse_resource_usage(log).items()
    assert "paged_attention_kernel" in name
    assert fields["VGPRs"] == 128 and fields["VGPRs Spill"] == 3 and fields["ScratchSize"] == 16
    assert fields["LDS Size"] == 4112


def test_resource_usage_parser_reads_occupancy():
    log = "\n".join([
        "k.hip:1:1: remark: Function Name: _ZN7kvmulti15write_kv_kernelIfEEvNS_13WriteKVParamsE",
        "k.hip:1:1: remark:     Occupancy [waves/SIMD]: 8 [-Rpass-analysis=kernel-resource-usage]",
        "k.hip:1:1: remark:     AGPRs: 4 [-Rpass-analysis=kernel-resource-usage]",
    ])
    (_, fields), = cc.parse_resource_usage(log).items()
    assert fields == {"Occupancy": 8, "AGPRs": 4}


# A rotated loop as clang prints it: blocks before the header belong to it (comment "in Loop").
_ASM = """\
_ZN7kvmulti22paged_attention_kernelI12hip_bfloat16Li128ELi64EEEvNS_20PagedAttentionParamsE:
	s_load_dwordx2 s[0:1], s[4:5], 0x0
	global_load_dword v1, v[2:3], off
.LBB0_1:                                ;   in Loop: Header=BB0_2 Depth=1
	s_waitcnt vmcnt(2)
	v_mfma_f32_16x16x16bf16_1k v[4:7], v[8:9], v[10:11], v[4:7]
	s_waitcnt vmcnt(0)
	v_mfma_f32_16x16x16bf16_1k v[4:7], v[12:13], v[10:11], v[4:7]
.LBB0_2:                                ; =>This Inner Loop Header: Depth=1
	global_load_dwordx4 v[20:23], v[2:3], off
	global_load_dwordx4 v[24:27], v[2:3], off offset:64
	global_load_dwordx4 v[28:31], v[2:3], off offset:128
	global_load_dwordx4 v[32:35], v[2:3], off offset:192
	s_cbranch_scc1 .LBB0_1
; %bb.3:
	global_load_ushort v1, v[2:3], off
	s_endpgm
.Lfunc_end0:
"""


def test_assembly_analysis_of_the_hot_loop():
    (name, lines), = cc.split_functions(_ASM).items()
    row = cc.analyze_function(lines)
    assert row["matrix_instructions"] == 2
    wmma = [l.replace("v_mfma_f32_16x16x16bf16_1k v[4:7], v[8:9], v[10:11]",
                      "v_wmma_f32_16x16x16_bf16 v[4:11], v[12:19], v[20:27]") for l in lines]
    assert cc.analyze_function(wmma)["matrix_instructions"] == 2   # RDNA's v_wmma count like v_mfma
    assert cc.instruction_mix([l for l in wmma if "v_wmma" in l])["mfma"] == 1
    assert row["load_widths_bytes"] == [2, 4, 16]
    assert row["hot_loop"] == "BB0_2"
    assert row["hot_loop_load_widths_bytes"] == [16]
    assert row["bytes_in_flight_per_lane"] == 64 and row["bytes_before_vmcnt0_per_lane"] == 64
    # vmcnt(N) keeps the N newest loads outstanding
    prof = cc.loop_load_profile(["global_load_dwordx4 v[0:3]", "s_waitcnt vmcnt(0)", "global_load_dwordx4 v[0:3]",
                                 "global_load_ushort v4", "s_waitcnt vmcnt(1)", "global_load_dwordx4 v[4:7]",
                                 "s_waitcnt vmcnt(0)"])
    assert prof["peak_bytes_per_lane"] == 18 and prof["bytes_before_vmcnt0_per_lane"] == 16
    assert prof["load_widths_bytes"] == [2, 16]


def test_loads_in_flight_at_the_loop_head():
    """A pipelined loop (issue the next tile, wait for the previous one with vmcnt(N > 0)) keeps its
    issued loads outstanding across the back edge; one that drains with vmcnt(0) keeps none."""
    pipelined = ["global_load_dwordx4 v[0:3]", "global_load_dwordx4 v[4:7]", "s_waitcnt vmcnt(2)",
                 "v_mfma_f32_16x16x16bf16_1k v[8:11], v[12:13], v[14:15], v[8:11]"]
    assert cc.head_in_flight(pipelined) == {"head_bytes_per_lane": 32, "min_vmcnt": 2}
    drained = ["global_load_dwordx4 v[0:3]", "global_load_dwordx4 v[4:7]", "s_waitcnt vmcnt(0)"]
    assert cc.head_in_flight(drained) == {"head_bytes_per_lane": 0, "min_vmcnt": 0}
    assert cc.head_in_flight(["v_add_f32 v0, v1, v2"]) == {"head_bytes_per_lane": 0, "min_vmcnt": None}
    # a wait for fewer loads than its N (the first trip, before the back edge has issued any) retires none
    rotated = ["s_waitcnt vmcnt(3)", "global_load_dwordx4 v[0:3]", "s_waitcnt vmcnt(2)", "global_load_dwordx4 v[4:7]",
               "global_load_dwordx4 v[8:11]"]
    assert cc.head_in_flight(rotated) == {"head_bytes_per_lane": 64, "min_vmcnt": 2}
    assert cc.loop_load_profile(rotated)["peak_bytes_per_lane"] == 48
    assert cc.loop_load_profile(rotated[3:] + ["s_waitcnt vmcnt(3)"] + rotated[1:2])["peak_bytes_per_lane"] == 48
    assert cc.serial_share(rotated) == 0.0
    # one decode tile per lane (MfmaGeom): bf16 head 128: 2 sub-tiles x (4 K + 4 V) chunks; head 256: 1 x (8 + 8);
    # fp8 head 128: 2 x (2 K + 2 V staged); fp8 head 64: 2 x (1 + 1)
    assert cc.decode_tile_load_bytes(128, 2) == 256 and cc.decode_tile_load_bytes(256, 2) == 256
    assert cc.decode_tile_load_bytes(128, 1) == 128 and cc.decode_tile_load_bytes(64, 1) == 64


def test_decode_criteria_block_id_shuffles_and_a_tile_in_flight():
    assert cc.row_problems(_row(hot_loop_ds_bpermute=6)) == []
    assert any("ds_bpermute" in p for p in cc.row_problems(_row(hot_loop_ds_bpermute=16)))
    assert cc.row_problems(_row(hot_loop_ds_bpermute=16, target="gfx1030", wave=32, matrix_instructions=0)) == []
    assert cc.decode_pipeline_problems(_row()) == []
    assert any("at its head" in p for p in cc.decode_pipeline_problems(_row(hot_loop_min_vmcnt=0)))
    assert any("at its head" in p for p in cc.decode_pipeline_problems(_row(head_bytes_in_flight_per_lane=128)))
    assert cc.decode_pipeline_problems(_row(head_bytes_in_flight_per_lane=0, target="gfx1030", wave=32,
                                            matrix_instructions=0)) == []
    assert cc.decode_pipeline_problems(_row(cache="e4m3", head_bytes_in_flight_per_lane=128)) == []


def test_decode_keeps_a_tile_in_flight_at_the_loop_head():
    _require(amd=True, nvidia=False)
    problems = [p for r in cc.report_rows() for p in cc.decode_pipeline_problems(r) if p not in cc.open_problems(r)]
    assert problems == [], problems


def _row(**kw):
    base = dict(kernel="paged_attention<bf16,128,wave64>", kind="attention", dtype="bf16", cache=None, target="gfx90a",
                wave=64, vgprs=128, spills=0, scratch_bytes=0, waves_per_simd=2, matrix_instructions=64,
                hot_loop_load_widths_bytes=[16], bytes_in_flight_per_lane=192, fp16_denorm_mode=3, head_size=128,
                head_bytes_in_flight_per_lane=256, hot_loop_min_vmcnt=16)
    base.update(kw)
    return base


def test_occupancy_counts_lds():
    assert cc.effective_occupancy("gfx90a", 8, 14464, 4) == 4      # 4 blocks of 4 waves on 4 SIMDs
    assert cc.effective_occupancy("gfx940", 2, 8832, 4) == 2        # register-bound
    assert cc.effective_occupancy("gfx1030", 8, 25184, 4) == 4      # 2 blocks of 4 waves on 2 SIMDs
    assert cc.effective_occupancy("gfx90a", 8, 0, 4) == 8


def test_ci_thresholds_flag_each_violation():
    assert cc.row_problems(_row()) == []
    assert any("spilled" in p for p in cc.row_problems(_row(spills=2)))
    assert any("scratch" in p for p in cc.row_problems(_row(scratch_bytes=16)))
    assert any("occupancy" in p for p in cc.row_problems(_row(waves_per_simd=1)))
    assert any("v_mfma" in p for p in cc.row_problems(_row(matrix_instructions=0)))
    # wave32 prefill on RDNA3 / RDNA4: fp16 / bf16 over a 16-bit or fp8 cache must use v_wmma; gfx1030 has none
    for target in ("gfx1100", "gfx1201"):
        for cache in (None, "e4m3"):
            wmma = _row(target=target, wave=32, kind="prefill", cache=cache)
            assert cc.row_problems(wmma) == []
            assert any("without v_wmma" in p for p in cc.row_problems(dict(wmma, matrix_instructions=0)))
    assert cc.row_problems(_row(target="gfx1030", wave=32, kind="prefill", matrix_instructions=0)) == []
    assert cc.row_problems(_row(matrix_instructions=0, target="gfx1030", wave=32)) == []
    assert cc.row_problems(_row(matrix_instructions=0, dtype="fp32")) == []
    assert any("hot-loop global loads" in p for p in cc.row_problems(_row(hot_loop_load_widths_bytes=[2, 16])))
    assert any("in flight" in p for p in cc.row_problems(_row(bytes_in_flight_per_lane=48)))
    # fp8 caches: a 16-bit query takes the MFMA engine on gfx90a / gfx940 too, and needs fp16 denormals kept
    for fmt in ("e4m3", "e5m2"):
        assert cc.row_problems(_row(cache=fmt)) == []
        problems = cc.row_problems(_row(cache=fmt, matrix_instructions=0))
        assert any("v_mfma" in p and f"{fmt} cache" in p for p in problems)
        assert any("denormals" in p for p in cc.row_problems(_row(cache=fmt, fp16_denorm_mode=0)))
        assert cc.row_problems(_row(cache=fmt, dtype="fp32", matrix_instructions=0)) == []
        # the FMA engine reads an fp8 row as 8-byte pieces (8 codes per lane); narrower loads still fail
        fma = dict(cache=fmt, matrix_instructions=0, target="gfx1100", wave=32)
        assert cc.row_problems(_row(**fma, hot_loop_load_widths_bytes=[8])) == []
        assert any("want 8 only" in p for p in cc.row_problems(_row(**fma, hot_loop_load_widths_bytes=[4, 8])))
        assert any("want 16 only" in p for p in cc.row_problems(_row(cache=fmt, hot_loop_load_widths_bytes=[8])))
        assert cc.row_problems(_row(cache=fmt, target="gfx1030", wave=32, matrix_instructions=0)) == []
    assert cc.row_problems(_row(fp16_denorm_mode=0)) == []      # a 16-bit cache widens nothing


def test_kernel_descriptor_directives_are_parsed():
    name = "_ZN7kvmulti22paged_attention_kernelI6__halfNS_7Fp8E4M3ELi64ELi64EEEvNS_20PagedAttentionParamsE"
    asm = "\n".join([
        f"\t.amdhsa_kernel {name}",
        "\t\t.amdhsa_group_segment_fixed_size 8832",
        "\t\t.amdhsa_float_denorm_mode_32 3",
        "\t\t.amdhsa_float_denorm_mode_16_64 3",
        "\t.end_amdhsa_kernel",
        "\t\t.amdhsa_float_denorm_mode_16_64 0",      # outside any kernel block: ignored
    ])
    assert cc.cache_kind(name) == "e4m3" and list(cc.kernel_descriptors(asm)) == [name]
    fields = cc.kernel_descriptors(asm)[name]
    assert fields == {"group_segment_fixed_size": 8832, "float_denorm_mode_32": 3, "float_denorm_mode_16_64": 3}


def test_report_rows_per_kernel_and_target():
    """The static figures (also imported by benchmarks/gpu_report.py) meet the CI thresholds."""
    _require(amd=True, nvidia=False)
    rows = cc.report_rows()
    keys = {"kernel", "target", "vgprs", "sgprs", "lds_bytes", "waves_per_simd", "spills", "matrix_instructions",
            "load_widths_bytes", "bytes_in_flight_per_lane"}
    assert all(keys <= set(r) for r in rows)
    per_target = {a: [r for r in rows if r["target"] == a] for a in cc.amd_archs()}
    for arch, rs in per_target.items():
        attention = [r for r in rs if r["kind"] == "attention"]
        assert len(attention) == len(cc.DTYPES) * cc.CACHES_PER_DTYPE * len(cc.HEAD_SIZES), arch
        assert {r["wave"] for r in attention} == {cc._wave_of(arch)}
        for r in rs:
            assert cc.failing_problems(r) == [], cc.failing_problems(r)
        for r in attention:
            if not cc.open_problems(r):
                width = cc.hot_loop_load_bytes(r)
                assert r["hot_loop_load_widths_bytes"] == [width] and r["bytes_in_flight_per_lane"] >= 4 * width
            if arch in cc.MFMA_ARCHS and r["dtype"] != "fp32":   # block ids: scalars, not shuffles
                assert r["hot_loop_ds_bpermute"] <= cc.DECODE_SOFTMAX_SHUFFLES, r
            uses_mfma = arch in cc.MFMA_ARCHS and r["dtype"] != "fp32"    # 16-bit or fp8 cache alike
            assert (r["matrix_instructions"] > 0) == uses_mfma, r


def test_fp8_caches_with_16bit_queries_use_mfma_on_cdna():
    """fp8 caches (e4m3fn, e5m2 and the FNUZ formats) with fp16 / bf16 queries: on the CDNA targets every head size's attention
    kernel has v_mfma, keeps fp16 denormals (the e4m3 widening), needs no more LDS than the 16-bit cache's
    kernel of the same query type and head size (the V staging buffer overlays the output rows) and, from
    head 80 up, runs at least as many waves per SIMD. Head 64 takes 4 sub-tiles (64 keys) per iteration to
    keep 4 16-byte loads in flight per lane; its extra VGPRs leave 2-3 waves/SIMD (16-bit: 3-4), the CI
    minimum being 2. fp32 queries and gfx1030 (wave32) keep the FMA engine."""
    _require(amd=True, nvidia=False)
    rows = [r for r in cc.report_rows() if r["kind"] == "attention"]
    same_type = {(r["target"], r["dtype"], r["head_size"]): r for r in rows if not r["cache"]}
    fp8 = [r for r in rows if r["cache"]]
    assert len(fp8) == len(cc.amd_archs()) * len(cc.DTYPES) * (cc.CACHES_PER_DTYPE - 1) * len(cc.HEAD_SIZES)
    for r in fp8:
        if r["target"] in cc.MFMA_ARCHS and r["dtype"] in ("fp16", "bf16"):
            base = same_type[r["target"], r["dtype"], r["head_size"]]
            assert r["matrix_instructions"] > 0 and r["fp16_denorm_mode"] == 3, r
            assert r["lds_bytes"] <= base["lds_bytes"], (r, base)
            assert r["waves_per_simd"] >= (base["waves_per_simd"] if r["head_size"] > 64 else cc.MIN_WAVES_PER_SIMD), \
                (r, base)
            assert cc.open_problems(r) or (r["spills"] == 0 and r["hot_loop_load_widths_bytes"] == [16]), r
        else:
            assert r["matrix_instructions"] == 0, r


# ------------------------------------------------------------------------------- the prefill kernel
_MARKED_ASM = """\
_ZN7kvmulti20paged_prefill_kernelI12hip_bfloat16S1_Li128ELi64EEEvNS_20PagedAttentionParamsE:
; %bb.0:
.LBB0_1:                                ; =>This Inner Loop Header: Depth=1
	global_load_dwordx4 v[0:3], v[8:9], off
	global_load_dwordx4 v[4:7], v[8:9], off offset:16
	v_add_f32_e32 v10, v11, v12
	v_mul_f32_e32 v10, v11, v12
	s_cbranch_scc1 .LBB0_1
; %bb.2:
.LBB0_3:                                ; =>This Inner Loop Header: Depth=1
	global_load_dwordx4 v[0:3], v[8:9], off
	global_load_dword v20, v[8:9], off
	;;#ASMSTART
	; kvmulti-hot-loop
	;;#ASMEND
	v_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], v[0:3]
	v_mfma_f32_16x16x16_bf16 v[0:3], v[4:5], v[6:7], v[0:3]
	v_add_f32_e32 v10, v11, v12
	s_add_i32 s0, s0, 1
	s_cbranch_scc1 .LBB0_3
; %bb.4:
	s_endpgm
.Lfunc_end0:
"""


def test_the_marked_loop_is_the_hot_loop_and_its_issue_cycles():
    """The prefill kernel marks its unmasked tile loop; the analysis takes it over a loop issuing more load
    bytes (the masked edge loops), counts its one 4-byte block-table load, and its issue cycles per wave:
    v_mfma_f32_16x16x16 = 16 cycles on gfx940, 32 on gfx90a; VALU and SALU 4."""
    (name, lines), = cc.split_functions(_MARKED_ASM).items()
    row = cc.analyze_function(lines)
    assert row["hot_loop"] == "BB0_3" and row["hot_loop_narrow_loads"] == 1 and row["hot_loop_loads"] == 2
    assert row["hot_loop_instructions"] == {"mfma": 2, "valu": 1, "salu": 1, "lds": 0, "vmem": 2}
    assert cc.issue_cycles(dict(row, target="gfx940")) == {"mfma": 32, "valu": 4, "salu": 4}
    assert cc.issue_cycles(dict(row, target="gfx90a"))["mfma"] == 64


def test_prefill_thresholds():
    """A prefill row may issue 4-byte loads (the next tile's block-table entries) one beside each copy of the
    tile's loads, at least 4 of them, no more; on gfx90a / gfx940 its 16-bit hot loop must issue at least as
    many MFMA cycles as VALU cycles."""
    ok = _row(kind="prefill", kernel="paged_prefill<bf16,128,wave64>", target="gfx940",
              hot_loop_load_widths_bytes=[4, 16], hot_loop_narrow_loads=1, hot_loop_loads=9,
              hot_loop_mfma_flops=64 * 8192,
              hot_loop_instructions={"mfma": 64, "valu": 250, "salu": 40, "lds": 47, "vmem": 9})
    assert cc.row_problems(ok) == []
    assert any("hot-loop global loads" in p for p in cc.row_problems(dict(ok, hot_loop_narrow_loads=2)))
    # two copies of a tile's 4 + 1 loads (a wave skipping the tile's arithmetic issues its own)
    assert cc.row_problems(dict(ok, hot_loop_narrow_loads=2, hot_loop_loads=10)) == []
    assert any("hot-loop global loads" in p for p in cc.row_problems(dict(ok, hot_loop_narrow_loads=0)))
    slow = dict(ok, hot_loop_instructions=dict(ok["hot_loop_instructions"], valu=300))
    assert any("MFMA cycles" in p for p in cc.row_problems(slow))
    assert cc.row_problems(dict(slow, target="gfx90a")) == []            # 32-cycle MFMAs there
    # over an fp8 cache: codes widened once per tile, at most MAX_FP8_PREFILL_VALU_PER_MFMA VALU per MFMA cycle
    fp8 = dict(ok, kernel="paged_prefill<bf16,e4m3,128,wave64>", cache="e4m3", fp16_denorm_mode=3,
               hot_loop_instructions=dict(ok["hot_loop_instructions"], valu=510))
    assert cc.row_problems(fp8) == []
    in_loop = dict(fp8, hot_loop_instructions=dict(ok["hot_loop_instructions"], valu=1646))
    assert any("widened once per tile" in p for p in cc.row_problems(in_loop))
    fnuz = dict(fp8, kernel="paged_prefill<bf16,e5m2fnuz,128,wave64>", cache="e5m2fnuz")
    heavier = dict(ok["hot_loop_instructions"], valu=700)      # 2.7 VALU per MFMA cycle: within FNUZ's 3.0
    assert cc.row_problems(dict(fnuz, hot_loop_instructions=heavier)) == []
    assert any("widened once per tile" in p for p in cc.row_problems(dict(fp8, hot_loop_instructions=heavier)))
    assert any("widened once per tile" in p for p in cc.row_problems(dict(fnuz, hot_loop_instructions=in_loop["hot_loop_instructions"])))


def test_fp32_prefill_issue_cycles_and_thresholds():
    """fp32 queries: v_mfma_f32_16x16x4f32 (gfx90a spelling; gfx940: v_mfma_f32_16x16x4_f32) is 2048 flops
    and 32 cycles on both targets (AMD's matrix instruction calculator); the prefill row must use v_mfma and
    issue at least as many MFMA cycles as VALU cycles."""
    for op in ("v_mfma_f32_16x16x4f32", "v_mfma_f32_16x16x4_f32"):
        assert cc.mfma_flops([f"\t{op} v[0:3], v4, v5, v[0:3]"] * 3) == 3 * 2048
    row = _row(kind="prefill", kernel="paged_prefill<fp32,128,wave64>", dtype="fp32", target="gfx940",
               hot_loop_load_widths_bytes=[4, 16], hot_loop_narrow_loads=1, hot_loop_loads=9,
               hot_loop_mfma_flops=128 * 2048,
               hot_loop_instructions={"mfma": 128, "valu": 900, "salu": 40, "lds": 60, "vmem": 9})
    for target in cc.MFMA_ARCHS:
        assert cc.issue_cycles(dict(row, target=target)) == {"mfma": 128 * 32, "valu": 3600, "salu": 160}
    assert cc.row_problems(row) == []
    slow = dict(row, hot_loop_instructions=dict(row["hot_loop_instructions"], valu=1025))
    assert any("MFMA cycles" in p for p in cc.row_problems(slow))
    assert any("without v_mfma" in p for p in cc.row_problems(dict(row, matrix_instructions=0)))
    decode = dict(row, kind="attention", matrix_instructions=0, hot_loop_load_widths_bytes=[16])
    assert cc.row_problems(decode) == []   # fp32 decode: the FMA engine


def test_prefill_kernel_static_figures_and_estimate():
    """Every prefill instantiation (wave64: fp16 / bf16 over a 16-bit or fp8 cache, fp32 over fp32 or fp8; wave32:
    every query type over a cache of its type at heads 64 - 128) compiles without spills at >= 2 waves/SIMD;
    gfx1100 / gfx1201's fp16 / bf16 ones use v_wmma, their fp32 ones and gfx1030's (the FMA tile engine) none;
    on gfx90a / gfx940 they use v_mfma with K + V tiles of at most 32 KiB of LDS and
    an unmasked hot loop whose MFMA issue cycles cover its VALU cycles over a 16-bit cache (fp8: see
    MAX_FP8_PREFILL_VALU_PER_MFMA); the roofline model puts gfx942's bf16 prefill case (8 x 2048 tokens, 32 / 8
    heads, head 128) at >= 50 % of the matrix peak and the fp32 prefill case MFMA-issue-bound at >= 50 % of the fp32
    matrix peak (estimates)."""
    _require(amd=True, nvidia=False)
    from devtools import roofline as R
    from devtools import roofline_hip as H
    rows = [r for r in cc.report_rows() if r["kind"] == "prefill"]
    mfma_archs = [a for a in cc.amd_archs() if a in cc.MFMA_ARCHS]
    for arch in cc.amd_archs():   # the instantiations for the target's wave size (wave32: the WMMA engine's)
        want = cc.WAVE64_PREFILL_KERNELS if cc._wave_of(arch) == 64 else cc.WAVE32_PREFILL_KERNELS
        assert len([r for r in rows if r["target"] == arch]) == want, arch
    for r in rows:
        assert cc.failing_problems(r) == [], cc.failing_problems(r)
        if r["target"] in cc.MFMA_ARCHS:
            cyc = cc.issue_cycles(r)
            assert r["matrix_instructions"] > 0 and r["lds_bytes"] <= 32768 + 1024, r
            assert cyc["mfma"] >= cyc["valu"] or r["cache"] or cc.open_problems(r), r
        assert (r["matrix_instructions"] > 0) == (r["target"] in cc.MFMA_ARCHS or
                                                  (r["target"] in cc.WMMA_ARCHS and r["dtype"] != "fp32")), r
    rows = [r for r in rows if r["target"] in cc.MFMA_ARCHS]
    launches = H.launches(rows, R.PREFILL)
    assert {launch.target for launch in launches} == {H.ARCH_TO_TARGET[a] for a in mfma_archs if a in H.ARCH_TO_TARGET}
    for launch in launches:
        e = R.estimate(launch, R.TARGETS[launch.target])
        if launch.target == "gfx942":
            assert e.fraction >= 0.5, e.row()
    # fp32 queries (v_mfma_f32_16x16x4f32) against the fp32 matrix peak: bound by the MFMA issue
    fp32 = H.fp32_prefill_estimates(rows)
    assert {e.target for e in fp32} == {H.ARCH_TO_TARGET[a] for a in mfma_archs if a in H.ARCH_TO_TARGET}
    for e in fp32:
        assert e.bound == "issue" and e.row()["issue_limiter"] == "mfma" and e.fraction >= 0.5, e.row()


def test_prefill_tile_keys_follow_the_kernels_lds_budget():
    """PrefillGeom::KT: K + V of a tile in 32 KiB -- 16-bit head 128: 64 keys, head 256: 32; fp32 head 64: 64,
    head 128: 32 (head 256 would take 16); fp8 (1 byte) head 256: 64."""
    from devtools import roofline_hip as H
    assert [H.prefill_tile_keys(h, 2) for h in (64, 128, 256)] == [64, 64, 32]
    assert [H.prefill_tile_keys(h, 4) for h in (64, 80, 128, 256)] == [64, 32, 32, 16]
    assert H.prefill_tile_keys(256, 1) == 64
    assert H._elem_bytes({"dtype": "fp32"}) == 4 and H._elem_bytes({"dtype": "bf16"}) == 2
    assert H._elem_bytes({"dtype": "bf16", "cache": "e4m3"}) == 1
