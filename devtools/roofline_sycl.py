"""SYCL adapter of the roofline model: ``gpu_evidence.report_rows()`` rows -> :class:`KernelLaunch`.

The launch (``kvmulti/backends/sycl/backend.py``, ``sycl/kernels.cpp``): one work-group of WG = 128
work-items (8 sub-groups of 16, each one hardware thread at SIMD16) per (tile of <= 16 flattened
(token, query head) rows, KV head[, partition]); the tile's visible keys go in steps of KB = 4 keys,
sub-group ``s`` taking steps ``s, s + 8, ...``, once per pass of RB = 4 rows (a 16-row tile makes 4
passes over its keys). One hot-loop trip of a thread = one step (``hot_loop_instructions``, read from
IGC's assembly in SIMD16-instruction equivalents). Split-KV (partitions of 512 keys, a reduce
launch) when the longest span exceeds 1024 keys and there are fewer than 4 work-groups per compute
unit (the device's compute units = its XVEs). Resident work-groups per Xe-core: its hardware threads
(8 per XVE at 128 GRF, 4 at 256 GRF) over 8 threads, and its SLM over the work-group's.
"""

from __future__ import annotations

import math

from devtools.roofline import DECODE, PREFILL, Case, KernelLaunch, LoopMix, TARGETS

ROW_TO_TARGET = {"pvc": "pvc", "pvc-large-grf": "pvc", "acm-g10": "acm-g10"}
KERNEL = "kvm_paged_attention"
WG, SG, ROWS, RB, KB = 128, 16, 16, 4, 4
PARTITION, SPLIT_MIN_SPAN, SPLIT_WG_PER_CU = 512, 1024, 4
#: SLM per Xe-core (bytes) and hardware threads per XVE at 128 GRF (256 GRF: half)
SLM_PER_CORE = {"pvc": 128 * 1024, "acm-g10": 64 * 1024}
THREADS_PER_XVE = 8


def _tiles(case: Case) -> list[tuple[int, int]]:
    """(rows, keys the tile's last row sees) per tile of one KV head."""
    group = case.q_heads // case.kv_heads
    first = case.context - case.query_len
    out = []
    for _ in range(case.sequences):
        rows = case.query_len * group
        for f0 in range(0, rows, ROWS):
            nrows = min(ROWS, rows - f0)
            out.append((nrows, first + (f0 + nrows - 1) // group + 1))
    return out


def launch(row: dict, case: Case) -> KernelLaunch:
    """The attention launch of ``case`` on ``row``'s target, from the row's figures."""
    target = TARGETS[ROW_TO_TARGET[row["target"]]]
    tiles = _tiles(case)
    span = max(keys for _, keys in tiles)
    compute_units = target.units * target.ports_per_unit
    split = span > SPLIT_MIN_SPAN and len(tiles) * case.kv_heads < SPLIT_WG_PER_CU * compute_units
    parts = math.ceil(span / PARTITION) if split else 1
    waves = WG // SG
    trips = []
    for nrows, keys in tiles:
        for part in range(parts):
            lo, hi = (part * PARTITION, min(keys, (part + 1) * PARTITION)) if split else (0, keys)
            if hi > lo:
                trips.append(math.ceil(nrows / RB) * math.ceil(math.ceil((hi - lo) / KB) / waves))
    grf = int(row["regs_or_grf_mode"].split()[0])
    threads = target.ports_per_unit * THREADS_PER_XVE * 128 // max(128, grf)
    resident = max(1, min(threads // waves, SLM_PER_CORE[target.arch] // max(1, row["slm_bytes"])))
    elem = 1 if row.get("cache") else 2
    kv = case.kv_bytes(elem)
    loaded = len(trips) * case.kv_heads * sum(trips) / len(trips) * waves * row["hot_loop_load_bytes"]
    partials = case.tokens * case.q_heads * parts * (case.head + 2) * 4 if split else 0
    mix = {c: n for c, n in row["hot_loop_instructions"].items() if n}
    return KernelLaunch(
        kernel=f"sycl {KERNEL} ({row['target']}{', ' + row['cache'] if row.get('cache') else ''})", target=target.arch, case=case.name,
        programs=len(trips) * case.kv_heads, waves_per_program=waves, iterations=sum(trips) / len(trips),
        loop=LoopMix(mix, waves * row["hot_loop_load_bytes"],
                     {"dpas": waves * row["hot_loop_dpas_flops"]} if row.get("hot_loop_dpas_flops") else {}),
        resident_per_unit=resident,
        bytes_in_flight=waves * row["hot_loop_bytes_in_flight"], dram_bytes=kv + 2 * case.q_bytes + partials,
        useful_bytes=kv, useful_flops=case.useful_flops, second_launch_bytes=(partials + case.q_bytes) if split else 0,
        serial_share=0.0, dram_share=min(1.0, kv / loaded),
        notes=(f"{row['target']}: {row['regs_or_grf_mode']}, {row['spills']} B spilled, SIMD{row['simd_width']}, "
               f"{row['matrix_instructions']} dpas; {parts} partition(s); {resident} work-groups per Xe-core; "
               f"{row['hot_loop_bytes_in_flight']} B in flight per thread"))


def launches(rows: list[dict], case: Case) -> list[KernelLaunch]:
    """One launch per attention row of a modelled target (pvc, pvc-large-grf, acm-g10) for ``case``."""
    return [launch(r, case) for r in rows
            if r["kernel"] == KERNEL and r["target"] in ROW_TO_TARGET and r.get("hot_loop_instructions")]


CASES = (DECODE, PREFILL)
