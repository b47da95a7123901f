"""HIP adapter of the roofline model: ``hip_compile_check.report_rows()`` rows -> :class:`KernelLaunch`.

Which launch the HIP backend makes for a case (``hip/launcher.hip``, ``hip/kvmulti_attention.hip``):
the attention grid is (query tokens, KV heads x head chunks, partitions) of 4-wave blocks; a block
computes R = 16 rows (4 query heads of one KV head x 4 consecutive tokens of one request) on the MFMA
engine, blocks whose token does not start a 4-token tile run the request search and exit; each wave
streams its contiguous share of the block's 32-key tiles (16 at head 256), one tile per hot-loop
iteration. Split-KV (partitions of 512 keys, a reduce launch) when the longest span exceeds 1024
keys and the un-split grid has fewer than 4 working blocks per CU (the plan counts 8 rows a block).

The prefill case runs ``paged_prefill_kernel`` (``hip/kvmulti_prefill.hip``; the launcher takes it when
the step's longest query reaches 64 tokens): a 4-wave work-group computes 64 rows (the GQA group's heads x
64 / group tokens), its grid enumerates token tiles request by request (one empty work-group per
request), and one hot-loop iteration is one key tile (64 keys; 32 at head 256) that the group loads once
into LDS and each of the 4 waves multiplies with its 16 rows.

Here only kernels on the MFMA engine are modelled (an fp16 / bf16 query, wave64, gfx90a / gfx942): the
FMA engine's hot loop, as the AMD analysis picks it, is its staging loop alone, not a whole tile. The FMA
engine on NVIDIA (nvcc's sm_90 build, wave 32) is ``devtools/roofline_hip_fma.py``. MI300X's rows
come from clang-19's gfx942 assembly.
"""

from __future__ import annotations

import math

from devtools.roofline import DECODE, PREFILL, Case, KernelLaunch, LoopMix, TARGETS

#: compile target of the rows -> roofline target
ARCH_TO_TARGET = {"gfx942": "gfx942", "gfx90a": "gfx90a"}
WAVES_PER_BLOCK = 4
ROWS_PER_BLOCK = 16
PLAN_ROWS_PER_BLOCK = 8
PARTITION = 512
MFMA_FLOPS = 2 * 16 * 16 * 16            # one v_mfma_f32_16x16x16 (rows without hot_loop_mfma_flops)
CLASSES = ("valu", "salu", "lds", "vmem", "mfma")
#: dependent loads of a block's request search before it knows it exits: a binary search over 8
#: requests (3) and the request's bounds (1), cache hits (the metadata is hot) -- an assumption
SEARCH_ROUND_TRIPS = 4


def _keys_per_iteration(head: int) -> int:
    return 16 if head >= 256 else 32


def _elem_bytes(row: dict) -> int:
    return 1 if row.get("cache") else 4 if row.get("dtype") == "fp32" else 2


def modelled(row: dict, case: Case) -> bool:
    """A bf16-query row at the case's head size on the MFMA engine of a modelled target: the decode case
    on the attention kernel, the prefill case on the prefill kernel over a 16-bit cache (the case's)."""
    kind = "attention" if case.name == "decode" else "prefill"
    return (row.get("kind") == kind and row.get("dtype") == "bf16" and row.get("head_size") == case.head
            and row.get("target") in ARCH_TO_TARGET and bool(row.get("matrix_instructions"))
            and row.get("hot_loop_instructions") and (case.name == "decode" or not row.get("cache")))


PREFILL_ROWS = 64          # rows of a prefill work-group (kPrefillRows)
PREFILL_LDS_TILE = 32768   # bytes of a K + V tile in LDS (PrefillGeom::KT)


def prefill_tile_keys(head: int, elem: int) -> int:
    """Keys per prefill tile: 64 when K + V of 64 keys fit 32 KiB of LDS (rows padded by 16 bytes when
    their 16-byte chunk count is not a power of two), else 32, else 16."""
    chunks = head * elem // 16
    row = 16 * chunks + (0 if chunks & (chunks - 1) == 0 else 16)
    return next(keys for keys in (64, 32, 16) if 2 * keys * row <= PREFILL_LDS_TILE or keys == 16)


def prefill_launch(row: dict, case: Case) -> KernelLaunch:
    """The prefill kernel's launch of ``case`` on ``row``'s target (no split: prefill grids are large)."""
    target = TARGETS[ARCH_TO_TARGET[row["target"]]]
    elem = _elem_bytes(row)
    keys = prefill_tile_keys(case.head, elem)
    group = case.q_heads // case.kv_heads
    heads = min(group, PREFILL_ROWS)
    tokens_per_tile = PREFILL_ROWS // heads
    chunks = math.ceil(group / heads)
    first = case.context - case.query_len
    tiles = [math.ceil((first + t0 + min(tokens_per_tile, case.query_len - t0)) / keys)
             for _ in range(case.sequences) for t0 in range(0, case.query_len, tokens_per_tile)]
    working = len(tiles) * case.kv_heads * chunks
    iterations = sum(tiles) / len(tiles)
    grid = (math.ceil(case.tokens / tokens_per_tile) + case.sequences) * case.kv_heads * chunks
    mix = {c: n for c, n in row["hot_loop_instructions"].items() if c in CLASSES and n}
    iteration_bytes = keys * 2 * case.head * elem            # the group's tile, loaded once for 4 waves
    flops = WAVES_PER_BLOCK * (row.get("hot_loop_mfma_flops") or mix.get("mfma", 0) * MFMA_FLOPS)
    table = case.sequences * math.ceil(case.context / case.block_size) * 4
    kv = case.kv_bytes(elem)
    loaded = working * iterations * iteration_bytes
    return KernelLaunch(
        kernel=f"hip {row['kernel']}", target=target.arch, case=case.name, programs=working,
        waves_per_program=WAVES_PER_BLOCK, iterations=iterations,
        loop=LoopMix(mix, iteration_bytes, {"mfma": flops} if flops else {}),
        resident_per_unit=max(1, row["waves_per_simd"] * target.ports_per_unit // WAVES_PER_BLOCK),
        bytes_in_flight=(row["bytes_in_flight_per_lane"] or 0) * row["wave"] * WAVES_PER_BLOCK,
        dram_bytes=kv + case.q_bytes * 2 + table, useful_bytes=kv, useful_flops=case.useful_flops,
        serial_share=row.get("hot_loop_serial_share") or 0.0, dram_share=min(1.0, kv / loaded),
        exiting_programs=grid - working, exit_s=SEARCH_ROUND_TRIPS * target.cache_latency_s,
        notes=(f"{row['target']} assembly; prefill kernel: {working} working groups of {PREFILL_ROWS} rows x "
               f"{iterations:.2f} tiles of {keys} keys (K/V in LDS once per group); {grid - working} groups "
               f"find no tokens"))


def partitions(case: Case, units: int) -> int:
    """kvmulti_hip_plan's split for the case on a device of ``units`` CUs (1: no split)."""
    group = case.q_heads // case.kv_heads
    heads = min(group, PLAN_ROWS_PER_BLOCK)
    tokens_per_block = PLAN_ROWS_PER_BLOCK // heads
    blocks = math.ceil(case.tokens / tokens_per_block) * case.kv_heads * math.ceil(group / heads)
    if case.context > 2 * PARTITION and blocks < 4 * units:
        return math.ceil(case.context / PARTITION)
    return 1


def _wave_iterations(case: Case, parts: int, keys_per_iteration: int) -> tuple[int, float, int]:
    """(working blocks, mean iterations of a block's busiest wave, blocks that exit) of the grid."""
    group = case.q_heads // case.kv_heads
    heads = min(group, ROWS_PER_BLOCK)
    tokens_per_block = ROWS_PER_BLOCK // heads
    chunks = math.ceil(group / heads)
    tiles_per_block = []
    first = case.context - case.query_len
    for _ in range(case.sequences):
        for t0 in range(0, case.query_len, tokens_per_block):
            ntok = min(tokens_per_block, case.query_len - t0)
            hi = first + t0 + ntok                  # the block's last token sees keys [0, hi)
            for part in range(parts):
                lo_p, hi_p = part * PARTITION, min(hi, (part + 1) * PARTITION) if parts > 1 else hi
                if hi_p <= lo_p:
                    continue
                base = lo_p // keys_per_iteration * keys_per_iteration
                n = math.ceil((hi_p - base) / keys_per_iteration)
                tiles_per_block.append(math.ceil(n / WAVES_PER_BLOCK))
    working = len(tiles_per_block) * case.kv_heads * chunks
    grid = case.tokens * case.kv_heads * chunks * parts
    mean = sum(tiles_per_block) / len(tiles_per_block)
    return working, mean, grid - working


def launch(row: dict, case: Case) -> KernelLaunch:
    """The attention launch of ``case`` on ``row``'s target, from the row's figures."""
    target = TARGETS[ARCH_TO_TARGET[row["target"]]]
    elem = _elem_bytes(row)
    keys = _keys_per_iteration(case.head)
    parts = partitions(case, target.units)
    working, iterations, exiting = _wave_iterations(case, parts, keys)
    mix = {c: n for c, n in row["hot_loop_instructions"].items() if c in CLASSES and n}
    iteration_bytes = WAVES_PER_BLOCK * keys * 2 * case.head * elem
    flops = WAVES_PER_BLOCK * (row.get("hot_loop_mfma_flops") or mix.get("mfma", 0) * MFMA_FLOPS)
    workspace = case.tokens * case.q_heads * parts * (case.head + 2) * 4 if parts > 1 else 0
    table = case.sequences * math.ceil(case.context / case.block_size) * 4
    kv = case.kv_bytes(elem)
    loaded = working * iterations * iteration_bytes          # every tile's loads, DRAM or cache
    lane_bytes = row["bytes_in_flight_per_lane"] or 0
    return KernelLaunch(
        kernel=f"hip {row['kernel']}", target=target.arch, case=case.name, programs=working,
        waves_per_program=WAVES_PER_BLOCK, iterations=iterations,
        loop=LoopMix(mix, iteration_bytes, {"mfma": flops} if flops else {}),
        resident_per_unit=max(1, row["waves_per_simd"] * target.ports_per_unit // WAVES_PER_BLOCK),
        bytes_in_flight=lane_bytes * row["wave"] * WAVES_PER_BLOCK,
        dram_bytes=kv + case.q_bytes * 2 + workspace + table, useful_bytes=kv, useful_flops=case.useful_flops,
        second_launch_bytes=(workspace + case.q_bytes) if parts > 1 else 0.0,
        serial_share=row.get("hot_loop_serial_share") or 0.0, dram_share=min(1.0, kv / loaded),
        exiting_programs=exiting, exit_s=SEARCH_ROUND_TRIPS * target.cache_latency_s,
        notes=(f"{row['target']} assembly; {parts} partition(s); {working} working blocks x {iterations:.2f} "
               f"iterations of {keys} keys per wave; {exiting} blocks exit after the request search"))


def launches(rows: list[dict], case: Case) -> list[KernelLaunch]:
    """One launch per modelled row (see :func:`modelled`) for ``case`` (DECODE or PREFILL)."""
    make = launch if case.name == "decode" else prefill_launch
    return [make(r, case) for r in rows if modelled(r, case)]


#: fp32 matrix peak (v_mfma_f32_16x16x4f32: 256 flops per CU and cycle on CDNA2 and CDNA3, AMD's matrix
#: instruction calculator) x the target's CUs x clock: MI300X 304 x 256 x 2.1 GHz, one MI250X GCD 110 x 256 x
#: 1.7 GHz -- 1/8 and 1/4 of their dense bf16 matrix peaks
FP32_MATRIX_FLOPS_PER_UNIT_CYCLE = 256


def fp32_prefill_estimates(rows: list[dict], case: Case = PREFILL) -> list:
    """The prefill case with fp32 queries (the prefill kernel's v_mfma_f32_16x16x4f32 path) per modelled
    target: its launch on the fp32 prefill row at the case's head, judged against the target's fp32 matrix
    peak (the target with ``matrix_peak`` replaced). Returns :class:`devtools.roofline.Estimate` objects."""
    import dataclasses

    from devtools.roofline import estimate
    out = []
    for row in rows:
        if (row.get("kind") == "prefill" and row.get("dtype") == "fp32" and not row.get("cache")
                and row.get("head_size") == case.head
                and row.get("target") in ARCH_TO_TARGET and row.get("matrix_instructions")
                and row.get("hot_loop_instructions")):
            target = TARGETS[ARCH_TO_TARGET[row["target"]]]
            peak = target.units * FP32_MATRIX_FLOPS_PER_UNIT_CYCLE * target.clock_hz
            out.append(estimate(prefill_launch(row, case), dataclasses.replace(target, matrix_peak=peak)))
    return out


CASES = (DECODE, PREFILL)
