"""Triton adapter of the roofline model: cross-compiled rows -> :class:`KernelLaunch`.

Rows are those of ``benchmarks/gpu_report.py``'s triton section (``triton_cross_compile.analyse`` figures
plus ``kernel``, ``target``, ``spec``): the paper-model batches ``model_{decode,prefill}_{target}``
(with a > 2 GiB cache where the target compiles that case separately) of ``unified_attention``.

The launch (``kvmulti/backends/triton/launch.py``): grid (query rows // BLOCK_Q + requests, KV heads,
partitions); a program computes BLOCK_M rows (BLOCK_Q tokens x NUM_QPK heads of one KV head) and walks
its visible keys in tiles of TILE_N, one tile per KV-loop trip (``hot_loop_instructions`` counts one
trip per warp / wave); the grid's ``requests`` extra programs find no q-block and return. Split-KV:
partitions of PART_SIZE keys and a reduce launch. Matrix flops per trip: 4 x BLOCK_M x TILE_N x
HEAD_PAD (QK^T and P.V). K/V tiles in flight: ``kv_tiles_in_flight_at_dot`` on NVIDIA (from TTGIR),
one prefetched tile on AMD when ``prefetched_tile``; the serial share of a trip: the AMDGCN's own
(``hot_loop_serial_share``), on NVIDIA 1 - the tiles in flight at the dot (capped to [0, 1]).

Programs in launch order (grid x fastest: each request's q-blocks in order, then KV heads, then
partitions), each with its own trips, for the grid bound's list schedule; each first runs its
prologue (:data:`PROLOGUE_CACHE_ROUND_TRIPS` plus the request search's, then the first K/V tile
from DRAM). Prefill (``PREFILL``): a program's tiles from the causal end of its first row on run
the masked loop; a row with ``masked_stream_cycles`` (that loop's trip from the SASS) counts them
at it. A row with ``hot_loop_barriers`` (CTA barriers in the hot loop's SASS) and more warps than
an SM has sub-partitions runs its matrix work in lockstep (:attr:`KernelLaunch.lockstep_matrix`).
"""

from __future__ import annotations

import math

from devtools.roofline import DECODE, PREFILL, Case, KernelLaunch, LoopMix, Target, TARGETS

KERNEL = "unified_attention"
#: a program that finds no q-block returns after reading the request bounds: one cache round trip
#: (assumption)
EXIT_ROUND_TRIPS = 1
#: a working program's dependent cache round trips before its first K/V tile's addresses are known
#: (triton_kernels/unified_attention.py): the request bounds (query_start_loc), the sequence length,
#: the block-table words; the request search adds one per trip (ceil(log2(requests)))
PROLOGUE_CACHE_ROUND_TRIPS = 3


def _c(row: dict, name: str) -> int | bool:
    value = row["constexprs"][name]
    return value == "True" if value in ("True", "False") else int(value)


def pick_rows(rows: list[dict], case: Case) -> list[dict]:
    """Per target, the row of the case's model launch (the > 2 GiB-cache compile first)."""
    out = []
    for target in TARGETS:
        for spec in (f"model_{case.name}_{target}_large_cache", f"model_{case.name}_{target}"):
            found = [r for r in rows if r["target"] == target and r.get("spec") == spec and r["kernel"] == KERNEL
                     and not r.get("problem") and r.get("hot_loop_instructions")]
            if found:
                out.append(found[0])
                break
    return out


def launch(row: dict, case: Case, target: Target | None = None) -> KernelLaunch:
    """The attention launch of ``case`` on ``row``'s target (or ``target``, a device of the same compile
    target, e.g. :data:`devtools.roofline.H200`), from the row's figures. A row with ``stream_cycles``
    (one warp's trip through the hot loop from the SASS control codes, devtools/roofline_sass.py) gives
    the wave's own stream from it."""
    target = target or TARGETS[row["target"]]
    block_m, block_q, tile_n = _c(row, "BLOCK_M"), _c(row, "BLOCK_Q"), _c(row, "TILE_N")
    hp, hpv = _c(row, "HEAD_PAD"), _c(row, "HEAD_PAD_V")
    split = _c(row, "SPLIT")
    parts = math.ceil(case.context / _c(row, "PART_SIZE")) if split else 1
    span = _c(row, "PART_SIZE") if split else None
    first = case.context - case.query_len
    prefill = bool(row["constexprs"].get("PREFILL") == "True")
    trips, masked = [], []          # per working program in launch order: trips, masked-loop trips
    for part in range(parts):
        for _ in range(case.kv_heads):
            for _ in range(case.sequences):
                for q0 in range(0, case.query_len, block_q):
                    hi = first + min(case.query_len, q0 + block_q)     # the q-block's last token sees [0, hi)
                    lo, top = (part * span, min(hi, (part + 1) * span)) if split else (0, hi)
                    if top > lo:
                        trips.append(math.ceil((top - lo) / tile_n))
                        # the prefill loop: whole tiles up to the causal end of the first row unmasked
                        whole = min(first + q0 + 1, top) // tile_n if prefill and not split else 0
                        masked.append(trips[-1] - whole)
    programs = len(trips)
    q_blocks = sum(math.ceil(case.query_len / block_q) for _ in range(case.sequences))
    exiting = (case.tokens // block_q + case.sequences - q_blocks) * case.kv_heads * parts
    mix = {c: n for c, n in row["hot_loop_instructions"].items() if n}
    matrix = "mfma" if target.vendor == "amd" else ("wgmma" if mix.get("wgmma") else "mma")
    in_flight = (1.0 if row.get("prefetched_tile") else 0.0) if target.vendor == "amd" else float(
        row.get("kv_tiles_in_flight_at_dot") or 0.0)
    serial = row.get("hot_loop_serial_share")
    if serial is None:
        serial = min(1.0, max(0.0, 1.0 - in_flight))
    tile_bytes = tile_n * (hp + hpv) * 2
    partials = case.tokens * case.q_heads * parts * (hpv + 2) * 4 if split else 0
    kv = case.kv_bytes()
    stream = row.get("stream_cycles")
    if stream is not None and prefill and row.get("masked_stream_cycles"):
        stream += (row["masked_stream_cycles"] - stream) * sum(masked) / sum(trips)
    search = math.ceil(math.log2(case.sequences)) if case.sequences > 1 else 0
    prologue = (PROLOGUE_CACHE_ROUND_TRIPS + search) * target.cache_latency_s + target.latency_s
    lockstep = bool(row.get("hot_loop_barriers")) and row["num_warps"] > target.ports_per_unit
    return KernelLaunch(
        kernel=f"triton {KERNEL}", target=target.arch, case="decode" if case.query_len == 1 else "prefill",
        programs=programs,
        waves_per_program=row["num_warps"], iterations=sum(trips) / len(trips),
        loop=LoopMix(mix, tile_bytes, {matrix: 4 * block_m * tile_n * hp} if mix.get(matrix) else {}),
        resident_per_unit=max(1, row["occupancy"]), bytes_in_flight=max(1.0, in_flight) * tile_bytes,
        dram_bytes=kv + 2 * case.q_bytes + partials, useful_bytes=kv, useful_flops=case.useful_flops,
        second_launch_bytes=(partials + case.q_bytes) if split else 0.0, serial_share=serial,
        dram_share=min(1.0, kv / (programs * sum(trips) / len(trips) * tile_bytes)),
        exiting_programs=exiting, exit_s=EXIT_ROUND_TRIPS * target.cache_latency_s,
        stream_cycles=stream, program_iterations=tuple(trips), prologue_s=prologue, lockstep_matrix=lockstep,
        notes=(f"{row['spec']}: tile {block_m}x{tile_n}, {row['num_warps']} warps, {row['num_stages']} stages, "
               f"{parts} partition(s), {in_flight:g} K/V tiles in flight at the dot"
               + (", matrix work in lockstep" if lockstep else "")))


def launches(rows: list[dict], case: Case) -> list[KernelLaunch]:
    """One launch per target with a compiled model row for ``case`` (DECODE or PREFILL)."""
    return [launch(r, case) for r in pick_rows(rows, case)]


CASES = (DECODE, PREFILL)
