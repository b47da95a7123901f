"""The HIP prefill kernel's FMA tile engine on NVIDIA (wave 32, through ``hip/compat``) for the roofline model:
its tile loop's instruction classes and shared-memory wavefronts from the sm_90 SASS, and its prefill launch.

``paged_prefill_kernel<bf16, bf16, 128, 32>`` (``hip/kvmulti_prefill_fma.hip``, ``FmaTileGeom``), as the device
check builds it: a work-group takes 64 rows (the 4 heads of a GQA group x 16 tokens) in 4 warps of 16 rows.
Per tile of 16 keys each warp loads 4 keys' K and V rows (two 16-byte loads of each per lane), stores them
widened to fp32 (STS.128: lane ``j`` at ``512 (j / 16) + 32 (j % 16) + 16 f``), and after the barrier
computes its rows from LDS: per key and 4-dim chunk one LDS.128 of K (QK) and one of V (PV), lane ``(g, x)``
reading chunk ``x + 8 c`` of the key's row (8 consecutive 16-byte words, the same for the 4 row groups). Any
other shared access in the tile loop is an error (no pattern known for it). The loop's static instruction
count holds both arms of the warp's skip test (the next tile's loads appear in each); the model counts it
whole, an over-count of the arm not taken.

``python devtools/roofline_hip_prefill_fma.py`` prints the tile loop's figures and the H200 estimates.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":                        # run as a script: the repository root holds devtools/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools import roofline_hip_fma as F
from devtools import roofline_sass as S
from devtools.roofline import Case, KernelLaunch, LoopMix, Target, shared_wavefronts
from devtools.roofline_hip import SEARCH_ROUND_TRIPS

KERNEL = "paged_prefill_kernel<bf16,bf16,128,wave32> (FMA tile engine)"
WAVES, WAVE, ELEM, HEAD = F.WAVES, F.WAVE, F.ELEM, F.HEAD
ROWS = 64                       # kPrefillRows
#: FmaTileGeom<bf16, 128, 32>: keys per tile, 16-byte K (and V) loads per lane, lanes per row group,
#: 4-dim chunks per lane
TILE_KEYS, LOADS_PER_LANE, GROUP_LANES, CHUNKS_PER_LANE = 16, 2, 8, 4
_INSTANTIATION = ("#include \"kvmulti_prefill.hip\"\n"
                  "template __global__ void kvmulti::paged_prefill_kernel<hip_bfloat16, hip_bfloat16, 128, 32>"
                  "(const kvmulti::PagedAttentionParams);\n")


@dataclass(frozen=True)
class TileSass:
    """What the launch needs of one sm_90 build: registers and shared bytes per block (ptxas -v), the tile
    loop's instruction classes per warp and tile, its shared-memory wavefronts per warp and tile by access,
    and the share of its work issued with no load in flight: its FFMAs before the computing arm's loads of the
    next tile (QK), the serial share of :class:`devtools.roofline.KernelLaunch`."""
    registers: int
    shared_bytes: int
    tile_mix: dict[str, float]
    tile_wavefronts: dict[str, int]
    serial_share: float
    ffma: int


def tile_loop(code: list[S.Instruction]) -> tuple[int, int]:
    """The plain tile loop (16-byte-aligned cache, no masks, no softcap / ALiBi): the smallest loop with
    16-byte global loads, 16-byte shared stores and loads, a barrier and FFMAs."""
    need = {"LDG.E.128", "STS.128", "LDS.128", "BAR", "FFMA"}
    spans = [s for s in S.loops(code)
             if need <= {i.opcode + (i.modifiers if i.opcode in ("LDG", "STS", "LDS") else "")
                         for i in S.body(code, s)}]
    if not spans:
        raise ValueError("no tile loop (16-byte loads, shared stores and reads, a barrier, FFMAs) in the SASS")
    return min(spans, key=lambda s: s[1] - s[0])


def _store_wavefronts() -> int:
    """Wavefronts of one STS.128 of the staging (module docstring)."""
    return shared_wavefronts([512 * (j // 16) + 32 * (j % 16) for j in range(WAVE)], 16)


def _read_wavefronts() -> int:
    """Wavefronts of one LDS.128 of K or V (module docstring)."""
    return shared_wavefronts([16 * (lane % GROUP_LANES) for lane in range(WAVE)], 16)


def read_sass(sass: str, log: str) -> TileSass:
    """The figures of :class:`TileSass` from the build's SASS and ptxas log, one trip = one tile (checked
    against the geometry's reads and stores). Raises ValueError for a shared access of another kind."""
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    smem = int(re.search(r"(\d+) bytes smem", log).group(1))
    code = S.parse(sass)
    body = S.body(code, tile_loop(code))
    shared = [i for i in body if i.opcode in ("LDS", "STS", "LDSM", "ATOMS", "STSM")]
    reads = sum(1 for i in shared if i.opcode == "LDS" and S.access_width(i) == 16)
    stores = sum(1 for i in shared if i.opcode == "STS" and S.access_width(i) == 16)
    other = [i.opcode + i.modifiers for i in shared if S.access_width(i) != 16 or i.opcode not in ("LDS", "STS")]
    if other:
        raise ValueError(f"shared accesses without a known pattern in the tile loop: {other}")
    want_reads, want_stores = 2 * TILE_KEYS * CHUNKS_PER_LANE, 2 * LOADS_PER_LANE * 2
    if reads != want_reads or stores != want_stores:
        raise ValueError(f"the tile loop has {reads} LDS.128 and {stores} STS.128, the geometry wants "
                         f"{want_reads} and {want_stores} per tile")
    ffma = [k for k, i in enumerate(body) if i.opcode == "FFMA"]
    # the computing arm's loads: the last 16-byte load group (the skipping arm's has no FFMA before it)
    last_load = max(k for k, i in enumerate(body) if i.opcode == "LDG" and ".128" in i.modifiers)
    group_start = last_load
    while group_start > 0 and not any(i.opcode == "FFMA" for i in body[group_start - 8:group_start]):
        group_start -= 1
    serial = sum(1 for k in ffma if k < group_start) / len(ffma)
    mix = Counter(S.class_of(i.opcode) for i in body)
    return TileSass(regs, smem, dict(mix), {"reads": reads * _read_wavefronts(), "stores": stores * _store_wavefronts()},
                    serial, len(ffma))


def current_sass(arch: str = "sm_90") -> TileSass:
    """:func:`read_sass` of the current source's build (nvcc through hip/compat)."""
    return read_sass(*F.compile_sass(arch, source=_INSTANTIATION))


def resident_blocks(sass: TileSass) -> int:
    """Blocks per SM: registers (allocated per warp in units of 8 per thread), shared memory, warps."""
    per_warp = math.ceil(sass.registers / 8) * 8 * WAVE
    return max(1, min(F.REGS_PER_SM // per_warp // WAVES, F.SHARED_PER_SM // max(1, sass.shared_bytes),
                      F.MAX_WARPS_PER_SM // WAVES))


def _blocks(case: Case) -> tuple[int, float, int]:
    """(working blocks, mean tiles of a block, exiting blocks) of the prefill grid: a block takes 64 / group
    tokens x the group's heads (chunks of 64 rows past group 64) and visits the tiles of its rows' key union."""
    group = case.q_heads // case.kv_heads
    heads = min(group, ROWS)
    tokens_per_block, chunks = ROWS // heads, math.ceil(group / heads)
    first = case.context - case.query_len
    tiles = [math.ceil((first + min(case.query_len, t0 + tokens_per_block)) / TILE_KEYS)
             for t0 in range(0, case.query_len, tokens_per_block)]
    working = len(tiles) * case.sequences * case.kv_heads * chunks
    return working, sum(tiles) / len(tiles), case.sequences * case.kv_heads * chunks


def launch(sass: TileSass, case: Case, target: Target) -> KernelLaunch:
    """The prefill kernel's launch of ``case`` on an NVIDIA ``target`` (its FMA tile engine), for ``sass``."""
    working, tiles, exiting = _blocks(case)
    tile_bytes = TILE_KEYS * 2 * HEAD * ELEM
    kv = case.kv_bytes(ELEM)
    loaded = working * tiles * tile_bytes
    table = case.sequences * math.ceil(case.context / case.block_size) * 4
    waves = sum(sass.tile_wavefronts.values())
    return KernelLaunch(
        kernel=f"hip {KERNEL}", target=target.arch, case="prefill", programs=working, waves_per_program=WAVES,
        iterations=tiles, loop=LoopMix(dict(sass.tile_mix), tile_bytes), resident_per_unit=resident_blocks(sass),
        bytes_in_flight=tile_bytes, dram_bytes=kv + 2 * case.q_bytes + table, useful_bytes=kv,
        useful_flops=case.useful_flops, serial_share=sass.serial_share, dram_share=min(1.0, kv / loaded),
        exiting_programs=exiting, exit_s=SEARCH_ROUND_TRIPS * target.cache_latency_s,
        shared_wavefronts=WAVES * waves, l2_bytes=max(0.0, loaded - kv),
        notes=(f"sm_90 SASS (nvcc via hip/compat): {sass.registers} registers, {resident_blocks(sass)} blocks/SM; "
               f"{working} blocks of {ROWS} rows x {tiles:.1f} tiles of {TILE_KEYS} keys; per warp and tile "
               f"{sum(sass.tile_mix.values())} instructions ({sass.ffma} FFMA), {waves} shared wavefronts "
               f"({sass.tile_wavefronts}), {sass.serial_share:.2f} of them before the next tile's loads"))


def format_current(sass: TileSass) -> str:
    """A markdown table of the build's tile-loop figures."""
    total = sum(sass.tile_mix.values())
    return ("| registers | blocks / SM | instructions / warp and tile | FFMA | shared wavefronts / warp and tile | "
            "issued before the next loads |\n|---|---|---|---|---|---|\n"
            f"| {sass.registers} | {resident_blocks(sass)} | {total:.0f} | {sass.ffma} ({sass.ffma / total:.0%}) | "
            f"{sum(sass.tile_wavefronts.values())} ({sass.tile_wavefronts}) | {sass.serial_share:.2f} |")


if __name__ == "__main__":
    from devtools.roofline import H200, estimate
    from devtools.roofline_calibration import SHAPES
    current = current_sass()
    print(format_current(current))
    for shape, case in SHAPES.items():
        if case.query_len > 1:
            e = estimate(launch(current, case, H200), H200)
            print(f"{shape}: {e.time_s * 1e3:.2f} ms ({case.useful_flops / e.time_s / 1e12:.1f} TFLOP/s), {e.bound}")
