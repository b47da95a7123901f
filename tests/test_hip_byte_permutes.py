"""The GPU-only bit paths of hip/kvmulti_common.h and hip/kvmulti_prefill.hip (``v_perm_b32`` selectors,
the fp8 widening) against the formulas the CPU harness runs instead.

The harness compiles the portable branch of each ``#if`` (its own preprocessor macro), so a wrong
``__builtin_amdgcn_perm`` selector would pass every harness suite. Here hipcc compiles, for gfx940, one
kernel per case that applies the real device function to constants; LLVM folds the call (byte permutes,
fp16 -> fp32 widening) into the one constant the kernel stores, which must equal this file's model of the
portable formula (for the fp8 widenings, OCP and FNUZ: torch's decoding of the codes)."""

from __future__ import annotations

import os
import re
import struct
import subprocess

import torch

from devtools import hip_compile_check as cc
from test_hip_compile import _require

ARCH = "gfx940"
WORD = 0x11223344            # distinct bytes: one case pins a selector down
HALVES = (0x3C00, 0x0001, 0x83FF, 0x7E00, 0x7BFF, 0x0000)   # fp16 1, min subnormal, -subnormal, NaN, max, 0
# e4m3fn codes: zero, min subnormal, subnormals, normals, max, NaN, their negatives
E4M3_CODES = (0x00, 0x01, 0x05, 0x07, 0x08, 0x38, 0x3F, 0x7E, 0x7F, 0x80, 0x81, 0xB8, 0xFE, 0xFF)


def _fp8_pair_of(x: int, j: int) -> int:
    return (((x >> 8) & 0xFF00) | (x & 0xFF000000)) if j else (((x & 0xFF) << 8) | ((x & 0xFF00) << 16))


def _f32_bits_of_f16(h: int) -> int:
    return struct.unpack("<I", struct.pack("<f", struct.unpack("<e", struct.pack("<H", h))[0]))[0]


def _f16x2_to_bf16x2(h: int) -> int:
    return (_f32_bits_of_f16(h & 0xFFFF) >> 16) | (_f32_bits_of_f16(h >> 16) & 0xFFFF0000)


# codes for the FNUZ widenings besides: e5m2fnuz's exponent 1 / 2 edge and its finite exponent 31
FNUZ_CODES = E4M3_CODES + (0x04, 0x06, 0x7C, 0x7D, 0xFC)


def _value(code: int, dtype: torch.dtype) -> float:
    return torch.tensor([code], dtype=torch.uint8).view(dtype).float().item()


def _widened_ok(got: int, pair: int, dtype: torch.dtype = torch.float8_e4m3fn, unit: float = 256.0,
                out: str = "bf16") -> bool:
    """Each half of a widened pair (e.g. widen_pair_scaled<Fp8E4M3, hip_bfloat16>(pair)) is the bf16 / fp16
    bits of its code's value / ``unit`` (widen_pair_unit), exactly; a NaN code any NaN of that type with the
    code's sign."""
    exp_mask, man_mask = (0x7F80, 0x7F) if out == "bf16" else (0x7C00, 0x3FF)
    for shift in (0, 16):
        half, code = (got >> shift) & 0xFFFF, (pair >> (8 + shift)) & 0xFF
        value = _value(code, dtype) / unit
        if value != value:
            if (half & exp_mask) != exp_mask or not half & man_mask or half >> 15 != code >> 7:
                return False
        elif out == "bf16" and half != struct.unpack("<I", struct.pack("<f", value))[0] >> 16:
            return False
        elif out == "fp16" and half != struct.unpack("<H", struct.pack("<e", value))[0]:
            return False
    return True


def _pairs(codes: tuple[int, ...]) -> list[int]:
    return [a << 8 | codes[(i + 5) % len(codes)] << 24 for i, a in enumerate(codes)]


def _cases() -> list[tuple[str, object]]:
    """(device expression, the expected 32-bit result or a predicate on it)."""
    cases: list[tuple[str, object]] = [(f"kvmulti::fp8_pair_of({WORD:#x}u, {j})", _fp8_pair_of(WORD, j))
                                       for j in (0, 1)]
    for lo in HALVES:
        for hi in HALVES[::2]:
            cases.append((f"kvmulti::f16x2_to_bf16x2({hi << 16 | lo:#x}u)", _f16x2_to_bf16x2(hi << 16 | lo)))
    for pair in _pairs(E4M3_CODES):
        cases.append((f"kvmulti::widen_pair_scaled<kvmulti::Fp8E4M3, hip_bfloat16>({pair:#x}u)",
                      lambda got, pair=pair: _widened_ok(got, pair)))
    fnuz = [("widen_pair<kvmulti::Fp8E4M3Fnuz, __half>", torch.float8_e4m3fnuz, 1.0, "fp16"),
            ("widen_pair_scaled<kvmulti::Fp8E4M3Fnuz, hip_bfloat16>", torch.float8_e4m3fnuz, 128.0, "bf16"),
            ("widen_pair<kvmulti::Fp8E5M2Fnuz, __half>", torch.float8_e5m2fnuz, 1.0, "fp16"),
            ("widen_pair<kvmulti::Fp8E5M2Fnuz, hip_bfloat16>", torch.float8_e5m2fnuz, 1.0, "bf16")]
    for func, dtype, unit, out in fnuz:
        for pair in _pairs(FNUZ_CODES):
            cases.append((f"kvmulti::{func}({pair:#x}u)",
                          lambda got, pair=pair, d=dtype, u=unit, o=out: _widened_ok(got, pair, d, u, o)))
    return cases


#: AMDGPU inline constants the assembler prints as floats (their fp32 bit patterns)
_INLINE_FLOATS = {"0.5": 0x3F000000, "-0.5": 0xBF000000, "1.0": 0x3F800000, "-1.0": 0xBF800000,
                  "2.0": 0x40000000, "-2.0": 0xC0000000, "4.0": 0x40800000, "-4.0": 0xC0800000}


def _operand(text: str) -> int:
    return _INLINE_FLOATS[text] if text in _INLINE_FLOATS else int(text, 0) & 0xFFFFFFFF


def _folded_constants(tmp_path, exprs: list[str]) -> list[int | None]:
    src = tmp_path / "permutes.hip"
    body = "".join(f"__global__ void kvm_case_{i}(unsigned* o) {{ o[0] = {e}; }}\n" for i, e in enumerate(exprs))
    src.write_text(f'#include "kvmulti_prefill.hip"\n{body}')
    asm = tmp_path / "permutes.s"
    cmd = [cc.hipcc(), "-O3", "-std=c++17", f"--offload-arch={ARCH}", "--cuda-device-only", "-S",
           "-I", str(cc.HIP_DIR), str(src), "-o", str(asm)]
    proc = subprocess.run(cmd, env=dict(os.environ, HIP_PLATFORM="amd"), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    funcs = cc.split_functions(asm.read_text())
    out = []
    for i in range(len(exprs)):
        lines = next(v for k, v in funcs.items() if f"kvm_case_{i}P" in k)
        store = next((ln for ln in lines if "global_store_dword " in ln), None)
        value = None
        if store is not None and not any(ln.strip().startswith("v_perm") for ln in lines):
            reg = store.split()[2].rstrip(",")
            for ln in lines:
                m = re.match(rf"\s*v_mov_b32_e32 {reg}, (\S+)$", ln)
                if m:
                    value = _operand(m.group(1))
                m = re.match(rf"\s*v_bfrev_b32_e32 {reg}, (\S+)$", ln)    # a constant materialised reversed
                if m:
                    value = int(f"{_operand(m.group(1)):032b}"[::-1], 2)
        out.append(value)
    return out


def test_device_bit_paths_fold_to_the_harness_formulas(tmp_path):
    _require(amd=True, nvidia=False)
    cases = _cases()
    got = _folded_constants(tmp_path, [e for e, _ in cases])
    for (expr, expect), value in zip(cases, got):
        assert value is not None, f"{expr}: not folded to one constant"
        if callable(expect):
            assert expect(value), f"{expr}: {value:#010x}"
        else:
            assert value == expect, f"{expr}: {value:#010x}, want {expect:#010x}"
