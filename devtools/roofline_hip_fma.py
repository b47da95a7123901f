"""HIP FMA engine on NVIDIA (the non-MFMA path, wave 32) for the roofline model: its launch for a case,
with the shared-memory wavefronts of its access pattern and the K/V bytes its blocks re-read from L2.

What runs (``hip/kvmulti_attention.hip``, ``fma_stream``; nvcc through ``hip/compat`` for sm_90): blocks of
4 waves compute R = 8 rows (bf16 queries on wave 32: the 4 heads of a GQA group x 2 tokens); each wave
streams its contiguous share of the block's KT-key tiles (KT = 8 at head 128 in bf16: K of 8 keys fills
2 KiB). Per tile a wave loads K and V into its own ``__shared__`` buffer (16-byte loads, waits), then

* QK: lane ``l`` takes items ``l, l + 32, ...`` of the KT x R (key, row) products, key ``kk = item % KT``
  and row ``r = item / KT``, and reads ``krow[d]`` at ``ks + (kk * HS + d) * 2`` and ``q[r][d]`` at
  ``q + (r * HS + d) * 4`` for every dim ``d`` (unrolled by 4): the 8 keys a warp reads at once sit
  ``HS * 2`` = 256 bytes apart, in the same bank;
* the online softmax reads every score of the tile in every lane (one address: a broadcast) and PV reads
  ``vs + (kk * HS + lane + 32 i) * 2`` (consecutive lanes, consecutive elements).

Prefill runs this kernel too (wave 32 has no prefill kernel): one block per 2 tokens, so every block of
rows reads its keys' K/V again, from L2 after the first.

The access widths come from the SASS of the instantiation (:func:`compile_sass`, nvcc for sm_90); the
addresses from the formulas above; the wavefronts from :func:`devtools.roofline.shared_wavefronts`.
"""

from __future__ import annotations

import math
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from devtools import roofline_sass as S
from devtools.roofline import Case, KernelLaunch, LoopMix, Target, shared_wavefronts
from devtools.roofline_hip import PARTITION, SEARCH_ROUND_TRIPS, partitions

HIP_DIR = Path(__file__).resolve().parents[1] / "hip"
KERNEL = "paged_attention_kernel<bf16,bf16,128,wave32> (FMA engine)"
WAVES = 4                       # kNumWarps
WAVE = 32
ROWS = 8                        # rows_per_block<bf16, 32, bf16>()
ELEM = 2                        # bf16
QK_UNROLL = 4                   # the QK dim loop's #pragma unroll 4
TILE_BYTES_LIMIT = 2048         # fma_tile_keys: K rows of a tile fit 2 KiB
REGS_PER_SM, MAX_WARPS_PER_SM, SHARED_PER_SM = 65536, 64, 228 * 1024
_INSTANTIATION = ("#include \"kvmulti_attention.hip\"\n"
                  "template __global__ void kvmulti::paged_attention_kernel<hip_bfloat16, hip_bfloat16, 128, 32>"
                  "(const kvmulti::PagedAttentionParams);\n")


@dataclass(frozen=True)
class FmaSass:
    """What the launch needs from the sm_90 build: registers and shared bytes per block (ptxas -v),
    the QK dim loop's shared loads (widths, in order) and the tile loop's instruction classes per trip,
    with the dim loop and the PV key loop counted for every trip they make."""
    registers: int
    shared_bytes: int
    qk_loads: tuple[int, ...]
    tile_mix: dict[str, float]


def tile_keys(head: int = 128, elem: int = ELEM) -> int:
    """fma_tile_keys<T, HS>(): the largest power of two of keys whose K rows fit 2 KiB."""
    keys = 1
    while keys * 2 * head * elem <= TILE_BYTES_LIMIT:
        keys *= 2
    return keys


def compile_sass(arch: str = "sm_90") -> tuple[str, str]:
    """(cuobjdump -sass text, ptxas -v log) of the bf16 / head 128 / wave 32 attention kernel, built with
    the nvcc that devtools/hip_compile_check.py uses. Raises RuntimeError without nvcc or cuobjdump."""
    from devtools import hip_compile_check as cc
    nvcc = cc.nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    with tempfile.TemporaryDirectory(prefix="kvmulti_fma_") as tmp:
        src, cubin = Path(tmp) / "fma.cu", Path(tmp) / "fma.cubin"
        src.write_text(_INSTANTIATION)
        done = subprocess.run([nvcc, "-x", "cu", "-I", str(HIP_DIR / "compat"), "-I", str(HIP_DIR), "-O3",
                               "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", str(src), "-o", str(cubin)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{done.stderr[-3000:]}")
        return S.disassemble(cubin.read_bytes()), done.stderr + done.stdout


def read_sass(sass: str, log: str, head: int = 128) -> FmaSass:
    """The figures of :class:`FmaSass` from the SASS and ptxas log. The QK dim loop: the innermost loop
    with FFMAs and 2-byte shared loads; the tile loop: the innermost loop around it with 16-byte global
    loads; the PV key loop: the other innermost loop in the tile loop with MUFU and FFMA."""
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    smem = int(re.search(r"(\d+) bytes smem", log).group(1))
    code = S.parse(sass)
    spans = S.loops(code)

    def ops(span):
        return [i.opcode + i.modifiers for i in S.body(code, span)]
    qk = next(s for s in spans if "FFMA" in ops(s) and "LDS.U16" in ops(s))
    tile = next(s for s in spans if s[0] <= qk[0] and qk[1] <= s[1] and "LDG.E.128" in ops(s))
    pv = next(s for s in spans if s != qk and tile[0] <= s[0] and s[1] <= tile[1]
              and "MUFU.EX2" in ops(s) and "FFMA" in ops(s))
    keys = tile_keys(head)
    items = keys * ROWS // WAVE
    qk_trips = items * head // QK_UNROLL
    pv_trips = keys // _pv_unroll(code, pv)
    mix: dict[str, float] = {}
    for span, extra in ((tile, 1), (qk, qk_trips - 1), (pv, pv_trips - 1)):
        for ins in S.body(code, span):
            mix[S.class_of(ins.opcode)] = mix.get(S.class_of(ins.opcode), 0) + extra
    loads = tuple(S.access_width(i) for i in S.body(code, qk) if i.opcode == "LDS")
    return FmaSass(regs, smem, loads, mix)


def _pv_unroll(code: list[S.Instruction], span: tuple[int, int]) -> int:
    """Keys per trip of the PV loop: its exponentials / ROWS (each key's rows need one each)."""
    return max(1, sum(1 for i in S.body(code, span) if i.opcode == "MUFU") // ROWS)


def tile_wavefronts(sass: FmaSass, head: int = 128, banks: int = 32, bank_bytes: int = 4) -> dict[str, int]:
    """Shared-memory wavefronts one wave issues per tile, by access (see the module docstring)."""
    keys = tile_keys(head)
    lanes = range(WAVE)
    items = keys * ROWS // WAVE
    chunks = head * ELEM // 16
    loads_per_lane = math.ceil(keys * chunks / WAVE)
    q_base, k_base, v_base = 0, ROWS * head * 4, ROWS * head * 4 + keys * head * ELEM
    qk = 0
    for i in range(items):
        kk = [(lane + i * WAVE) % keys for lane in lanes]
        r = [(lane + i * WAVE) // keys for lane in lanes]
        for d0 in range(0, head, QK_UNROLL):
            k_off = 0
            for width in sass.qk_loads:
                if width == 16:                                        # q[r][d0 .. d0 + 3], fp32
                    addrs = [q_base + (r[x] * head + d0) * 4 for x in lanes]
                else:                                                  # krow[d], one dim per load
                    addrs = [k_base + (kk[x] * head + d0 + k_off) * ELEM for x in lanes]
                    k_off += width // ELEM
                qk += shared_wavefronts(addrs, width, banks, bank_bytes)
    pv = sum(shared_wavefronts([v_base + (kk * head + lane + i * WAVE) * ELEM for lane in lanes], ELEM, banks,
                               bank_bytes) for kk in range(keys) for i in range(math.ceil(head / WAVE)))
    stage = 2 * sum(shared_wavefronts([k_base + (j * WAVE + lane) * 16 if j * WAVE + lane < keys * chunks else None
                                       for lane in lanes], 16, banks, bank_bytes) for j in range(loads_per_lane))
    # every lane reads each score twice (max, then exp in PV): one address, a broadcast each
    scores = 2 * ROWS * keys * shared_wavefronts([0] * WAVE, 4, banks, bank_bytes)
    score_writes = items * shared_wavefronts([(lane % keys + (lane // keys) * keys) * 4 for lane in lanes], 4,
                                             banks, bank_bytes)
    return {"qk": qk, "pv": pv, "stage": stage, "scores": scores + score_writes}


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
    NVIDIA ``target``."""
    keys = tile_keys(case.head)
    parts = partitions(case, target.units)
    working, iterations, tiles, exiting = _blocks(case, parts, keys)
    wave_bytes = keys * 2 * case.head * ELEM
    waves = tile_wavefronts(sass, case.head, target.shared_banks, target.shared_bank_bytes)
    kv = case.kv_bytes(ELEM)
    loaded = working * tiles * wave_bytes
    workspace = case.tokens * case.q_heads * parts * (case.head + 2) * 4 if parts > 1 else 0
    table = case.sequences * math.ceil(case.context / case.block_size) * 4
    kind = "decode" if case.query_len == 1 else "prefill"
    return KernelLaunch(
        kernel=f"hip {KERNEL}", target=target.arch, case=kind, programs=working, waves_per_program=WAVES,
        iterations=iterations, loop=LoopMix(dict(sass.tile_mix), WAVES * wave_bytes),
        resident_per_unit=resident_blocks(sass), bytes_in_flight=WAVES * wave_bytes,
        dram_bytes=kv + 2 * case.q_bytes + workspace + table, useful_bytes=kv, useful_flops=case.useful_flops,
        second_launch_bytes=(workspace + case.q_bytes) if parts > 1 else 0.0,
        serial_share=1.0, dram_share=min(1.0, kv / loaded), exiting_programs=exiting,
        exit_s=SEARCH_ROUND_TRIPS * target.cache_latency_s,
        shared_wavefronts=sum(waves.values()) * tiles / iterations,
        l2_bytes=max(0.0, loaded - kv),
        notes=(f"sm_90 SASS (nvcc via hip/compat): {sass.registers} registers, {resident_blocks(sass)} blocks/SM; "
               f"{parts} partition(s); {working} blocks of {ROWS} rows x {tiles:.1f} tiles of {keys} keys; "
               f"{sum(waves.values())} shared wavefronts per wave and tile ({waves})"))
