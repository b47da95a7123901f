#!/usr/bin/env python3
"""Paper model (an ESTIMATE, not a measurement) of the HIP decode kernel's fraction of the HBM floor.

Case (issue 16): decode, 32 sequences x 4096 context tokens, 32 query / 8 KV heads, head size 128, bf16.
The kernel must read every K and V byte once: 32 * 4096 * 8 * 128 * 2 (K, V) * 2 bytes = 537 MB; the
floor is that over the peak HBM bandwidth. The model turns the static figures of
``compile_check.report_rows()`` (occupancy, LDS, bytes in flight per lane, hot-loop instruction mix)
into a sustained bandwidth:

* resident waves per CU  W = min(4 SIMDs x waves/SIMD, blocks that fit the 64 KiB LDS x 4 waves,
  blocks of the grid per CU x 4 waves);
* new kernel: a wave's iteration loads KT keys (16 KiB at head 128) with all loads issued before
  their first use, then computes for T_c = (4 cycles per VALU/LDS op + 1 per SALU op + MFMA cycles)
  / clock (static counts: both sides of every branch, an upper bound). Per CU the rate is
  min(compute: 4 SIMDs x 16 KiB / T_c, Little's law: W x 16 KiB / (L + T_c));
* old kernel: latency-bound phases by Little's law, bytes in flight per CU / L: the QK phase with
  one 16-byte K load per thread, the PV phase with one 2-byte V load per thread (128 of 256 threads
  own a head dim at head 128); the two phases of a block do not overlap;
* bandwidth = min(peak, CUs x per-CU rate); time = bytes / bandwidth + the split-KV reduce's
  workspace traffic at peak; fraction = floor / time. Tail effects, DRAM efficiency below peak
  (typically 80-90 % for streaming reads), launch gaps and L2 effects are NOT modelled: the real
  fraction is at most the estimate times the DRAM efficiency.

Assumptions (stated in hip/README.md): loaded HBM latency L = 1.5 us (0.75 .. 3 us shown); MI300X:
304 CUs, 5.3 TB/s, 2.1 GHz, 16 cycles per 16x16x16 bf16 MFMA; MI250X: one GCD (what ROCm exposes as a
device): 110 CUs, 1.64 TB/s, 1.7 GHz, 32 cycles per MFMA; the split-KV plan: partitions of 512 keys
(8 per sequence), so 2048 blocks.

The same model is applied to the fp8-cache kernels with 16-bit queries (MFMA engine, the codes widened
in registers): 1-byte K/V elements (268 MB, half the floor), the same 32 keys per iteration (8 KiB per
wave), their own hot-loop instruction mix.

Usage: python hip/paper_model.py   (needs hipcc for the new kernel's figures)
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

SEQS, CONTEXT, HQ, HKV, HEAD, ELEM = 32, 4096, 32, 8, 128, 2
KV_BYTES = SEQS * CONTEXT * HKV * HEAD * 2 * ELEM
PARTITIONS = CONTEXT // 512
BLOCKS = SEQS * HKV * PARTITIONS          # decode: one token per request -> one block per (seq, KV head, part)
REDUCE_BYTES = 2 * SEQS * HQ * PARTITIONS * (HEAD + 2) * 4   # workspace written + read back
LDS_PER_CU = 64 * 1024
LATENCY_S = 1.5e-6


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str
    cus: int
    bandwidth: float      # bytes/s
    clock: float          # Hz
    mfma_cycles: int      # one 16x16x16 bf16 MFMA


GPUS = (Gpu("MI300X", "gfx940", 304, 5.3e12, 2.1e9, 16), Gpu("MI250X (1 GCD)", "gfx90a", 110, 1.64e12, 1.7e9, 32))

#: The kernel before issue 16 (measured from its gfx90a / gfx940 assembly before any change, bf16,
#: head 128, wave64): QK loop one global_load_dwordx4 per s_waitcnt vmcnt(0); PV loop one
#: global_load_ushort per key per s_waitcnt vmcnt(0); no v_mfma.
OLD = {"gfx90a": dict(vgprs=61, waves_per_simd=8, lds_bytes=14464, k_bytes_per_lane=16, v_bytes_per_lane=2),
       "gfx940": dict(vgprs=59, waves_per_simd=7, lds_bytes=14464, k_bytes_per_lane=16, v_bytes_per_lane=2)}


def floor_s(gpu: Gpu, elem: int = ELEM) -> float:
    return KV_BYTES * elem // ELEM / gpu.bandwidth


def resident_waves(waves_per_simd: int, lds_bytes: int, gpu: Gpu) -> int:
    by_lds = (LDS_PER_CU // lds_bytes) * 4 if lds_bytes else 10 ** 6
    by_grid = -(-BLOCKS // gpu.cus) * 4
    return min(4 * waves_per_simd, by_lds, by_grid)


def old_estimate(gpu: Gpu, latency: float = LATENCY_S) -> dict:
    f = OLD[gpu.arch]
    waves = resident_waves(f["waves_per_simd"], f["lds_bytes"], gpu)
    k_bw = min(gpu.bandwidth, gpu.cus * waves * 64 * f["k_bytes_per_lane"] / latency)
    v_bw = min(gpu.bandwidth, gpu.cus * (waves // 4) * HEAD * f["v_bytes_per_lane"] / latency)
    t = KV_BYTES / 2 / k_bw + KV_BYTES / 2 / v_bw + REDUCE_BYTES / gpu.bandwidth
    return {"resident_waves_per_cu": waves, "bytes_in_flight_per_lane": f"{f['k_bytes_per_lane']} (K) / "
            f"{f['v_bytes_per_lane']} (V)", "time_us": t * 1e6, "fraction": floor_s(gpu) / t}


def new_estimate(row: dict, gpu: Gpu, latency: float = LATENCY_S, keys_per_iteration: int = 32,
                 elem: int = ELEM) -> dict:
    """``elem``: bytes per cached element (2: the 16-bit cache; 1: an fp8 cache)."""
    waves = resident_waves(row["waves_per_simd"], row["lds_bytes"], gpu)
    mix = row["hot_loop_instructions"]
    cycles = 4 * (mix["valu"] + mix["lds"] + mix["vmem"]) + mix["salu"] + gpu.mfma_cycles * mix["mfma"]
    t_c = cycles / gpu.clock
    iter_bytes = keys_per_iteration * 2 * HEAD * elem
    per_cu = min(4 * iter_bytes / t_c, waves * iter_bytes / (latency + t_c))
    bw = min(gpu.bandwidth, gpu.cus * per_cu)
    t = KV_BYTES * elem // ELEM / bw + REDUCE_BYTES / gpu.bandwidth
    return {"resident_waves_per_cu": waves, "bytes_in_flight_per_lane": row["bytes_in_flight_per_lane"],
            "hot_loop_cycles": cycles, "compute_bound_tbps": gpu.cus * 4 * iter_bytes / t_c / 1e12,
            "latency_bound_tbps": gpu.cus * waves * iter_bytes / (latency + t_c) / 1e12,
            "time_us": t * 1e6, "fraction": floor_s(gpu, elem) / t}


def _compile_check():
    path = Path(__file__).resolve().parent / "compile_check.py"
    spec = importlib.util.spec_from_file_location("kvmulti_hip_compile_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    rows = _compile_check().report_rows(archs=tuple(g.arch for g in GPUS))
    print(f"decode {SEQS} x {CONTEXT}, {HQ}/{HKV} heads, head {HEAD}, bf16: {KV_BYTES / 1e6:.0f} MB of K/V")
    for gpu in GPUS:
        row = next(r for r in rows if r["target"] == gpu.arch and r["kernel"] == "paged_attention<bf16,128,wave64>")
        print(f"\n{gpu.name} ({gpu.arch}): HBM floor {floor_s(gpu) * 1e6:.0f} us")
        for lat in (0.75e-6, LATENCY_S, 3e-6):
            o, n = old_estimate(gpu, lat), new_estimate(row, gpu, lat)
            print(f"  L = {lat * 1e6:.2f} us: old {o['time_us']:.0f} us = {o['fraction']:.0%} of floor | "
                  f"new {n['time_us']:.0f} us = {n['fraction']:.0%} of floor "
                  f"(compute bound {n['compute_bound_tbps']:.1f} TB/s, Little bound {n['latency_bound_tbps']:.1f} TB/s,"
                  f" {n['hot_loop_cycles']} cycles/iteration, {n['resident_waves_per_cu']} waves/CU)")
    print(f"\nfp8 caches, 16-bit queries (MFMA engine): {KV_BYTES // ELEM / 1e6:.0f} MB of K/V, "
          f"L = {LATENCY_S * 1e6} us")
    for gpu in GPUS:
        print(f"{gpu.name} ({gpu.arch}): HBM floor {floor_s(gpu, 1) * 1e6:.0f} us")
        for query in ("bf16", "fp16"):
            for cache in ("e4m3", "e5m2"):
                row = next(r for r in rows if r["target"] == gpu.arch
                           and r["kernel"] == f"paged_attention<{query},{cache},128,wave64>")
                n = new_estimate(row, gpu, elem=1)
                print(f"  {query} query, {cache} cache: {n['time_us']:.0f} us = {n['fraction']:.0%} of floor "
                      f"(compute bound {n['compute_bound_tbps']:.1f} TB/s, "
                      f"Little bound {n['latency_bound_tbps']:.1f} TB/s, "
                      f"{n['hot_loop_cycles']} cycles/iteration, {n['resident_waves_per_cu']} waves/CU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
