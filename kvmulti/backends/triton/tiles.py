"""Tile choices of the Triton kernels per target family: the base tiles (:func:`tile_sizes`), the
prefill tiles for the matrix units (:func:`prefill_tiles`), block-table reads per tile
(:func:`table_reads`), pipeline depth (:func:`pipeline_stages`) and warps (:func:`base_warps`).
Each is chosen from the cross-compiled output of ``benchmarks/gpu_report.py``; launch.py explains
the choices.

Triton versions (:data:`GATED_TRITON`, :func:`triton_version`): every choice is compiled with the
Triton that torch 2.13's CUDA wheels pin (3.7) and with the newest (3.9). The choices are the
newest's; one that spills registers with an older Triton has an alternative for it (``version <
LEAN_FROM``), so neither ships a tile that spills on it."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from ...fp8 import FP8_DTYPES

#: Block-table reads per key tile at most, for the per-block (scalar) table path.
MAX_TABLE_READS = 8


FAMILIES = ("nvidia", "amd", "other")

#: (major, minor) of the Triton releases the compile gate compiles every tile choice with: the one
#: torch 2.13's CUDA wheels pin (``triton==3.7.1``) and the newest (3.9.0).
GATED_TRITON = ((3, 7), (3, 9))
#: The first Triton whose register allocation fits the newest choices everywhere; before it the few
#: that spill take the alternatives marked "before 3.9" below.
LEAN_FROM = (3, 9)


@functools.lru_cache(maxsize=None)
def triton_version() -> tuple[int, int]:
    """(major, minor) of the Triton that compiles the kernels in this process (``triton.__version__``)."""
    import triton
    return parse_triton_version(triton.__version__)


def parse_triton_version(text: str) -> tuple[int, int]:
    """(major, minor) of a Triton version string ("3.7.1", "3.9.0+git1234"); ValueError when it is
    not one."""
    m = re.match(r"(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"cannot read a Triton version from {text!r}")
    return int(m.group(1)), int(m.group(2))


def tile_sizes(decode: bool, num_qpk: int, head_pad_: int, head_pad_v: int, dtype: torch.dtype,
               family: str = "other", query_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(BLOCK_M, TILE_N). Decode rows are one token x G heads; prefill tiles hold several tokens.
    ``dtype``: the cache's; ``query_dtype``: the query's (None: the cache's), which the dots of an
    fp8 cache run in. ``family``: "nvidia", "amd" or "other" (see the module docstring)."""
    widest = max(head_pad_, head_pad_v)
    fp8 = dtype in FP8_DTYPES
    fp32 = dtype == torch.float32 or fp8 and query_dtype == torch.float32
    base_m = 16 if decode else (64 if widest <= 128 else 32)
    if fp32:
        tile_n = 32 if widest <= 128 else 16      # fp32 K/V tiles of 256-wide heads must fit 64 KiB LDS
    else:
        tile_n = 64 if widest <= 128 else 32
    if family == "amd":
        # decode: >= 2 work-groups per CU (64 KiB LDS); prefill and fp8 decode (its tiles decoded in
        # registers): fewer live registers, no SGPR spills (gpu_report)
        tile_n = min(tile_n, 16 if not decode or fp8 or widest > 128 else 32)
    elif family == "nvidia":
        # tiles whose accumulator, scores and decoded K/V fit the registers (gpu_report: no spills)
        if fp32:
            base_m = base_m if decode else (32 if widest <= 128 else 16)
            # fp32 prefill tiles of 64-wide heads at 32 keys spill 32 B on sm_90
            tile_n = 16 if widest > 64 or not decode and (fp8 or widest == 64) else 32
        elif fp8 or not decode and widest > 64:
            tile_n = 32
    block_m = max(base_m, 1 << max(num_qpk - 1, 0).bit_length())   # next power of two >= num_qpk
    return block_m, tile_n


#: A step whose longest query has at least this many new tokens is planned as prefill where
#: :func:`prefill_tiles` has tiles for it: the matrix-unit tiles and the kernel's prefill loop.
PREFILL_MIN_QUERY_LEN = 64


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int


def prefill_tiles(family: str, widest: int, dots_16bit: bool, *, exact_head: bool = True, window: bool = False,
                  softcap: bool = False, fp8: bool = False, arch: int | None = None,
                  version: tuple[int, int] | None = None) -> PrefillTiles | None:
    """The prefill tiles of one target family for heads padded to ``widest`` whose dots run on 16-bit
    operands (fp16 / bf16 queries; fp32 dots have no matrix instruction and keep :func:`tile_sizes`);
    None: :func:`tile_sizes`' tiles. ``exact_head``: K and V head sizes equal their pads (no masked
    head lanes); ``window`` / ``softcap``: the layer has a sliding window / a logit softcap; ``fp8``:
    an fp8 cache (its tiles decoded in registers); ``arch``: the NVIDIA compute capability as
    major x 10 + minor (90: Hopper), None where unknown; ``version``: the Triton release
    (:func:`triton_version`, the running one when None). The one place prefill tiles are chosen, each
    from the cross-compiled evidence (devtools/triton_cross_compile.py: no spills on any target of the
    family; the spills quoted are of the larger tiles rejected) and, on Hopper, from timings on an
    H200 (benchmarks/triton_gpu_sweep.py)."""
    if not dots_16bit or family not in ("nvidia", "amd"):
        return None
    if family == "nvidia":
        # 128 rows: two m64 wgmma warpgroups on sm_90, 8 warps; 3 stages keep the next K/V tile's
        # cp.async loads in flight during the dots. sm_80 spills at 128 x 64 with a softcap (40 B), a
        # window (32 B), an fp8 cache (3,208 B), masked head lanes (32 B) or head 32 (8 B), and at
        # 128 x 32 with window + softcap at head 64 (8 B): those take 128 x 32, or 64 x 32 over 4 warps
        # under a window or softcap (head 80: 8 B there, none at 128 x 32); head 256: 64 x 32 (64-key tiles need 172 KB of shared memory on sm_80)
        if widest > 128:
            return PrefillTiles(64, 32, 8, 3)
        if window or softcap:
            return (PrefillTiles(128, 32, 8, 3) if widest == 128 and not exact_head else
                    PrefillTiles(64, 32, 4, 3))
        if fp8 or not exact_head or widest == 32:
            return PrefillTiles(128, 32, 8, 3)
        if arch is not None and arch // 10 == 9:
            # Hopper: 64 x 64 over one warpgroup, two CTAs per SM (217 registers, no spills), timed
            # 1.03-1.07x faster than 128 x 64 over 8 warps at one CTA per SM, whose two warpgroups
            # meet at a barrier every key tile (sm_80 spills 56 B at 64 x 64 over 4 warps)
            return PrefillTiles(64, 64, 4, 3)
        return PrefillTiles(128, 64, 8, 3)
    # AMD: 128 rows x 32 keys over 4 wave64s, the next tile prefetched (2 stages), 2 work-groups per CU
    # (64-key tiles spill SGPRs). At 128 x 32 a window spills 10-29 registers, an fp8 cache 16-45
    # (e4m3 at 128 x 16 still 2 on gfx90a, none unpipelined), masked head lanes 1 (gfx90a): 128 x 16,
    # 128 x 16 at 1 stage, 64 x 32. Head 256: 64 rows over 8 wave64s (4: 300+ VGPRs), 16 keys under
    # a window or an fp8 cache (32: 21 spilled).
    if widest > 128:
        return PrefillTiles(64, 16 if window or fp8 else 32, 8, 2)
    if fp8:
        return PrefillTiles(128, 16, 4, 1)
    if window:
        return PrefillTiles(128, 16, 4, 2)
    if not exact_head:
        return PrefillTiles(64, 32, 4, 2)
    if softcap and _before_lean(version):
        # before 3.9: a softcap at 128 x 32 spills 15 VGPRs on gfx90a (Triton 3.7.1); 128 x 16 none
        return PrefillTiles(128, 16, 4, 2)
    return PrefillTiles(128, 32, 4, 2)


def table_reads(block_size: int, tile_n: int) -> int:
    """Block-table reads per key tile as scalars: 1 when a tile lies inside one block (tiles start at
    multiples of ``tile_n``), ``tile_n // block_size`` when it covers at most MAX_TABLE_READS whole
    blocks, else 0 (one read per key position)."""
    if block_size % tile_n == 0:
        return 1
    if tile_n % block_size == 0 and tile_n // block_size <= MAX_TABLE_READS:
        return tile_n // block_size
    return 0


def pipeline_stages(decode: bool, family: str, dtype: torch.dtype, table_reads: int, widest: int,
                    version: tuple[int, int] | None = None) -> int:
    """Triton num_stages. NVIDIA: a tile's block-table read per key position takes a pipeline stage
    of its own before the K/V loads it addresses; with fewer than 5 stages the pipeliner then waits
    for every ``cp.async`` group at the top of each iteration. So decode over fp16 / bf16 caches runs
    5 stages when the table is read per key (``table_reads == 0``); read as scalars, 3 stages keep
    the next K/V tile in flight during the dots (4 for heads padded to 64, whose split tiles spill
    8 B at 3 on sm_90, and before Triton 3.9 for heads padded to 32, whose decode tiles spill 8 B at
    3 on sm_90 with Triton 3.7.1); everything else 3 (at 5 stages fp32 decode tiles spill, and so
    does fp8 decode on sm_80), except before Triton 3.9 fp32 decode of heads padded to 16 with the
    table read per block: 4 (its split tiles spill 8 B at 3 on sm_80 with Triton 3.7.1). AMD: 2 for decode (the next tile prefetched into registers) and 1 for prefill
    (the prefetch's live registers made gfx942 spill SGPRs; two work-groups per CU hide the latency
    instead)."""
    if family == "nvidia":
        if decode and dtype in (torch.float16, torch.bfloat16):
            if not table_reads:
                return 5
            return 4 if widest == 64 or widest == 32 and _before_lean(version) else 3
        if decode and dtype == torch.float32 and table_reads and widest == 16 and _before_lean(version):
            return 4
        return 3
    if family == "amd":
        return 2 if decode else 1
    return 2


def base_warps(family: str, fp32_dots: bool, widest: int, version: tuple[int, int] | None = None) -> int:
    """num_warps of the base tiles (:func:`tile_sizes`; the prefill tiles carry their own): 4.
    Before Triton 3.9, NVIDIA's fp32 tiles (``fp32_dots``: fp32 queries) of heads padded to 256
    take 8: at 4 warps they spill 8 B on sm_90 with Triton 3.7.1, at 8 none, at the same CTAs per
    SM and with the next K/V tile still in flight during the dots."""
    if family == "nvidia" and fp32_dots and widest > 128 and _before_lean(version):
        return 8
    return 4


def _before_lean(version: tuple[int, int] | None) -> bool:
    """``version`` (the running Triton when None) is older than :data:`LEAN_FROM`."""
    return (triton_version() if version is None else version) < LEAN_FROM
