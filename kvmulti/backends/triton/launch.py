"""Host side of the Triton kernels (sources in the top-level ``triton_kernels/``): tile choices, the split-KV heuristic, the launches, and the
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

Tiles per target family (:func:`tile_sizes`, :func:`pipeline_stages`), chosen from the static
report ``benchmarks/gpu_report.py``: on AMD, tiles of 32 key positions keep a decode work-group's
LDS under 32 KiB, so two or more fit a CU's 64 KiB, and short mixed steps run unpipelined; on NVIDIA, the
next tile's K/V loads are in flight during this tile's dots (``kv_tiles_in_flight_at_dot`` of
devtools/triton_cross_compile.py reads that from the TTGIR) at 3 stages. A tile that lies in one block or covers at most
:data:`MAX_TABLE_READS` whole blocks reads the block table once per block, as scalars
(:func:`table_reads`); with smaller blocks the table is read per key position, that read takes a
pipeline stage of its own, and fp16 / bf16 decode needs 5 stages for the same overlap. Other
targets (XPU, the interpreter) keep the base tiles. A few choices also depend on the Triton
release (tiles.py: those that spill with a release before 3.9 take an alternative there).

Prefill (:data:`PREFILL_MIN_QUERY_LEN`, :func:`prefill_tiles`): a step whose longest query has at
least 64 new tokens and whose dots run on 16-bit operands gets the matrix-unit tiles of its target
family (on NVIDIA also of its generation, :func:`device_arch`) and the kernel's prefill loop (interior key tiles without a per-score mask); every row of the
step, decode rows included, runs in those tiles. The tiles depend on the head size, the cache dtype,
the sliding window and the softcap (the per-step plan knows the window; a launch with a softcap
plans its prefill tiles again).

Memory safety: the launchers pass the kernels the bounds of every tensor that metadata indexes
(usable query/output rows, block-table rows and columns, cache blocks, cache slots); the kernels
guard every metadata-derived index with them (see the kernels' docstrings).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from ...fp8 import FP8_DTYPES
from ...settings import DEFAULT_PARTITION_SIZE
from ...triton_kernels.fp8 import fp8_code, raw_cache
from ...triton_kernels.unified_attention import reduce_partitions_kernel, unified_attention_kernel
from ...triton_kernels.write_kv import write_kv_kernel
from .tiles import (FAMILIES, MAX_TABLE_READS, PREFILL_MIN_QUERY_LEN, PrefillTiles, base_warps,  # noqa: F401
                    pipeline_stages, prefill_tiles, table_reads, tile_sizes, triton_version)

#: Head sizes (K and V) the kernels are built and cross-compile-tested for: any size up to this,
#: padded inside the kernel to the next power of two >= 16.
MAX_HEAD_SIZE = 256
HEAD_PADS = (16, 32, 64, 128, 256)
REDUCE_PART_CHUNK = 16


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
    table_reads: int = 0    # block-table reads per key tile as scalars (0: one per key position)
    num_warps: int = 4
    num_stages: int = 2
    prefill: bool = False   # prefill_tiles' tiles and the kernel's prefill loop (interior tiles unmasked)


def device_family(device: torch.device) -> str:
    """"nvidia", "amd" (a ROCm build's cuda device) or "other" (XPU, CPU tensors under the interpreter)."""
    if torch.device(device).type != "cuda":
        return "other"
    return "amd" if torch.version.hip else "nvidia"


def device_arch(device: torch.device) -> int | None:
    """An NVIDIA device's compute capability as major x 10 + minor (90: Hopper); None elsewhere."""
    dev = torch.device(device)
    return _device_arch(str(dev)) if dev.type == "cuda" and not torch.version.hip else None


@functools.lru_cache(maxsize=None)
def _device_arch(device: str) -> int:
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return 10 * major + minor


def plan_attention(*, num_reqs: int, num_kv_heads: int, num_qpk: int, max_query_len: int, max_seq_len: int,
                   head_size: int, head_size_v: int, dtype: torch.dtype, num_compute_units: int, block_size: int,
                   split_kv: bool | None = None, partition_size: int = DEFAULT_PARTITION_SIZE,
                   family: str = "other", query_dtype: torch.dtype | None = None,
                   sliding_window: int | None = None, softcap: float | None = None,
                   arch: int | None = None, version: tuple[int, int] | None = None) -> AttentionPlan:
    """Tiles and path for one batch (see the module docstring for the split-KV heuristic).
    ``dtype``: the cache's; ``query_dtype``: the query's when it matters for the tiles (an fp8 cache
    read by fp32 queries; None: the cache's); ``sliding_window`` / ``softcap``: the layer's (None or 0:
    none), which the prefill tiles depend on; ``arch``: :func:`device_arch` of the device;
    ``version``: the Triton release (major, minor) that compiles the launch (None: the running one,
    :func:`triton_version`), for the few tiles that differ per release (tiles.py)."""
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    version = triton_version() if version is None else version
    if split_kv is None:
        split_kv = (max_query_len == 1 and max_seq_len >= 2 * partition_size
                    and num_reqs * num_kv_heads < num_compute_units)
    hp, hpv = head_pad(head_size), head_pad(head_size_v)
    decode = max_query_len <= 1 or split_kv
    block_m, tile_n = tile_sizes(decode, num_qpk, hp, hpv, dtype, family, query_dtype)
    dots_16bit = not (dtype == torch.float32 or dtype in FP8_DTYPES and query_dtype == torch.float32)
    big = (prefill_tiles(family, max(hp, hpv), dots_16bit, exact_head=(head_size, head_size_v) == (hp, hpv),
                         window=bool(sliding_window), softcap=bool(softcap), fp8=dtype in FP8_DTYPES, arch=arch,
                         version=version)
           if not split_kv and max_query_len >= PREFILL_MIN_QUERY_LEN else None)
    if big is not None:
        block_m, tile_n = max(big.block_m, triton.next_power_of_2(num_qpk)), big.tile_n
    num_parts = 1
    if split_kv:
        tile_n = min(tile_n, partition_size)
        num_parts = max(1, triton.cdiv(max_seq_len, partition_size))
    reads = table_reads(block_size, tile_n)
    if not reads and family in ("nvidia", "amd"):
        # a table read per key position holds a lane mask per key: smaller tiles (gpu_report: no spills)
        tile_n = min(tile_n, 16 if family == "amd" else 32)
        reads = table_reads(block_size, tile_n)
    warps, stages = ((big.num_warps, big.num_stages) if big is not None else
                     (base_warps(family, not dots_16bit, max(hp, hpv), version),
                      pipeline_stages(decode, family, dtype, reads, max(hp, hpv), version)))
    return AttentionPlan(split=bool(split_kv), block_m=block_m, block_q=block_m // num_qpk, tile_n=tile_n,
                         head_pad=hp, head_pad_v=hpv, partition_size=partition_size, num_parts=num_parts,
                         table_reads=reads, num_warps=warps, num_stages=stages, prefill=big is not None)


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


@dataclass
class Launch:
    """One kernel launch, fully described: ``args`` names every kernel parameter (constexprs too).

    The launchers below only build these and run them, so the cross-compilation test can compile
    exactly what a launch would JIT (same arguments, hence the same specialisation)."""
    kernel: str             # key of KERNELS
    grid: tuple
    args: dict
    num_warps: int = 4
    num_stages: int = 2


KERNELS = {"unified_attention": unified_attention_kernel, "reduce_partitions": reduce_partitions_kernel,
           "write_kv": write_kv_kernel}


def run(launches: list[Launch]) -> None:
    for launch in launches:
        KERNELS[launch.kernel][launch.grid](**launch.args, num_warps=launch.num_warps, num_stages=launch.num_stages)


def attention_launches(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *,
                       cache_strides: tuple[int, int, int], block_size: int, num_kv_heads: int, head_size: int,
                       head_size_v: int, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int,
                       scale: float, sliding_window: int | None, softcap: float | None,
                       split_kv: bool | None = None, partition_size: int = DEFAULT_PARTITION_SIZE,
                       num_compute_units_: int | None = None,
                       family: str | None = None,
                       plan: AttentionPlan | None = None, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None,
                       sinks: torch.Tensor | None = None,
                       alibi_slopes: torch.Tensor | None = None,
                       causal: bool = True, arch: int | None = None, version: tuple[int, int] | None = None,
                       workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[AttentionPlan, list[Launch]]:
    """The plan (``plan`` when given: made once per step by the backend's per-step hook) and the
    launches (one, or two on the split path) for one attention call; the split path's fp32
    workspace is ``workspace`` (:func:`split_workspace`, made once per step) or allocated here. ``family`` and ``arch`` (default: the query's device's, see
    :func:`device_arch`) pick the target's tiles, ``version`` the Triton release's (default: the
    running one); the cross-compilation names them.

    Bounds for the kernels come from the tensors, not the metadata values: rows =
    min(num_tokens, query rows, out rows); requests = min(num_reqs, len(seq_lens),
    len(query_start_loc) - 1); the block table's shape; the cache's num_blocks; max_seq_len is
    capped at the table's width in positions (the kernel stops there).

    An fp8 cache needs ``k_scale`` / ``v_scale`` (fp32 ``[]`` or ``[num_kv_heads]``, kvmulti/fp8.py;
    :func:`_scale_args`); the query (and ``out``) may then be fp32, fp16 or bf16. ``sinks``: fp32
    [num_q_heads] attention-sink logits on the query's device (checked here: the kernels read num_q_heads of them), or None;
    ``alibi_slopes`` likewise fp32 [num_q_heads] ALiBi slopes, or None. ``causal=False``: every row
    sees all ``seq_len`` keys of its request, with a window only those with |q_pos - k_pos| < window."""
    if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()
                              or sinks.shape != (query.shape[1],) or sinks.device != query.device):
        raise ValueError(f"sinks must be a contiguous fp32 [{query.shape[1]}] tensor on {query.device}")
    if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32 or not alibi_slopes.is_contiguous()
                                     or alibi_slopes.shape != (query.shape[1],)
                                     or alibi_slopes.device != query.device):
        raise ValueError(f"alibi_slopes must be a contiguous fp32 [{query.shape[1]}] tensor on {query.device}")
    num_qpk = query.shape[1] // num_kv_heads
    if family is None:
        family, arch = device_family(query.device), device_arch(query.device)
    max_seq_len = max(0, min(max_seq_len, block_table.shape[1] * block_size))   # keys past the table: never read
    # over an fp8 cache the dots run in the query's dtype: fp32 queries take fp32 tiles (the per-step
    # plan only knows the cache)
    fp32_over_fp8 = kv_cache.dtype in FP8_DTYPES and query.dtype == torch.float32
    # a softcap changes the prefill tiles, and the per-step plan does not know the layer's softcap
    if plan is not None and (fp32_over_fp8 or plan.prefill and softcap):
        split_kv, partition_size, plan = plan.split, plan.partition_size, None
    if plan is None:
        plan = plan_attention(num_reqs=num_reqs, num_kv_heads=num_kv_heads, num_qpk=num_qpk,
                              max_query_len=max_query_len, max_seq_len=max_seq_len, head_size=head_size,
                              head_size_v=head_size_v, dtype=kv_cache.dtype, query_dtype=query.dtype,
                              num_compute_units=(num_compute_units(query.device) if num_compute_units_ is None
                                                 else num_compute_units_),
                              block_size=block_size, split_kv=split_kv, partition_size=partition_size,
                              family=family, sliding_window=sliding_window, softcap=softcap, arch=arch,
                              version=version)
    num_rows = min(num_tokens, query.shape[0], out.shape[0])
    num_reqs = min(num_reqs, seq_lens.shape[0], query_start_loc.shape[0] - 1)
    if num_rows <= 0 or num_reqs <= 0:
        return plan, []
    dot_f32 = interpreting() and query.dtype == torch.bfloat16
    fp8 = fp8_code(kv_cache.dtype)
    k_scale, v_scale, stride_ks, stride_vs = _scale_args(fp8, k_scale, v_scale, num_kv_heads, out)
    num_q_heads = query.shape[1]
    if plan.split:
        part_acc, part_ml = split_workspace(plan, num_rows, num_q_heads, query.device) if workspace is None \
            else workspace
        if part_acc.numel() < num_rows * num_q_heads * plan.num_parts * plan.head_pad_v \
                or part_ml.numel() < num_rows * num_q_heads * plan.num_parts * 2:
            raise ValueError(f"the split-KV workspace holds {part_acc.numel()} / {part_ml.numel()} values, the "
                             f"launch needs {num_rows} rows x {num_q_heads} heads x {plan.num_parts} partitions")
    else:
        part_acc = part_ml = out   # unused on the single pass
    sb, st, sh = cache_strides
    args = dict(
        q_ptr=query, kv_ptr=raw_cache(kv_cache), out_ptr=out, qsl_ptr=query_start_loc, seq_lens_ptr=seq_lens,
        block_table_ptr=block_table, part_acc_ptr=part_acc, part_ml_ptr=part_ml, k_scale_ptr=k_scale,
        v_scale_ptr=v_scale, sinks_ptr=out if sinks is None else sinks,
        alibi_ptr=out if alibi_slopes is None else alibi_slopes,
        scale=float(scale), num_reqs=num_reqs, num_q_heads=num_q_heads, num_parts=plan.num_parts,
        num_rows=num_rows, num_blocks=kv_cache.shape[0], table_rows=block_table.shape[0],
        table_cols=block_table.shape[1],
        stride_qt=query.stride(0), stride_qh=query.stride(1), stride_qd=query.stride(2),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
        stride_bt=block_table.stride(0), stride_bn=block_table.stride(1),
        stride_ks=stride_ks, stride_vs=stride_vs,
        STRIDE_CB=sb, STRIDE_CT=st, STRIDE_CH=sh, WINDOW=int(sliding_window or 0), SOFTCAP=float(softcap or 0.0),
        NUM_QPK=num_qpk, BLOCK_Q=plan.block_q, BLOCK_SIZE=block_size, HEAD_SIZE=head_size, HEAD_SIZE_V=head_size_v,
        BLOCK_M=plan.block_m, TILE_N=plan.tile_n, HEAD_PAD=plan.head_pad, HEAD_PAD_V=plan.head_pad_v,
        SPLIT=plan.split, PART_SIZE=plan.partition_size if plan.split else 16, DOT_F32=dot_f32, FP8=fp8,
        TABLE_READS=plan.table_reads, PREFILL=plan.prefill, SINKS=sinks is not None, CAUSAL=bool(causal),
        ALIBI=alibi_slopes is not None,
    )
    grid = (num_rows // plan.block_q + num_reqs, num_kv_heads, plan.num_parts)
    launches = [Launch("unified_attention", grid, args, plan.num_warps, plan.num_stages)]
    if plan.split:
        launches.append(Launch("reduce_partitions", (num_rows, num_q_heads), dict(
            out_ptr=out, part_acc_ptr=part_acc, part_ml_ptr=part_ml, sinks_ptr=out if sinks is None else sinks,
            num_q_heads=num_q_heads,
            num_parts=plan.num_parts,
            stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
            HEAD_SIZE_V=head_size_v, HEAD_PAD_V=plan.head_pad_v, PART_CHUNK=REDUCE_PART_CHUNK,
            SINKS=sinks is not None)))
    return plan, launches


def split_workspace(plan: AttentionPlan, num_rows: int, num_q_heads: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split path's fp32 workspace for ``num_rows`` query rows of ``num_q_heads`` heads: the
    partial outputs [rows * heads * parts * head_pad_v] and their (max, sum) pairs
    [rows * heads * parts * 2], every value written by the attention kernel before the reduction reads it."""
    part_acc = torch.empty(num_rows * num_q_heads * plan.num_parts * plan.head_pad_v, dtype=torch.float32,
                           device=device)
    part_ml = torch.empty(num_rows * num_q_heads * plan.num_parts * 2, dtype=torch.float32, device=device)
    return part_acc, part_ml


def unified_attention(*args, **kwargs) -> AttentionPlan:
    """Attention of ``query`` rows [:num_tokens] over the paged cache into ``out`` (one launch, or
    two on the split path); arguments as :func:`attention_launches`. Returns the plan it ran."""
    plan, launches = attention_launches(*args, **kwargs)
    run(launches)
    return plan


def _scale_args(fp8: int, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, num_kv_heads: int,
                placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The kernels' scale pointers and head strides: an fp8 cache's fp32 scales (checked here), each
    of shape ``[]`` (one per-tensor scale: stride 0) or ``[num_kv_heads]`` (head h's at ``h *
    stride``), passed as they are; ``placeholder`` (never read) and strides 0 for other caches."""
    if not fp8:
        return placeholder, placeholder, 0, 0
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (scale is None or scale.dtype != torch.float32 or tuple(scale.shape) not in ((), (num_kv_heads,))
                or scale.device != placeholder.device):
            raise ValueError(f"an fp8 cache needs {name} as an fp32 [] or [{num_kv_heads}] tensor on "
                             f"{placeholder.device}, got {None if scale is None else (scale.dtype, tuple(scale.shape))}")
    return k_scale, v_scale, scale_stride(k_scale), scale_stride(v_scale)


def scale_stride(scale: torch.Tensor) -> int:
    """The kernels' head stride of a scale tensor: 0 for one scale (``[]``, or ``[1]``), else its stride."""
    return scale.stride(0) if scale.dim() and scale.shape[0] > 1 else 0


def write_block_h(num_kv_heads: int, head_pad_: int, head_pad_v: int) -> int:
    return min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // max(head_pad_, head_pad_v)))


def write_kv_launches(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      cache_strides: tuple[int, int, int], block_size: int, num_kv_heads: int, head_size: int,
                      head_size_v: int, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> list[Launch]:
    """The write_kv launch: one program per token row that key, value and slot_mapping all have;
    the kernel skips slots outside [0, num_blocks * block_size). An fp8 cache needs ``k_scale`` /
    ``v_scale`` (fp32 ``[]`` or ``[num_kv_heads]``, :func:`_scale_args`); key and value may then be
    fp32, fp16 or bf16."""
    num_tokens = min(slot_mapping.shape[0], key.shape[0], value.shape[0])
    if num_tokens <= 0:
        return []
    hp, hpv = head_pad(head_size), head_pad(head_size_v)
    block_h = write_block_h(num_kv_heads, hp, hpv)
    fp8 = fp8_code(kv_cache.dtype)
    k_scale, v_scale, stride_ks, stride_vs = _scale_args(fp8, k_scale, v_scale, num_kv_heads, key)
    sb, st, sh = cache_strides
    return [Launch("write_kv", (num_tokens, triton.cdiv(num_kv_heads, block_h)), dict(
        key_ptr=key, value_ptr=value, kv_ptr=raw_cache(kv_cache), slot_ptr=slot_mapping, k_scale_ptr=k_scale,
        v_scale_ptr=v_scale, num_kv_heads=num_kv_heads,
        num_slots=kv_cache.shape[0] * block_size,
        stride_kt=key.stride(0), stride_kh=key.stride(1), stride_kd=key.stride(2),
        stride_vt=value.stride(0), stride_vh=value.stride(1), stride_vd=value.stride(2),
        stride_cb=sb, stride_ct=st, stride_ch=sh, stride_ks=stride_ks, stride_vs=stride_vs,
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, HEAD_SIZE_V=head_size_v, BLOCK_H=block_h, HEAD_PAD=hp, HEAD_PAD_V=hpv, FP8=fp8))]


def write_kv(*args, **kwargs) -> None:
    """Write key [T, Hkv, head_size] / value [T, Hkv, head_size_v] to ``slot_mapping``; -1 skips.
    Arguments as :func:`write_kv_launches`."""
    run(write_kv_launches(*args, **kwargs))


