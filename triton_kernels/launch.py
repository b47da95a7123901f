"""Host side of the Triton kernels: tile choices, the split-KV heuristic, the launches, and the
list of compiled specialisations (used by the cross-compilation test).

Importing this module imports triton; ``kvmulti.backends.triton`` imports it lazily.

Split-KV heuristic (:func:`plan_attention`): the single-pass kernel runs one program per
(q-block, KV head). A decode-only batch (every ``query_len == 1``) of few requests gives
``num_reqs * num_kv_heads`` programs, each walking a whole long context; when that is fewer than
the device's compute units (SMs / CUs) and the longest context spans at least two partitions
(``max_seq_len >= 2 * partition_size``), the context is cut into partitions of
``partition_size`` positions (one program each) and a second kernel reduces the partial
softmaxes. Everything else (any prefill / verification row, many requests, short contexts)
takes the single pass. ``split_kv=True/False`` forces a path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from .unified_attention import reduce_partitions_kernel, unified_attention_kernel
from .write_kv import write_kv_kernel

DEFAULT_PARTITION_SIZE = 512
#: Head sizes (K and V) the kernels are built and cross-compile-tested for: any size up to this,
#: padded inside the kernel to the next power of two >= 16.
MAX_HEAD_SIZE = 256
HEAD_PADS = (16, 32, 64, 128, 256)
REDUCE_PART_CHUNK = 16
_TORCH_TO_TRITON = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def head_pad(size: int) -> int:
    return max(16, triton.next_power_of_2(max(size, 1)))


@dataclass(frozen=True)
class AttentionPlan:
    split: bool
    block_m: int            # tile rows = block_q tokens x G query heads (padded)
    block_q: int            # new tokens per program
    tile_n: int             # key positions per inner iteration
    head_pad: int
    head_pad_v: int
    partition_size: int     # key positions per partition (split path)
    num_parts: int          # partitions (1 on the single pass)
    num_warps: int = 4
    num_stages: int = 2


def tile_sizes(decode: bool, num_qpk: int, head_pad_: int, head_pad_v: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, TILE_N). Decode rows are one token x G heads; prefill tiles hold several tokens."""
    widest = max(head_pad_, head_pad_v)
    base_m = 16 if decode else (64 if widest <= 128 else 32)
    block_m = max(base_m, triton.next_power_of_2(num_qpk))
    if dtype == torch.float32:
        tile_n = 32 if widest <= 128 else 16      # fp32 K/V tiles of 256-wide heads must fit 64 KiB LDS
    else:
        tile_n = 64 if widest <= 128 else 32
    return block_m, tile_n


def plan_attention(*, num_reqs: int, num_kv_heads: int, num_qpk: int, max_query_len: int, max_seq_len: int,
                   head_size: int, head_size_v: int, dtype: torch.dtype, num_compute_units: int,
                   split_kv: bool | None = None, partition_size: int = DEFAULT_PARTITION_SIZE) -> AttentionPlan:
    """Tiles and path for one batch (see the module docstring for the split-KV heuristic)."""
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    if split_kv is None:
        split_kv = (max_query_len == 1 and max_seq_len >= 2 * partition_size
                    and num_reqs * num_kv_heads < num_compute_units)
    hp, hpv = head_pad(head_size), head_pad(head_size_v)
    block_m, tile_n = tile_sizes(max_query_len <= 1 or split_kv, num_qpk, hp, hpv, dtype)
    num_parts = 1
    if split_kv:
        tile_n = min(tile_n, partition_size)
        num_parts = max(1, triton.cdiv(max_seq_len, partition_size))
    return AttentionPlan(split=bool(split_kv), block_m=block_m, block_q=block_m // num_qpk, tile_n=tile_n,
                         head_pad=hp, head_pad_v=hpv, partition_size=partition_size, num_parts=num_parts)


def num_compute_units(device: torch.device) -> int:
    """SMs / CUs / Xe cores of ``device`` (1 for CPU tensors under the interpreter)."""
    return _num_compute_units(str(device))


_CU_CACHE: dict[str, int] = {}


def _num_compute_units(device: str) -> int:
    if device not in _CU_CACHE:
        dev = torch.device(device)
        count = 1
        if dev.type == "cuda":
            count = torch.cuda.get_device_properties(dev).multi_processor_count
        elif dev.type == "xpu":
            props = torch.xpu.get_device_properties(dev)
            count = getattr(props, "gpu_subslice_count", None) or getattr(props, "max_compute_units", 64)
        _CU_CACHE[device] = int(count)
    return _CU_CACHE[device]


def unified_attention(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                      cache_strides: tuple[int, int, int], block_size: int, num_kv_heads: int, head_size: int,
                      head_size_v: int, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int,
                      scale: float, sliding_window: int | None, softcap: float | None,
                      split_kv: bool | None = None, partition_size: int = DEFAULT_PARTITION_SIZE,
                      ) -> AttentionPlan:
    """Attention of ``query`` rows [:num_tokens] over the paged cache into ``out`` (one launch, or
    two on the split path). ``cache_strides`` = (block, token, head) in elements, content stride 1.
    Returns the plan it ran."""
    num_qpk = query.shape[1] // num_kv_heads
    plan = plan_attention(num_reqs=num_reqs, num_kv_heads=num_kv_heads, num_qpk=num_qpk,
                          max_query_len=max_query_len, max_seq_len=max_seq_len, head_size=head_size,
                          head_size_v=head_size_v, dtype=kv_cache.dtype,
                          num_compute_units=num_compute_units(query.device), split_kv=split_kv,
                          partition_size=partition_size)
    if num_tokens == 0 or num_reqs == 0:
        return plan
    dot_f32 = interpreting() and kv_cache.dtype == torch.bfloat16
    num_q_heads = query.shape[1]
    if plan.split:
        part_acc = torch.empty(num_tokens * num_q_heads * plan.num_parts * plan.head_pad_v,
                               dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_tokens * num_q_heads * plan.num_parts * 2, dtype=torch.float32,
                              device=query.device)
    else:
        part_acc = part_ml = out   # unused on the single pass
    grid = (num_tokens // plan.block_q + num_reqs, num_kv_heads, plan.num_parts)
    sb, st, sh = cache_strides
    unified_attention_kernel[grid](
        query, kv_cache, out, query_start_loc, seq_lens, block_table, part_acc, part_ml,
        float(scale), float(softcap or 0.0), int(sliding_window or 0),
        num_reqs, num_q_heads, num_qpk, plan.block_q, block_size, head_size, head_size_v, plan.num_parts,
        query.stride(0), query.stride(1), query.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        sb, st, sh, block_table.stride(0), block_table.stride(1),
        BLOCK_M=plan.block_m, TILE_N=plan.tile_n, HEAD_PAD=plan.head_pad, HEAD_PAD_V=plan.head_pad_v,
        SPLIT=plan.split, PART_SIZE=plan.partition_size if plan.split else 16, DOT_F32=dot_f32,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if plan.split:
        reduce_partitions_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_ml, num_q_heads, plan.num_parts, head_size_v,
            out.stride(0), out.stride(1), out.stride(2),
            HEAD_PAD_V=plan.head_pad_v, PART_CHUNK=REDUCE_PART_CHUNK, num_warps=4,
        )
    return plan


def write_block_h(num_kv_heads: int, head_pad_: int, head_pad_v: int) -> int:
    return min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // max(head_pad_, head_pad_v)))


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
             cache_strides: tuple[int, int, int], block_size: int, num_kv_heads: int, head_size: int,
             head_size_v: int) -> None:
    """Write key [T, Hkv, head_size] / value [T, Hkv, head_size_v] to ``slot_mapping``; -1 skips."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    hp, hpv = head_pad(head_size), head_pad(head_size_v)
    block_h = write_block_h(num_kv_heads, hp, hpv)
    sb, st, sh = cache_strides
    write_kv_kernel[(num_tokens, triton.cdiv(num_kv_heads, block_h))](
        key, value, kv_cache, slot_mapping, num_kv_heads, block_size, head_size, head_size_v,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        sb, st, sh, BLOCK_H=block_h, HEAD_PAD=hp, HEAD_PAD_V=hpv, num_warps=4,
    )


# -- the specialisations this package launches (cross-compiled by tests/test_triton_compile.py) ------
@dataclass(frozen=True)
class Specialisation:
    name: str
    fn: object
    signature: dict
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 2


def _attention_signature(dt: str) -> dict:
    return {
        "q_ptr": f"*{dt}", "kv_ptr": f"*{dt}", "out_ptr": f"*{dt}",
        "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "block_table_ptr": "*i32",
        "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
        "scale": "fp32", "softcap": "fp32", "window": "i32",
        "num_reqs": "i32", "num_q_heads": "i32", "num_qpk": "i32", "block_q": "i32", "block_size": "i32",
        "head_size": "i32", "head_size_v": "i32", "num_parts": "i32",
        "stride_qt": "i32", "stride_qh": "i32", "stride_qd": "i32",
        "stride_ot": "i32", "stride_oh": "i32", "stride_od": "i32",
        "stride_cb": "i64", "stride_ct": "i32", "stride_ch": "i32", "stride_bt": "i32", "stride_bn": "i32",
        "BLOCK_M": "constexpr", "TILE_N": "constexpr", "HEAD_PAD": "constexpr", "HEAD_PAD_V": "constexpr",
        "SPLIT": "constexpr", "PART_SIZE": "constexpr", "DOT_F32": "constexpr",
    }


def specialisations(dtypes=tuple(_TORCH_TO_TRITON), head_pads=HEAD_PADS, groups=(1,),
                    kernels: dict | None = None) -> list[Specialisation]:
    """The (kernel, dtype, head pad, tile, path) combinations the launchers above produce for head
    sizes <= MAX_HEAD_SIZE (K and V padded alike), GQA groups up to 16 (BLOCK_M >= 16 covers
    them; larger groups widen BLOCK_M to the next power of two), KV-write tiles of 8 heads.
    ``kernels`` maps "unified_attention" / "reduce_partitions" / "write_kv" to the JIT functions
    to use (the cross-compilation test passes copies built with the interpreter off)."""
    kernels = kernels or {"unified_attention": unified_attention_kernel,
                          "reduce_partitions": reduce_partitions_kernel, "write_kv": write_kv_kernel}
    specs = []
    for dtype in dtypes:
        dt = _TORCH_TO_TRITON[dtype]
        for hp in head_pads:
            seen = set()
            for decode, split in ((False, False), (True, False), (True, True)):
                for g in groups:
                    block_m, tile_n = tile_sizes(decode, g, hp, hp, dtype)
                    key = (block_m, tile_n, split)
                    if key in seen:
                        continue
                    seen.add(key)
                    constexprs = {"BLOCK_M": block_m, "TILE_N": tile_n, "HEAD_PAD": hp, "HEAD_PAD_V": hp,
                                  "SPLIT": split, "PART_SIZE": DEFAULT_PARTITION_SIZE if split else 16,
                                  "DOT_F32": False}
                    specs.append(Specialisation(
                        f"unified_attention[{dt},hp{hp},m{block_m},n{tile_n},{'split' if split else 'single'}]",
                        kernels["unified_attention"], _attention_signature(dt), constexprs))
            specs.append(Specialisation(
                f"reduce_partitions[{dt},hp{hp}]", kernels["reduce_partitions"],
                {"out_ptr": f"*{dt}", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "num_q_heads": "i32",
                 "num_parts": "i32", "head_size_v": "i32", "stride_ot": "i32", "stride_oh": "i32",
                 "stride_od": "i32", "HEAD_PAD_V": "constexpr", "PART_CHUNK": "constexpr"},
                {"HEAD_PAD_V": hp, "PART_CHUNK": REDUCE_PART_CHUNK}))
            for heads in (8,):
                block_h = write_block_h(heads, hp, hp)
                specs.append(Specialisation(
                    f"write_kv[{dt},hp{hp},h{block_h}]", kernels["write_kv"],
                    {"key_ptr": f"*{dt}", "value_ptr": f"*{dt}", "kv_ptr": f"*{dt}", "slot_ptr": "*i64",
                     "num_kv_heads": "i32", "block_size": "i32", "head_size": "i32", "head_size_v": "i32",
                     "stride_kt": "i32", "stride_kh": "i32", "stride_kd": "i32",
                     "stride_vt": "i32", "stride_vh": "i32", "stride_vd": "i32",
                     "stride_cb": "i64", "stride_ct": "i32", "stride_ch": "i32",
                     "BLOCK_H": "constexpr", "HEAD_PAD": "constexpr", "HEAD_PAD_V": "constexpr"},
                    {"BLOCK_H": block_h, "HEAD_PAD": hp, "HEAD_PAD_V": hp}))
    return specs
