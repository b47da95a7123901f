"""HIP FMA engine on NVIDIA (the non-MFMA path, wave 32) for the roofline model, and the count of its tile
loop's shared-memory wavefronts from the sm_90 SASS.

Two builds are modelled, both bf16 / head 128 / wave 32 (R = 8 rows per block: the 4 heads of a GQA group x
2 tokens), each block 4 waves streaming their contiguous shares of the block's tiles:

* **the current source** (:func:`current_sass`; nvcc for sm_90 through ``hip/compat``, as the device check
  builds it): lane groups over keys (``hip/kvmulti_attention.hip``, ``FmaGeom``). K and V go from global
  memory into registers; the tile loop's only shared-memory accesses are the query reads: lane ``l`` reads
  16 bytes at ``16 (l mod G)`` of a row (the lanes of a group consecutive 16 bytes, the groups the same
  ones), counted per trip from the SASS and turned into wavefronts by :func:`devtools.roofline.shared_wavefronts`.
  Any other shared access in the tile loop is an error (no pattern known for it);
* **the engine the H200 measured** (:data:`MEASURED_KERNEL`, ``docs/data/hip_fma_measured_kernel.json``):
  8-key K/V tiles staged in each wave's shared memory, the QK reads 8-way bank conflicted. Its sm_90 figures
  were read from that build and are kept as data (the source changed since); the calibration reproduces
  the measured rows from them.

The measured build ran prefill through the attention kernel too (one block per 2 tokens, so every block of rows
read its keys' K/V again, from L2 after the first); the current source runs it on the prefill kernel's FMA tile
engine (``devtools/roofline_hip_prefill_fma.py``).

``python devtools/roofline_hip_fma.py`` prints the current build's tile-loop figures.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":                        # run as a script: the repository root holds devtools/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devtools import roofline_sass as S
from devtools.roofline import Case, KernelLaunch, LoopMix, Target, shared_wavefronts
from devtools.roofline_hip import PARTITION, SEARCH_ROUND_TRIPS, partitions

ROOT = Path(__file__).resolve().parents[1]
HIP_DIR = ROOT / "hip"
MEASURED_KERNEL_JSON = ROOT / "docs" / "data" / "hip_fma_measured_kernel.json"
KERNEL = "paged_attention_kernel<bf16,bf16,128,wave32> (FMA engine)"
WAVES = 4                       # kNumWarps
WAVE = 32
ROWS = 8                        # rows_per_block<bf16, 32, bf16>()
ELEM = 2                        # bf16
HEAD = 128
PIECE = 8                       # FmaGeom::PIECE: head dims per lane and piece
#: the shared-memory wavefronts per 4 KiB of K/V a tile loop may issue (the engine's design budget)
MAX_WAVEFRONTS_PER_4KIB = 400
REGS_PER_SM, MAX_WARPS_PER_SM, SHARED_PER_SM = 65536, 64, 228 * 1024
_INSTANTIATION = ("#include \"kvmulti_attention.hip\"\n"
                  "template __global__ void kvmulti::paged_attention_kernel<hip_bfloat16, hip_bfloat16, 128, 32>"
                  "(const kvmulti::PagedAttentionParams);\n")


@dataclass(frozen=True)
class Geometry:
    """FmaGeom<C, HS, WAVE, R> (hip/kvmulti_attention.hip): lanes per key, pieces per lane, keys per pass,
    passes and keys per tile, K + V bytes per wave and tile."""
    lanes_per_key: int
    pieces_per_lane: int
    keys_per_pass: int
    passes: int
    tile_keys: int
    tile_bytes: int


def geometry(head: int = HEAD, elem: int = ELEM, wave: int = WAVE) -> Geometry:
    """The FMA engine's tile geometry for a cache of ``elem``-byte elements (its C++ twin: FmaGeom)."""
    pieces = head // PIECE
    g = min(1 << max(0, (pieces - 1).bit_length()), wave)
    kp = wave // g
    cpl = math.ceil(pieces / g)
    loads = cpl * max(1, PIECE * elem // 16)
    np_ = 1 if loads >= 2 else 2
    return Geometry(g, cpl, kp, np_, kp * np_, kp * np_ * 2 * head * elem)


@dataclass(frozen=True)
class FmaSass:
    """What the launch needs of one sm_90 build: registers and shared bytes per block (ptxas -v), keys and
    K/V bytes per wave and tile, the tile loop's instruction classes per tile and its shared-memory
    wavefronts per wave and tile by access."""
    registers: int
    shared_bytes: int
    tile_keys: int
    tile_bytes: int
    tile_mix: dict[str, float]
    tile_wavefronts: dict[str, int]
    shuffles: int = 0
    source: str = field(default="current", compare=False)

    @property
    def wavefronts_per_4kib(self) -> float:
        """Shared-memory wavefronts per 4 KiB of K/V a wave streams."""
        return sum(self.tile_wavefronts.values()) * 4096 / self.tile_bytes


def measured_kernel(path: Path = MEASURED_KERNEL_JSON) -> FmaSass:
    """The build the H200 ran (see the module docstring), from its recorded figures."""
    d = json.loads(Path(path).read_text())
    return FmaSass(d["registers"], d["shared_bytes"], d["tile_keys"], d["tile_bytes"], dict(d["tile_mix"]),
                   dict(d["tile_wavefronts"]), source="measured")


MEASURED_KERNEL = measured_kernel()


def compile_sass(arch: str = "sm_90", hip_dir: Path = HIP_DIR, source: str = _INSTANTIATION) -> tuple[str, str]:
    """(cuobjdump -sass text, ptxas -v log) of the instantiation ``source`` (default: the bf16 / head 128 /
    wave 32 attention kernel), built with the nvcc that devtools/hip_compile_check.py uses. Raises
    RuntimeError without nvcc or cuobjdump."""
    from devtools import hip_compile_check as cc
    nvcc = cc.nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    with tempfile.TemporaryDirectory(prefix="kvmulti_fma_") as tmp:
        src, cubin = Path(tmp) / "fma.cu", Path(tmp) / "fma.cubin"
        src.write_text(source)
        done = subprocess.run([nvcc, "-x", "cu", "-I", str(hip_dir / "compat"), "-I", str(hip_dir), "-O3",
                               "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", str(src), "-o", str(cubin)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{done.stderr[-3000:]}")
        return S.disassemble(cubin.read_bytes()), done.stderr + done.stdout


#: shared-memory opcodes (any other access in the tile loop has no known pattern)
_SHARED = ("LDS", "STS", "LDSM", "ATOMS", "STSM")


def tile_loop(code: list[S.Instruction]) -> tuple[int, int]:
    """The tile loop of the 16-byte-aligned variant: the innermost loop with 16-byte global loads,
    shuffles and FFMAs."""
    spans = [s for s in S.loops(code)
             if {"LDG.E.128", "SHFL", "FFMA"} <= {i.opcode + (i.modifiers if i.opcode == "LDG" else "")
                                                   for i in S.body(code, s)}]
    if not spans:
        raise ValueError("no tile loop (16-byte loads, shuffles and FFMAs) in the SASS")
    return min(spans, key=lambda s: s[1] - s[0])


def read_sass(sass: str, log: str, head: int = HEAD) -> FmaSass:
    """The figures of :class:`FmaSass` from the current build's SASS and ptxas log: the tile loop's
    instruction classes and its query reads' wavefronts (module docstring), one trip = one tile (checked
    against the geometry's 16-byte loads). Raises ValueError for a shared access of another kind."""
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    smem = int(re.search(r"(\d+) bytes smem", log).group(1))
    code = S.parse(sass)
    body = S.body(code, tile_loop(code))
    geo = geometry(head)
    loads = sum(1 for i in body if i.opcode == "LDG" and ".128" in i.modifiers)
    want = geo.passes * 2 * geo.pieces_per_lane * max(1, PIECE * ELEM // 16)
    if loads != want:
        raise ValueError(f"the tile loop has {loads} 16-byte loads, the geometry wants {want} per tile")
    shared = [i for i in body if i.opcode in _SHARED]
    other = [i.opcode + i.modifiers for i in shared if not (i.opcode == "LDS" and S.access_width(i) == 16)]
    if other:
        raise ValueError(f"shared accesses without a known pattern in the tile loop: {other}")
    per_read = shared_wavefronts([16 * (lane % geo.lanes_per_key) for lane in range(WAVE)], 16)
    mix = Counter(S.class_of(i.opcode) for i in body)
    return FmaSass(regs, smem, geo.tile_keys, geo.tile_bytes, dict(mix), {"query": len(shared) * per_read},
                   shuffles=sum(1 for i in body if i.opcode == "SHFL"))


def current_sass(arch: str = "sm_90") -> FmaSass:
    """:func:`read_sass` of the current source's build."""
    return read_sass(*compile_sass(arch))


def resident_blocks(sass: FmaSass) -> int:
    """Blocks per SM: registers (allocated per warp in units of 8 per thread), shared memory, warps."""
    per_warp = math.ceil(sass.registers / 8) * 8 * WAVE
    return max(1, min(REGS_PER_SM // per_warp // WAVES, SHARED_PER_SM // max(1, sass.shared_bytes),
                      MAX_WARPS_PER_SM // WAVES))


def _blocks(case: Case, parts: int, keys: int) -> tuple[int, float, float, int]:
    """(working blocks, mean tiles of a block's busiest wave, mean tiles of a block, exiting blocks)."""
    group = case.q_heads // case.kv_heads
    heads = min(group, ROWS)
    tokens_per_block, chunks = ROWS // heads, math.ceil(group / heads)
    first = case.context - case.query_len
    busiest, tiles = [], []
    for t0 in range(0, case.query_len, tokens_per_block):
        hi = first + min(case.query_len, t0 + tokens_per_block)
        for part in range(parts):
            lo, top = (part * PARTITION, min(hi, (part + 1) * PARTITION)) if parts > 1 else (0, hi)
            if top > lo:
                n = math.ceil((top - lo // keys * keys) / keys)
                busiest.append(math.ceil(n / WAVES))
                tiles.append(n)
    working = len(busiest) * case.sequences * case.kv_heads * chunks
    grid = case.tokens * case.kv_heads * chunks * parts
    return working, sum(busiest) / len(busiest), sum(tiles) / len(tiles), grid - working


def launch(sass: FmaSass, case: Case, target: Target) -> KernelLaunch:
    """The FMA engine's attention launch of ``case`` (decode, or prefill through the same kernel) on an
    NVIDIA ``target``, for the build ``sass`` describes."""
    keys, wave_bytes = sass.tile_keys, sass.tile_bytes
    parts = partitions(case, target.units)
    working, iterations, tiles, exiting = _blocks(case, parts, keys)
    waves = sum(sass.tile_wavefronts.values())
    kv = case.kv_bytes(ELEM)
    loaded = working * tiles * wave_bytes
    workspace = case.tokens * case.q_heads * parts * (case.head + 2) * 4 if parts > 1 else 0
    table = case.sequences * math.ceil(case.context / case.block_size) * 4
    kind = "decode" if case.query_len == 1 else "prefill"
    return KernelLaunch(
        kernel=f"hip {KERNEL} ({sass.source} build)", target=target.arch, case=kind, programs=working,
        waves_per_program=WAVES, iterations=iterations, loop=LoopMix(dict(sass.tile_mix), WAVES * wave_bytes),
        resident_per_unit=resident_blocks(sass), bytes_in_flight=WAVES * wave_bytes,
        dram_bytes=kv + 2 * case.q_bytes + workspace + table, useful_bytes=kv, useful_flops=case.useful_flops,
        second_launch_bytes=(workspace + case.q_bytes) if parts > 1 else 0.0,
        serial_share=1.0, dram_share=min(1.0, kv / loaded), exiting_programs=exiting,
        exit_s=SEARCH_ROUND_TRIPS * target.cache_latency_s,
        shared_wavefronts=waves * tiles / iterations,
        l2_bytes=max(0.0, loaded - kv),
        notes=(f"sm_90 SASS (nvcc via hip/compat, {sass.source} build): {sass.registers} registers, "
               f"{resident_blocks(sass)} blocks/SM; {parts} partition(s); {working} blocks of {ROWS} rows x "
               f"{tiles:.1f} tiles of {keys} keys; {waves} shared wavefronts per wave and tile "
               f"({sass.tile_wavefronts}; {sass.wavefronts_per_4kib:.0f} per 4 KiB)"))


def format_current(sass: FmaSass) -> str:
    """A markdown table of the build's tile-loop figures next to the measured build's."""
    lines = ["| build | registers | keys / tile | K+V bytes / tile | shared wavefronts / tile | per 4 KiB | shuffles / tile |",
             "|---|---|---|---|---|---|---|"]
    for s in (sass, MEASURED_KERNEL):
        lines.append(f"| {s.source} | {s.registers} | {s.tile_keys} | {s.tile_bytes} | "
                     f"{sum(s.tile_wavefronts.values())} | {s.wavefronts_per_4kib:.0f} | "
                     f"{s.shuffles if s.source == 'current' else 'n/a'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_current(current_sass()))
