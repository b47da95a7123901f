"""fp8 KV-cache codecs for the Triton kernels, on the cache's raw bytes (kvmulti/fp8.py's rule).

The kernels see an fp8 cache as ``uint8`` and convert with integer operations and bitcasts only:
the Triton interpreter (``TRITON_INTERPRET=1``, numpy underneath) has no fp8 types, and integer
code compiles identically for NVIDIA and AMD targets. The format is a constexpr ``FP8``:
:data:`FP8_NONE` (not an fp8 cache), :data:`FP8_E4M3` (``torch.float8_e4m3fn``),
:data:`FP8_E5M2` (``torch.float8_e5m2``), :data:`FP8_E4M3FNUZ` (``torch.float8_e4m3fnuz``) or
:data:`FP8_E5M2FNUZ` (``torch.float8_e5m2fnuz``). Where a code is finite in both, its FNUZ
value is half its OCP value (exponent bias one higher); 0x80 is the one FNUZ NaN.

* :func:`fp8_decode` (read): e5m2 is the upper byte of an fp16, so its bits shifted left by 8 are
  that fp16 exactly (subnormals, inf and NaN included). e4m3fn's 4 exponent / 3 mantissa bits
  shifted left by 7 are an fp16 whose value is 2**-8 times the fp8's (exponent bias 15 vs 7,
  subnormals included); the code 0x7F (either sign) is NaN. e4m3fnuz: the same fp16 times 2**7.
  e5m2fnuz: the e5m2 fp16 halved, except exponent 31 (finite in FNUZ), read as exponent 30 unhalved.
* :func:`fp8_encode` (write): the fp32 quotient's bits are saturated to the format's largest
  finite value (so ±inf saturate; NaN is kept apart and becomes 0x7F with its sign), then rounded
  to nearest, ties to even, in integers: the normal range by adding half an fp8 ulp minus one plus
  the kept lowest bit and truncating (a carry moves into the exponent, as it must); the subnormal
  range by shifting the 24-bit significand right by its distance to the fp8 subnormal quantum,
  with the same rounding term. FNUZ: the same with its bias; NaN becomes 0x80 and a zero drops its
  sign. Bit-identical to ``torch.Tensor.to(fp8)`` of the clamped quotient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_NONE, FP8_E4M3, FP8_E5M2, FP8_E4M3FNUZ, FP8_E5M2FNUZ = 0, 1, 2, 3, 4
_CODES = {torch.float8_e4m3fn: FP8_E4M3, torch.float8_e5m2: FP8_E5M2, torch.float8_e4m3fnuz: FP8_E4M3FNUZ,
          torch.float8_e5m2fnuz: FP8_E5M2FNUZ}


def fp8_code(dtype: torch.dtype) -> int:
    """The kernels' ``FP8`` constexpr for a cache dtype (FP8_NONE for fp32/fp16/bf16 caches)."""
    return _CODES.get(dtype, FP8_NONE)


def raw_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels address: an fp8 cache as its uint8 bytes (same shape and strides),
    any other cache as is."""
    return kv_cache.view(torch.uint8) if fp8_code(kv_cache.dtype) != FP8_NONE else kv_cache


@triton.jit
def fp8_decode(bits, FP8: tl.constexpr):
    """uint8 fp8 codes -> their fp32 values (exact)."""
    b = bits.to(tl.int32) & 0xFF
    if FP8 == 2:      # e5m2
        half = (b << 8).to(tl.uint16).to(tl.float16, bitcast=True)
        return half.to(tl.float32)
    elif FP8 == 4:    # e5m2fnuz
        top = (b & 0x7C) == 0x7C
        half = ((b << 8) - tl.where(top, 1 << 10, 0)).to(tl.uint16).to(tl.float16, bitcast=True)
        return tl.where(b == 0x80, float("nan"), half.to(tl.float32) * tl.where(top, 1.0, 0.5))
    elif FP8 == 3:    # e4m3fnuz
        half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
        return tl.where(b == 0x80, float("nan"), half.to(tl.float32) * 128.0)
    else:             # e4m3fn
        half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
        return tl.where((b & 0x7F) == 0x7F, float("nan"), half.to(tl.float32) * 256.0)


@triton.jit
def fp8_encode(y, FP8: tl.constexpr):
    """fp32 values -> uint8 fp8 codes: saturating, round to nearest even, NaN kept."""
    if FP8 == 2:      # e5m2: 2 mantissa bits, bias 15, largest finite 57344
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        MAX_BITS: tl.constexpr = 0x47600000
    elif FP8 == 4:    # e5m2fnuz: bias 16, largest finite 57344
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 16
        MAX_BITS: tl.constexpr = 0x47600000
    elif FP8 == 3:    # e4m3fnuz: bias 8, largest finite 240
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 8
        MAX_BITS: tl.constexpr = 0x43700000
    else:             # e4m3fn: 3 mantissa bits, bias 7, largest finite 448
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MAX_BITS: tl.constexpr = 0x43E00000
    SHIFT: tl.constexpr = 23 - MANT
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    mag = tl.minimum(tl.where(is_nan, 0, mag), MAX_BITS)
    exponent = mag >> 23
    normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
    # subnormal: the significand in units of the fp8 quantum 2**(1 - BIAS - MANT), rounded
    shift = tl.minimum(tl.maximum((151 - BIAS - MANT) - exponent, 1), 31)
    significand = (mag & 0x7FFFFF) | 0x800000
    subnormal = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    code = tl.where(exponent >= 128 - BIAS, normal, subnormal)
    if FP8 >= 3:      # FNUZ: one NaN, no negative zero
        code = tl.where(is_nan, 0x80, tl.where(code == 0, 0, code | sign))
    else:
        code = tl.where(is_nan, 0x7F, code) | sign
    return code.to(tl.uint8)


@triton.jit
def codec_kernel(src_ptr, dst_ptr, n, ENCODE: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr):
    """dst = encode(src) (fp32 -> uint8) or decode(src) (uint8 -> fp32), elementwise; for tests."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(src_ptr + offs, mask=ok)
    if ENCODE:
        tl.store(dst_ptr + offs, fp8_encode(x, FP8), mask=ok)
    else:
        tl.store(dst_ptr + offs, fp8_decode(x, FP8), mask=ok)


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` -> uint8 codes of ``dtype`` through :func:`fp8_encode` (for tests)."""
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _run_codec(x.contiguous(), out, True, dtype)
    return out


def decode(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 codes of ``dtype`` -> fp32 through :func:`fp8_decode` (for tests)."""
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    _run_codec(codes.contiguous(), out, False, dtype)
    return out


def _run_codec(src: torch.Tensor, dst: torch.Tensor, encode_: bool, dtype: torch.dtype) -> None:
    n, block = src.numel(), 1024
    if n:
        codec_kernel[(triton.cdiv(n, block),)](src, dst, n, ENCODE=encode_, FP8=fp8_code(dtype), BLOCK=block)
