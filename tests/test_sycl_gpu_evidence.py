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
    from devtools import sycl_gpu_evidence as G
    rows = G.report_rows()
    assert all(set(r) == set(G.KEYS) for r in rows)
    by = {(r["kernel"], r["target"]): r for r in rows}
    for target in G.TARGETS:
        attn = by[("kvm_paged_attention", target)]
        assert attn["simd_width"] == S.SG                         # the required sub-group size held
        assert attn["regs_or_grf_mode"].endswith("GRF") and isinstance(attn["spills"], int)
        assert attn["matrix_instructions"] == 0                   # no XMX path (see the joint_matrix probe)
        # bf16, head 128: a K or V row chunk is 16 lanes x 8 bf16 = one 256-byte message
        assert 256 in attn["load_widths_bytes"], attn
        assert attn["slm_bytes"] == 4 * S.lm_floats(128, S.WG)
        assert ("kvm_write_kv", target) in by and ("kvm_split_reduce", target) in by
    # PVC's 256-register mode (ocloc -ze-opt-large-register-file) holds the attention kernel without spills
    large = by[("kvm_paged_attention", "pvc-large-grf")]
    assert large["regs_or_grf_mode"] == "256 GRF" and large["spills"] == 0, large


def test_load_message_parser():
    from devtools import sycl_gpu_evidence as G
    asm = ("load.ugm.d16u32.a64 (16|M0)  r2 [r4:2]\n"        # 2-byte scalar per lane -> 16 x 4 bytes
           "load.ugm.d32x4.a64 (16|M0)  r8 [r4:2]\n"          # 16 bytes per lane -> 256 bytes
           "load.ugm.d32x64t.a32 (1|M0)  r8 bti[1][r4]\n")    # a 64-dword block -> 256 bytes
    assert G.load_message_bytes(asm) == {64: 1, 256: 2}
