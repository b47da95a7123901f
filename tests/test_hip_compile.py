"""Compile check of every HIP kernel instantiation for AMD (gfx90a, gfx940, gfx1030: -Werror, no
register spills / scratch) and NVIDIA (sm_80, sm_90 through hip/compat) -- hip/compile_check.py.

Outside CI a missing compiler skips with the reason; with CI=true it FAILS (the README's test command
installs hipcc; nvcc comes with the CI image)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys

import pytest

from kvmulti.backends import hip

IN_CI = os.environ.get("CI", "").lower() == "true"


def _load_compile_check():
    path = hip.build.source_dir() / "compile_check.py"
    spec = importlib.util.spec_from_file_location("kvmulti_hip_compile_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


cc = _load_compile_check()


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
    for arch in cc.AMD_ARCHS:
        assert arch in names
    passes = [r for r in report.results if "device pass" in r.name]
    assert len(passes) == len(cc.AMD_ARCHS) and all(r.kernels == cc.EXPECTED_KERNELS for r in passes)


def test_nvidia_targets_compile_through_compat_header():
    _require(amd=False, nvidia=True)
    report = cc.run(amd=False, nvidia=True)
    assert report.ok, report.summary()
    assert [r.kernels for r in report.results] == [cc.EXPECTED_KERNELS] * len(cc.NVIDIA_ARCHS)


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
