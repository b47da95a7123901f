"""fp8 KV caches: the formats, the scale arguments and the exact quantisation rule.

Two families: the OCP formats (:data:`OCP_FP8_DTYPES`: ``float8_e4m3fn``, largest finite 448, NaN
0x7F/0xFF, a negative zero; ``float8_e5m2``, 57344, inf and NaNs) and the FNUZ formats of AMD's
gfx942 (:data:`FNUZ_FP8_DTYPES`: ``float8_e4m3fnuz``, 240; ``float8_e5m2fnuz``, 57344): exponent
bias one higher, no infinities, no negative zero, a single NaN code 0x80. Where a code is finite in
both, its FNUZ value is half its OCP value; e4m3fn's NaN 0x7F is 240 in e4m3fnuz, and e5m2's
infinities and NaNs (exponent 31) are finite in e5m2fnuz.

A cache whose ``KVCacheLayout.dtype`` is one of :data:`FP8_DTYPES` stores ``fp8(x / scale)``:
``x`` (fp32, fp16 or bf16) is widened to fp32, divided by its head's scale in fp32 (a true IEEE
division, not a multiplication by the reciprocal), clamped to the format's largest finite value
(so ±inf and overflows saturate; NaN stays NaN: in FNUZ the code 0x80; a zero is +0 there) and
rounded to nearest, ties to even. Reads compute ``float(fp8) * scale`` and accumulate in fp32.
Every backend serving a format follows this rule bit for bit, so a cache written by one backend
reads identically in all others.

Scales reach the backends already normalised by :func:`scale_tensor`: a contiguous fp32 tensor of
shape ``[num_kv_heads]`` on the cache's device, or None for a cache that is not fp8. The TRITON
backend's prepared step calls take a layer's scale as it is given instead (a ``[]`` tensor, a
``[num_kv_heads]`` tensor of any stride, a float as :func:`constant_scale`), checked by the same
functions (:func:`check_scale_float`, :func:`check_scale_tensor`, :func:`check_scale_values`).
"""

from __future__ import annotations

import functools
import math

import torch

OCP_FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
FNUZ_FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
FP8_DTYPES: tuple[torch.dtype, ...] = OCP_FP8_DTYPES + FNUZ_FP8_DTYPES
#: dtypes of queries, keys, values and outputs (and of non-fp8 caches).
ACTIVATION_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

Scale = "float | torch.Tensor | None"


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_fnuz(dtype: torch.dtype) -> bool:
    return dtype in FNUZ_FP8_DTYPES


def max_finite(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format: 448 for e4m3fn, 240 for e4m3fnuz, 57344 for e5m2
    and e5m2fnuz."""
    return float(torch.finfo(dtype).max)


def activation_dtypes(cache_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """dtypes a query / key / value may have for a cache of ``cache_dtype``: any activation dtype
    for an fp8 cache, else exactly the cache's."""
    return ACTIVATION_DTYPES if is_fp8(cache_dtype) else (cache_dtype,)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8(x / scale)`` by the module's rule. x [..., H, D]; scale fp32 [H]."""
    limit = max_finite(dtype)
    return (x.float() / scale[:, None]).clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., H, D] of the cache dtype -> fp32 values ``float(x) * scale`` (scale None: as is)."""
    return x.float() if scale is None else x.float() * scale[:, None]


def convert(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
            dst_scale: torch.Tensor | None) -> torch.Tensor:
    """Cache contents ``x`` [..., H, D] (a cache dtype, read with ``scale``: fp32 [H], None when
    not fp8) as the contents of a ``dtype`` cache read with ``dst_scale`` (fp32 [H], None when
    ``dtype`` is not fp8), on ``x``'s device. Per KV head:

    - same dtype and same scale (or neither fp8): the codes, copied bit for bit;
    - fp8 to fp8 with equal scales: ``fp8_dst(float(x))``; with different ones
      ``fp8_dst((float(x) * scale) / dst_scale)``, by :func:`quantize`'s rule (exact where the
      destination holds the value, else round to nearest even; beyond its largest finite value
      saturate; NaN to NaN);
    - fp8 to fp32/fp16/bf16: ``float(x) * scale`` rounded to nearest even (IEEE: fp16 overflows to
      inf); fp32/fp16/bf16 to fp8: :func:`quantize` ``(x, dst_scale)``; between fp32/fp16/bf16:
      the value rounded to nearest even.
    """
    if not is_fp8(x.dtype):
        return x.to(dtype) if dst_scale is None else quantize(x, dst_scale, dtype)
    if not is_fp8(dtype):
        return (x.float() * scale[:, None]).to(dtype)
    same = scale == dst_scale
    one = torch.ones_like(scale)
    out = quantize(x.float() * torch.where(same, one, scale)[:, None], torch.where(same, one, dst_scale), dtype)
    if dtype == x.dtype:                                 # equal scales keep every code (NaN signs, e5m2's inf)
        out = torch.where(same[:, None], x.view(torch.uint8), out.view(torch.uint8)).view(dtype)
    return out


def scale_tensor(scale: float | torch.Tensor | None, name: str, cache_dtype: torch.dtype, num_kv_heads: int,
                 device: torch.device) -> torch.Tensor | None:
    """The normalised form of a ``k_scale`` / ``v_scale`` argument (see the module doc).

    ``scale``: a Python float, an fp32 tensor of shape ``[]`` or ``[num_kv_heads]``, or None (1.0
    for an fp8 cache). Every scale must be finite and > 0 (tensor values are checked on CPU only,
    where checking costs no device sync). A scale given for a non-fp8 cache is an error.
    """
    if not is_fp8(cache_dtype):
        if scale is not None:
            raise ValueError(f"{name} applies to fp8 caches only; this cache holds {cache_dtype}")
        return None
    if scale is None:
        return _constant_scale(1.0, num_kv_heads, device)
    if isinstance(scale, torch.Tensor):
        check_scale_tensor(scale, name, num_kv_heads, device)
        check_scale_values(scale, name)
        return scale.expand(num_kv_heads).contiguous()
    return _constant_scale(check_scale_float(scale, name), num_kv_heads, device)


def check_scale_float(scale: object, name: str) -> float:
    """A scale argument that is not a tensor: a finite Python float (or int) > 0, returned as a float."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float, an fp32 tensor or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be finite and > 0, got {scale}")
    return float(scale)


def check_scale_tensor(scale: torch.Tensor, name: str, num_kv_heads: int, device: torch.device) -> None:
    """A scale tensor's form: fp32, shape ``[]`` (per tensor) or ``[num_kv_heads]`` (per head, any
    stride), on the cache's ``device``. Its values: :func:`check_scale_values`."""
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be an fp32 tensor, got {scale.dtype}")
    if tuple(scale.shape) not in ((), (num_kv_heads,)):
        raise ValueError(f"{name} must have shape [] or [num_kv_heads={num_kv_heads}], got {tuple(scale.shape)}")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device} but the kv_cache is on {device}")


def check_scale_values(scale: torch.Tensor, name: str) -> None:
    """Every value of a scale tensor is finite and > 0; checked for CPU tensors only (elsewhere it
    would cost a device sync)."""
    if scale.device.type == "cpu" and not bool(((scale > 0) & torch.isfinite(scale)).all()):
        raise ValueError(f"{name} must be finite and > 0 in every head, got {scale.tolist()}")


@functools.lru_cache(maxsize=64)
def _constant_scale(value: float, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    return torch.full((num_kv_heads,), value, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=64)
def constant_scale(value: float, device: torch.device) -> torch.Tensor:
    """A per-tensor scale ``value`` (checked by :func:`check_scale_float`) as an fp32 ``[]`` tensor
    on ``device``, made once per value and device. The cache is bounded: a caller that needs the
    tensor's address to stay valid (a captured graph reads it) keeps a reference of its own."""
    return torch.full((), value, dtype=torch.float32, device=device)
