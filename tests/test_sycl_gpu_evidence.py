"""Intel GPU compile evidence of the SYCL kernels (devtools/sycl_gpu_evidence.py): the runtime's SPIR-V of
kernels.cpp compiled by Debian's ocloc (IGC 1.0.12504) for DG2 (acm-g10) and PVC, with the facts
sycl/README.md reports. CI installs ocloc (scripts/setup.sh --test), so there it must run."""

from __future__ import annotations

import os
import shutil

import pytest

from kvmulti.backends import sycl as S

if shutil.which("ocloc") is None and os.environ.get("CI") != "true":
    pytest.skip("ocloc missing (apt-get install intel-opencl-icd)", allow_module_level=True)
if S.runtime_reasons() and os.environ.get("CI") != "true":
    pytest.skip(f"SYCL runtime unusable here: {S.runtime_reasons()}", allow_module_level=True)


def test_ocloc_compiles_the_runtime_spirv_for_dg2_and_pvc():
    """Each target row is the build that ships on it: PVC the matrix built-ins (dpas) with the
    256-register kernel property, DG2 (matrix unit at sub-group size 8 only) the vector path."""
    from devtools import sycl_gpu_evidence as G
    rows = G.report_rows()
    assert all(set(r) == set(G.KEYS) for r in rows)
    by = {(r["kernel"], r["target"]): r for r in rows}
    flavours = {**{t: G.SHIPPED[t][0] for t in G.TARGETS}, **{v[0]: v[2] for v in G.VARIANTS}}
    for target in (*G.TARGETS, *(v[0] for v in G.VARIANTS)):
        for kernel in ("kvm_paged_attention", "kvm_paged_attention_terms"):
            attn = by[(kernel, target)]
            assert attn["simd_width"] == S.SG                     # the required sub-group size held
            assert attn["regs_or_grf_mode"].endswith("GRF") and isinstance(attn["spills"], int)
            # bf16, head 128: 16 lanes x 8 bf16 of a K (matrix path) or K/V (vector path) row, one message
            assert 256 in attn["load_widths_bytes"], attn
            assert attn["slm_bytes"] == 4 * S.lm_floats(128, S.WG, flavours[target] != "vector", narrow=True)
            assert attn["hot_loop_instructions"], attn
        assert ("kvm_write_kv", target) in by and ("kvm_split_reduce", target) in by
    for kernel in ("kvm_paged_attention", "kvm_paged_attention_terms"):
        shipped = by[(kernel, "pvc")]
        assert shipped["spills"] == 0, shipped                      # both fit PVC's 256 registers
        assert shipped["regs_or_grf_mode"] == "256 GRF", shipped    # the grf_size<256> property, no ocloc option
        assert shipped["matrix_instructions"] > 0 and shipped["hot_loop_dpas_flops"] > 0, shipped
        assert shipped["hot_loop_instructions"].get("dpas", 0) > 0, shipped
        assert by[(kernel, "pvc-128grf")]["regs_or_grf_mode"] == "128 GRF"
        assert by[(kernel, "pvc-128grf")]["matrix_instructions"] > 0
        # DG2 and the other PVC modes run without the built-ins: no dpas
        for target in ("acm-g10", "pvc-vector-large-grf", "pvc-emulated"):
            assert by[(kernel, target)]["matrix_instructions"] == 0, target


def test_pvc_prefill_kernel_is_the_rows_on_lanes_matrix_body():
    """kvm_paged_prefill (tiles of more than 8 rows) on PVC: 256 registers, no spills, and per 16-key
    step 32 dpas over 16 rows (QK^T and P.V of head 128: 2 x 16 x 16 x 256 flops); its key loop
    issues at most a third of the instructions per (key, row) of the attention kernel's loop (16-key
    steps of 8 rows), which served prefill before it."""
    from devtools import sycl_gpu_evidence as G
    by = {(r["kernel"], r["target"]): r for r in G.report_rows()}
    prefill, attention = by[("kvm_paged_prefill", "pvc")], by[("kvm_paged_attention", "pvc")]
    assert prefill["regs_or_grf_mode"] == "256 GRF" and prefill["spills"] == 0, prefill
    assert prefill["hot_loop_dpas_flops"] == 2 * 16 * 16 * 256 and prefill["hot_loop_instructions"]["dpas"] == 32
    per_key_row = sum(prefill["hot_loop_instructions"].values()) / (16 * 16)
    before = sum(attention["hot_loop_instructions"].values()) / (16 * 8)
    assert per_key_row <= before / 3, (per_key_row, before)
    # ALiBi / non-causal keep the attention body (the same loop as kvm_paged_attention_terms)
    assert by[("kvm_paged_prefill_terms", "pvc")]["hot_loop_instructions"] == \
        by[("kvm_paged_attention_terms", "pvc")]["hot_loop_instructions"]
    assert by[("kvm_paged_prefill_terms", "pvc")]["spills"] == 0


def test_load_message_parser():
    from devtools import sycl_gpu_evidence as G
    asm = ("load.ugm.d16u32.a64 (16|M0)  r2 [r4:2]\n"        # 2-byte scalar per lane -> 16 x 4 bytes
           "load.ugm.d32x4.a64 (16|M0)  r8 [r4:2]\n"          # 16 bytes per lane -> 256 bytes
           "load.ugm.d32x64t.a32 (1|M0)  r8 bti[1][r4]\n"    # a 64-dword block -> 256 bytes
           "load_block2d.ugm.d16.a64 (16|M0)  r18:8 [r1:1]\n"  # a 2D block into 8 registers -> 512 bytes
           "load.ugm.d32.a64.ca.ca (16|M0)  null:0  [r10:2]\n")  # an LSC prefetch (no destination) -> 64 bytes
    assert G.load_message_bytes(asm) == {64: 2, 256: 2, 512: 1}
    mix = G.hot_loop_mix("L1:\n" + asm + "(W) jmpi L1\n")[0]
    assert mix["send"] == 5 and "alu" not in mix, mix
