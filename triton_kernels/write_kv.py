"""Scatter new tokens' K/V into their slots of the canonical paged KV cache, in Triton.

Grid ``(num_tokens, cdiv(num_kv_heads, BLOCK_H))``; a program copies the K and V rows of
``BLOCK_H`` heads of one token. ``slot = block * BLOCK_SIZE + offset``; a slot < 0 (padding) is
skipped, and so is a slot at or past ``num_slots`` (= num_blocks * BLOCK_SIZE): metadata is not
trusted, the kernel never writes outside the cache. The grid covers only token rows that key,
value and slot_mapping all have. The cache is addressed through its named strides (block, token, head; content stride 1,
V after the ``head_size`` K elements), the key/value inputs through their own strides, so strided
views (e.g. slices of a fused qkv projection) need no copy.

fp8 caches (``FP8`` != 0, the cache passed as its uint8 bytes): each row is divided by its head's
scale (``k_scale_ptr`` / ``v_scale_ptr``: fp32, head h's at ``h * stride_ks`` / ``h * stride_vs``;
stride 0 for one per-tensor scale) with IEEE rounding (``div_rn``) and stored as ``fp8_encode`` of
the quotient (kvmulti/fp8.py's rule, bit for bit).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import fp8_encode


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, kv_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_kv_heads, num_slots,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ct, stride_ch, stride_ks, stride_vs,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_V: tl.constexpr,
    BLOCK_H: tl.constexpr, HEAD_PAD: tl.constexpr, HEAD_PAD_V: tl.constexpr, FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    blk = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_kv_heads
    dst = kv_ptr + blk * stride_cb + offset * stride_ct + heads.to(tl.int64)[:, None] * stride_ch

    offs_d = tl.arange(0, HEAD_PAD)
    k_mask = h_ok[:, None] & (offs_d < HEAD_SIZE)[None, :]
    k = tl.load(key_ptr + tok * stride_kt + heads[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=k_mask)
    if FP8 > 0:
        k = _quantize(k, k_scale_ptr, stride_ks, heads, h_ok, FP8)
    tl.store(dst + offs_d[None, :], k, mask=k_mask)

    offs_dv = tl.arange(0, HEAD_PAD_V)
    v_mask = h_ok[:, None] & (offs_dv < HEAD_SIZE_V)[None, :]
    v = tl.load(value_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs_dv[None, :] * stride_vd,
                mask=v_mask)
    if FP8 > 0:
        v = _quantize(v, v_scale_ptr, stride_vs, heads, h_ok, FP8)
    tl.store(dst + HEAD_SIZE + offs_dv[None, :], v, mask=v_mask)


@triton.jit
def _quantize(x, scale_ptr, stride_s, heads, h_ok, FP8: tl.constexpr):
    """rows x [BLOCK_H, D] of heads ``heads`` -> uint8 codes of fp8(x / scale[head * stride_s])."""
    head_scale = tl.load(scale_ptr + heads * stride_s, mask=h_ok, other=1.0)
    return fp8_encode(tl.div_rn(x.to(tl.float32), head_scale[:, None]), FP8)
