"""SYCL adapter of the roofline model: ``sycl_gpu_evidence.report_rows()`` rows -> :class:`KernelLaunch`.

The launch (``kvmulti/backends/sycl/backend.py``, ``sycl/kernels.cpp``; fp16 / bf16 take the matrix
path): one work-group of WG = 128 work-items (8 sub-groups of 16, each one hardware thread at SIMD16)
per (tile of <= 64 flattened (token, query head) rows, KV head[, partition]). Tiles of at most MR = 8
rows (decode) run ``kvm_paged_attention``: row groups of MR (the matrix built-in's M); a pass takes
RGP = min(row groups, 8) of them, and the 8 / RGP sub-groups of a row group split that row group's own
visible keys in steps of KS = 16 keys. Larger tiles (prefill) run ``kvm_paged_prefill``: row groups of
PR = 16 rows (one per lane), RGP = min(row groups, 8) per pass, each split over ``prefill_splits(RGP)``
sub-groups (a 64-row tile: 4 row groups x 2 splits). One hot-loop trip of a thread = one 16-key step of
one row group (``hot_loop_instructions``, read from IGC's assembly in SIMD16-instruction equivalents;
for ``kvm_paged_prefill`` its unmasked loop: the masked steps at a causal or window edge, one or two
per row group, are counted as unmasked ones); a pass lasts as long as its slowest sub-group.
Rows of the vector body (DG2's ``acm-g10``): the tile's keys in steps of KB = 4 keys, sub-group ``s``
taking steps ``s, s + 8, ...``, once per pass of RB = 4 rows; one trip = one 4-key step.
Split-KV (partitions of 512 keys, a reduce launch) when the longest span exceeds 1024 keys and there
are fewer than 4 work-groups per compute unit (the device's compute units = its XVEs). Resident
work-groups per Xe-core: its hardware threads (8 per XVE at 128 GRF, 4 at 256 GRF) over 8 threads,
and its SLM over the work-group's.
"""

from __future__ import annotations

import math

from devtools.roofline import DECODE, PREFILL, Case, KernelLaunch, LoopMix, TARGETS

#: evidence rows modelled: the shipped configurations (pvc, acm-g10) and the other PVC modes
ROW_TO_TARGET = {"pvc": "pvc", "pvc-128grf": "pvc", "acm-g10": "acm-g10"}
#: rows built with the matrix body (the others: the vector body)
MATRIX_ROWS = {"pvc", "pvc-128grf"}
RB, KB = 4, 4
#: tiles of at most MR rows (decode) run kvm_paged_attention, larger ones kvm_paged_prefill
KERNEL, PREFILL_KERNEL = "kvm_paged_attention", "kvm_paged_prefill"
WG, SG, ROWS, MR, KS, PR = 128, 16, 64, 8, 16, 16
NSG = WG // SG
PARTITION, SPLIT_MIN_SPAN, SPLIT_WG_PER_CU = 512, 1024, 4
#: SLM per Xe-core (bytes) and hardware threads per XVE at 128 GRF (256 GRF: half)
SLM_PER_CORE = {"pvc": 128 * 1024, "acm-g10": 64 * 1024}
THREADS_PER_XVE = 8


def kernel_for(case: Case) -> str:
    """The attention kernel the host launches for ``case``'s tiles (all of one size in the modelled cases)."""
    return PREFILL_KERNEL if case.query_len * (case.q_heads // case.kv_heads) > MR else KERNEL


def prefill_splits(rgp: int) -> int:
    """Key splits of a row group of PR rows in kvm_paged_prefill's matrix body (kernels.cpp:
    prefill_splits): at most NSG / rgp, as many as the merge scratch (NSG * MR rows) holds, at most 5."""
    return max(1, min(NSG // rgp, 1 + NSG * MR // (rgp * PR), 5))


def _tiles(case: Case, group_rows: int = MR) -> list[tuple[int, list[int]]]:
    """Per tile of one KV head: (its rows, the keys each of its row groups of ``group_rows`` rows sees:
    its last row's causal range)."""
    group = case.q_heads // case.kv_heads
    first = case.context - case.query_len
    out = []
    for _ in range(case.sequences):
        rows = case.query_len * group
        for f0 in range(0, rows, ROWS):
            nrows = min(ROWS, rows - f0)
            out.append((nrows, [first + (f0 + min(r0 + group_rows, nrows) - 1) // group + 1
                                for r0 in range(0, nrows, group_rows)]))
    return out


def _trips(nrows: int, row_groups: list[int], lo: int, hi: int | None, matrix: bool, prefill: bool = False) -> int:
    """Key steps of the slowest sub-group of one work-group over keys [lo, hi) (hi None: each row
    group's own end), summed over its passes (``matrix``: the matrix body, else the vector body;
    ``prefill``: kvm_paged_prefill's row groups of PR rows and its key splits)."""
    if not matrix:       # every pass of RB rows walks the tile's whole range
        span = max(0, (max(row_groups) if hi is None else min(max(row_groups), hi)) - lo)
        return math.ceil(nrows / RB) * math.ceil(math.ceil(span / KB) / NSG)
    rgp = min(len(row_groups), NSG)
    kspl = prefill_splits(rgp) if prefill else NSG // rgp
    total = 0
    for p0 in range(0, len(row_groups), rgp):
        spans = [max(0, (keys if hi is None else min(keys, hi)) - lo) for keys in row_groups[p0:p0 + rgp]]
        total += max(math.ceil(span / (KS * kspl)) for span in spans)
    return total


def launch(row: dict, case: Case) -> KernelLaunch:
    """The attention launch of ``case`` on ``row``'s target, from the row's figures."""
    target = TARGETS[ROW_TO_TARGET[row["target"]]]
    matrix = row["target"] in MATRIX_ROWS
    prefill = matrix and row["kernel"] == PREFILL_KERNEL
    tiles = _tiles(case, PR if prefill else MR)
    span = max(max(keys) for _, keys in tiles)
    compute_units = target.units * target.ports_per_unit
    split = span > SPLIT_MIN_SPAN and len(tiles) * case.kv_heads < SPLIT_WG_PER_CU * compute_units
    parts = math.ceil(span / PARTITION) if split else 1
    waves = NSG
    trips = []
    for nrows, row_groups in tiles:
        for part in range(parts):
            lo, hi = (part * PARTITION, (part + 1) * PARTITION) if split else (0, None)
            if max(row_groups) > lo:
                trips.append(_trips(nrows, row_groups, lo, hi, matrix, prefill))
    grf = int(row["regs_or_grf_mode"].split()[0])
    threads = target.ports_per_unit * THREADS_PER_XVE * 128 // max(128, grf)
    resident = max(1, min(threads // waves, SLM_PER_CORE[target.arch] // max(1, row["slm_bytes"])))
    elem = 1 if row.get("cache") else 2
    kv = case.kv_bytes(elem)
    loaded = len(trips) * case.kv_heads * sum(trips) / len(trips) * waves * row["hot_loop_load_bytes"]
    partials = case.tokens * case.q_heads * parts * (case.head + 2) * 4 if split else 0
    mix = {c: n for c, n in row["hot_loop_instructions"].items() if n}
    return KernelLaunch(
        kernel=f"sycl {row['kernel']} ({row['target']}{', ' + row['cache'] if row.get('cache') else ''})",
        target=target.arch, case=case.name,
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
    """One launch per attention row of a modelled target (:data:`ROW_TO_TARGET`) for ``case``: the
    kernel the host launches for its tiles (:func:`kernel_for`)."""
    kernel = kernel_for(case)
    return [launch(r, case) for r in rows
            if r["kernel"] == kernel and r["target"] in ROW_TO_TARGET and r.get("hot_loop_instructions")]


CASES = (DECODE, PREFILL)
