"""The SYCL attention kernels' tile shape and build options (kernels.cpp's -D options), and which
body a device gets: the vector body or the matrix body on the sub-group matrix built-ins (real or
emulated)."""

from __future__ import annotations

import torch

from .runtime import DTYPE_CODES, SyclError

#: Tile shape of the attention kernels (build options of kernels.cpp).
ROWS = 64          # (query token, query head) rows per work-group (the matrix path: 8 row groups of 8)
WG = 128           # work-items per attention work-group (the largest of WG_CHOICES that fits)
WG_CHOICES = (128, 64, 32, 16)   # the merge scratch grows with the sub-groups per work-group
SG = 16            # sub-group size the attention kernels require (KVM_SG)
RB = 4             # tile rows held in registers per pass over the keys (KVM_RB; the vector path)
MR = 8             # rows of one matrix built-in call (the matrix path's row group)
#: KVM_MMA: 0 the vector path (fp32; fp16 / bf16 on GPUs without the built-ins, e.g. DG2), 1 the matrix
#: path with the built-ins emulated by sub-group broadcasts (non-GPU devices: the OpenCL CPU device),
#: 2 the matrix path on the built-ins (devices with matrix_sg16, e.g. PVC)
MMA_OFF, MMA_EMULATED, MMA_HARDWARE = range(3)
REDUCE_WG = 64
WRITE_WG = 256


def lm_floats(head_size_v: int, wg: int, matrix: bool, narrow: bool = False) -> int:
    """Floats of the merge scratch of the attention kernels: the vector body's (LM_FLOATS in
    kernels.cpp), the matrix bundles' kvm_paged_prefill (MMA_LM_FLOATS), or with ``narrow`` their
    kvm_paged_attention (MMA_DECODE_LM_FLOATS: the first key split keeps its rows in registers);
    at least 1."""
    if not matrix:
        return (wg // SG) * min(RB, ROWS) * (head_size_v + 2)
    return max(1, (wg // SG - (1 if narrow else 0)) * MR * (head_size_v + 2))


def prefill_lm_floats(head_size: int, head_size_v: int, wg: int, matrix: bool) -> int:
    """Floats of kvm_paged_prefill's scratch: in a matrix bundle whose head sizes the rows-on-lanes
    body takes (multiples of 16, up to 128), that body's (MMA_PREFILL_LM_FLOATS in kernels.cpp: the
    query fragments, or the key splits' merge of half rows, whichever is larger); else the attention
    body's (:func:`lm_floats`)."""
    full = lm_floats(head_size_v, wg, matrix)
    q_floats = -(-ROWS // 16) * -(-head_size // 16) * 128
    if not (matrix and head_size % 16 == 0 and head_size_v % 16 == 0 and max(head_size, head_size_v) <= 128
            and q_floats <= full):
        return full
    return max(q_floats, (wg // SG) * MR * (head_size_v // 2 + 2))


def choose_wg(head_size_v: int, local_mem: int, matrix: bool) -> int:
    """The largest attention work-group size whose merge scratch fits the device's local memory."""
    for wg in WG_CHOICES:
        if 4 * lm_floats(head_size_v, wg, matrix) <= local_mem - 1024:
            return wg
    raise SyclError(f"head size {head_size_v} needs more local memory than the device has ({local_mem} B)")


#: KVM_CACHE codes of the fp8 cache formats (kernels.cpp; kvmulti/fp8.py)
FP8_CACHE_CODES = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4, torch.float8_e4m3fnuz: 5,
                   torch.float8_e5m2fnuz: 6}


def vector_bytes(dtype: torch.dtype, head_size: int, head_size_v: int, cache_dtype: torch.dtype | None = None) -> int:
    """Bytes of one per-lane K/V vector load (VW * cache element size in kernels.cpp; VW from the
    activation ``dtype``): the cache base pointer must be aligned to it. ``cache_dtype``: an fp8
    cache's dtype, None when the cache holds ``dtype``."""
    size = dtype.itemsize
    v = 16 // size
    while v > 1 and (head_size % v or head_size_v % v):
        v //= 2
    return v * (cache_dtype or dtype).itemsize


def matrix_mode(dtype: torch.dtype, matrix_sg16: bool, gpu: bool = False) -> int:
    """KVM_MMA for activations of ``dtype`` on a device with (``matrix_sg16``) or without the
    sub-group-16 matrix built-ins, a GPU (``gpu``) or not: fp16 / bf16 take the matrix path, emulated
    on non-GPU devices that lack the built-ins (so the CPU device runs the matrix path's layout); a
    GPU without them (DG2) takes the vector path, which needs fewer registers than the emulation;
    fp32 takes the vector path."""
    if dtype not in (torch.float16, torch.bfloat16):
        return MMA_OFF
    if matrix_sg16:
        return MMA_HARDWARE
    return MMA_OFF if gpu else MMA_EMULATED


def split_keys(mma: int) -> bool:
    """KVM_SPLIT_KEYS for a build of matrix mode ``mma``: kvm_paged_prefill's key loop split into masked
    and unmasked loops (a copy of the step each) where the built-ins are the hardware's; one loop where
    they are emulated (the copies would make the OpenCL CPU device's build of a bundle ~4x as long)."""
    return mma == MMA_HARDWARE


def kernel_options(dtype: torch.dtype, head_size: int, head_size_v: int, wg: int = WG,
                   cache_dtype: torch.dtype | None = None, terms: bool = False,
                   matrix_sg16: bool = False, gpu: bool = False) -> list[str]:
    """Build options of kernels.cpp for activations (query, key, value, out) of ``dtype`` and a
    cache of ``dtype`` (``cache_dtype`` None) or of the fp8 ``cache_dtype``, on a device with
    (``matrix_sg16``) or without the sub-group-16 matrix built-ins, a GPU (``gpu``) or not (see
    :func:`matrix_mode`); ``terms``: the bundle also holds
    kvm_paged_attention_terms (ALiBi / non-causal). The hardware matrix path also asks for the
    256-register mode (KVM_LARGE_GRF: a GPU-only kernel property)."""
    cache = [f"-DKVM_CACHE={FP8_CACHE_CODES[cache_dtype]}"] if cache_dtype in FP8_CACHE_CODES else []
    cache += ["-DKVM_TERMS=1"] if terms else []
    mma = matrix_mode(dtype, matrix_sg16, gpu)
    grf = ["-DKVM_LARGE_GRF=1"] if mma == MMA_HARDWARE else []
    return [f"-DKVM_DTYPE={DTYPE_CODES[dtype]}", f"-DKVM_HEAD_SIZE={head_size}", f"-DKVM_HEAD_SIZE_V={head_size_v}",
            f"-DKVM_ROWS={ROWS}", f"-DKVM_WG={wg}", f"-DKVM_SG={SG}", f"-DKVM_RB={RB}", f"-DKVM_MMA={mma}",
            f"-DKVM_SPLIT_KEYS={int(split_keys(mma))}"] + grf + cache
