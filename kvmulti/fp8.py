"""fp8 KV caches: the two formats, the scale arguments and the exact quantisation rule.

A cache whose ``KVCacheLayout.dtype`` is one of :data:`FP8_DTYPES` stores ``fp8(x / scale)``:
``x`` (fp32, fp16 or bf16) is widened to fp32, divided by its head's scale in fp32 (a true IEEE
division, not a multiplication by the reciprocal), clamped to the format's largest finite value
(so ±inf and overflows saturate; NaN stays NaN) and rounded to nearest, ties to even. Reads
compute ``float(fp8) * scale`` and accumulate in fp32. Every backend follows this rule bit for
bit, so a cache written by one backend reads identically in all others.

Scales reach the backends already normalised by :func:`scale_tensor`: a contiguous fp32 tensor of
shape ``[num_kv_heads]`` on the cache's device, or None for a cache that is not fp8.
"""

from __future__ import annotations

import functools
import math

import torch

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
#: dtypes of queries, keys, values and outputs (and of non-fp8 caches).
ACTIVATION_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

Scale = "float | torch.Tensor | None"


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def max_finite(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format: 448 for e4m3fn, 57344 for e5m2."""
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
        return _tensor_scale(scale, name, num_kv_heads, device)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float, an fp32 tensor or None, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be finite and > 0, got {scale}")
    return _constant_scale(float(scale), num_kv_heads, device)


def _tensor_scale(scale: torch.Tensor, name: str, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be an fp32 tensor, got {scale.dtype}")
    if tuple(scale.shape) not in ((), (num_kv_heads,)):
        raise ValueError(f"{name} must have shape [] or [num_kv_heads={num_kv_heads}], got {tuple(scale.shape)}")
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device} but the kv_cache is on {device}")
    if device.type == "cpu" and not bool(((scale > 0) & torch.isfinite(scale)).all()):
        raise ValueError(f"{name} must be finite and > 0 in every head, got {scale.tolist()}")
    return scale.expand(num_kv_heads).contiguous()


@functools.lru_cache(maxsize=64)
def _constant_scale(value: float, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    return torch.full((num_kv_heads,), value, dtype=torch.float32, device=device)
