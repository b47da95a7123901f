#!/usr/bin/env python3
"""GPU evidence without GPUs: one static report for every shipped kernel, from compiler output.

    python benchmarks/gpu_report.py [--sections triton,hip,sycl] [--json OUT] [--full]

Sections come from a registry (:data:`SECTIONS`): each is ``name -> "module:function"``, the
function returning ``list[dict]`` rows with at least ``kernel`` and ``target``. A section whose
module is missing (a kernel family that has not published its rows yet) is listed as absent, not
faked. Adding one is one line in :data:`SECTIONS`.

* ``triton``: every Triton specialisation kvmulti launches (``devtools.triton_cross_compile``)
  cross-compiled for sm_80, sm_90, gfx90a, gfx942: registers, spills, shared/LDS bytes, occupancy
  (CTAs per SM / work-groups per CU from registers and shared memory against the target's
  limits), matrix instructions (static count of mma.sync / wgmma / v_mfma), global load widths,
  cp.async.wait_group immediates, K/V tiles in flight at the KV loop's dots (read from TTGIR:
  ``cross_compile.kv_tiles_in_flight_at_dot``); then the paper model below.
* ``hip``: ``devtools.hip_compile_check.report_rows`` when devtools/hip_compile_check.py provides it,
  else rows built here from its hipcc resource-usage pass (registers, LDS, waves/SIMD, spills). Every
  kernel x gfx90a / gfx940 / gfx1030, fp8 caches (e4m3fn, e5m2) included; printed: the attention kernels
  at head 128 (the decode case's) per query dtype x cache, with the engine (MFMA / FMA); ``--full``:
  every row. Thresholds: ``compile_check.row_problems`` (an fp16 / bf16 query over a 16-bit or an fp8
  cache uses v_mfma on gfx90a / gfx940, no spills, 16-byte hot-loop loads, occupancy).
* ``sycl``: ``devtools.sycl_gpu_evidence.report_rows`` once devtools/ provides it (bf16, head 128);
  ``sycl_fp8``: the same case over an fp8 e4m3fn cache (``gpu_evidence.FP8_CONFIG``, rows with
  ``cache``). Triton's fp8 specialisations (e4m3 / e5m2 caches with bf16 / fp16 / fp32 queries:
  ``cross_compile.fp8_specs``) are rows of the ``triton`` section.

Paper model (an ESTIMATE from compile facts and spec-sheet figures, not a measurement)
---------------------------------------------------------------------------------------
Decode: 32 sequences x 4096 positions, 32 query / 8 KV heads, head 128, bf16, block 16, HND.
Prefill: 8 prompts x 2048 tokens, same heads. For each device the launch the backend would make
on it (its CU count decides split-KV) is compiled with a > 2 GiB cache (a serving cache is larger
than 2 GiB, and Triton's AMD backend compiles that case separately, without buffer loads).

Per program (one CTA / work-group) the KV loop runs tiles of ``TILE_N`` key positions; a tile
moves ``B = TILE_N * (head + head_v) * 2`` bytes and does ``F = 4 * BLOCK_M * TILE_N * head``
flops. With ``o`` tiles' loads in flight while a tile's dots run (``o`` = the K/V tiles whose
``cp.async`` groups are still open at the loop's first dot on NVIDIA, replayed from TTGIR; 1 on
AMD when the loop carries a prefetched tile, seen as the dots peeled into an epilogue in TTGIR) a
tile takes

    T_tile = max(t_math, (L + t_math) / (1 + o)),   t_math = F / (peak_flops / units)

(L: DRAM latency). Little's law per SM/CU: ``R`` resident programs (occupancy, limited by how
many programs there are) keep ``R * (1 + o) * B`` bytes in flight, i.e. demand
``R * B / T_tile`` bytes/s and ``R * F / T_tile`` flops/s, each capped at the unit's share of the
device peak. Estimated time = waves x tiles per program x the capped tile period; the fraction of
the floor = floor time / estimated time, where the floor is cache bytes / peak bandwidth (decode)
or useful causal flops / peak flops (prefill). ``mma.sync`` on sm_90 is credited with
``MMA_SYNC_ON_HOPPER`` of the wgmma peak. The latencies are assumptions, stated in :data:`DEVICES`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository root: devtools

#: name -> "module:function" returning list[dict] rows (kernel, target, ...). One line per section.
SECTIONS: dict[str, str] = {
    "triton": "gpu_report:triton_rows",
    "hip": "devtools.hip_compile_check:report_rows",
    "sycl": "devtools.sycl_gpu_evidence:report_rows",
    "sycl_fp8": "gpu_report:sycl_fp8_rows",
}
#: used when a section's own module does not provide report_rows yet
FALLBACKS: dict[str, str] = {"hip": "gpu_report:hip_rows_from_resource_usage"}


# --------------------------------------------------------------------------------------- devices
@dataclass(frozen=True)
class Device:
    """Spec-sheet figures of the device a target stands for (dense bf16, no sparsity)."""
    name: str
    target: str
    units: int                  # SMs / CUs (MI250X: one GCD, the device torch sees)
    bandwidth: float            # bytes/s
    bf16_flops: float           # flop/s of the target's best bf16 matrix instruction
    latency: float              # s, loaded DRAM latency (assumption)


DEVICES = (
    Device("H100 SXM", "sm_90", 132, 3.35e12, 989e12, 650e-9),
    Device("MI300X", "gfx942", 304, 5.3e12, 1307e12, 800e-9),
    Device("MI250X (one GCD)", "gfx90a", 110, 1.6e12, 191.5e12, 750e-9),
)
MMA_SYNC_ON_HOPPER = 0.6        # mma.sync reaches about this share of wgmma's peak on H100 (assumption)

DECODE = dict(num_seqs=32, context=4096, q_heads=32, kv_heads=8, head=128, dtype_bytes=2)
PREFILL = dict(num_prompts=8, prompt=2048, q_heads=32, kv_heads=8, head=128, dtype_bytes=2)


# --------------------------------------------------------------------------------------- triton
def triton_rows(jobs: int = 2) -> list[dict]:
    """One row per (Triton specialisation, target): the figures of ``cross_compile.analyse``."""
    from devtools import triton_cross_compile as cross_compile
    rows = []
    for target, results in cross_compile.compile_in_subprocesses(jobs=jobs).items():
        for r in results:
            rows.append(dict(r, kernel=r["kernel"], target=target, spec=r["name"].split("-", 1)[1]))
    return rows


def tile_of(row: dict) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, HEAD_PAD, HEAD_PAD_V) of an attention row."""
    c = row["constexprs"]
    return tuple(int(c[k]) for k in ("BLOCK_M", "TILE_N", "HEAD_PAD", "HEAD_PAD_V"))


def _overlap(row: dict) -> int:
    if row["target"].startswith("sm_"):
        return int(row.get("kv_tiles_in_flight_at_dot") or 0)
    return 1 if row.get("prefetched_tile") else 0


def tile_period(t_math: float, latency: float, overlap: int) -> float:
    """Seconds per tile of one program: loads then dots, with ``overlap`` tiles' loads in flight."""
    return max(t_math, (latency + t_math) / (1 + overlap))


def model_decode(row: dict, dev: Device, split_parts: int) -> dict:
    """Estimated fraction of the memory floor for the DECODE batch (see the module docstring)."""
    d = DECODE
    block_m, tile_n, hp, hpv = tile_of(row)
    bytes_total = d["num_seqs"] * d["context"] * d["kv_heads"] * 2 * d["head"] * d["dtype_bytes"]
    programs = d["num_seqs"] * d["kv_heads"] * split_parts
    tiles = math.ceil(d["context"] / split_parts / tile_n)
    tile_bytes = tile_n * (hp + hpv) * d["dtype_bytes"]
    tile_flops = 4 * block_m * tile_n * hp
    return _estimate(row, dev, programs, tiles, tile_bytes, tile_flops, floor=bytes_total / dev.bandwidth,
                     kind="memory")


def model_prefill(row: dict, dev: Device) -> dict:
    """Estimated fraction of the compute floor for the PREFILL batch (causal; see the docstring)."""
    p = PREFILL
    block_m, tile_n, hp, hpv = tile_of(row)
    group = p["q_heads"] // p["kv_heads"]
    block_q = block_m // group
    q_blocks = math.ceil(p["prompt"] / block_q)
    programs = p["num_prompts"] * p["kv_heads"] * q_blocks
    # causal: q-block j needs keys [0, (j+1) * block_q); mean tiles per program
    tiles = sum(math.ceil(min(p["prompt"], (j + 1) * block_q) / tile_n) for j in range(q_blocks)) / q_blocks
    useful = p["num_prompts"] * 2 * p["q_heads"] * p["head"] * p["prompt"] * (p["prompt"] + 1)
    tile_bytes = tile_n * (hp + hpv) * p["dtype_bytes"]
    tile_flops = 4 * block_m * tile_n * hp
    return _estimate(row, dev, programs, tiles, tile_bytes, tile_flops, floor=useful / dev.bf16_flops, kind="compute")


def _estimate(row: dict, dev: Device, programs: int, tiles: float, tile_bytes: int, tile_flops: int, *,
              floor: float, kind: str) -> dict:
    flops_peak = dev.bf16_flops * (MMA_SYNC_ON_HOPPER if "mma.sync" in row.get("matrix_kind", []) else 1.0)
    if not row.get("matrix_instructions"):
        flops_peak /= 8             # dots on vector ALUs (no matrix instruction): an 8x slower ceiling
    unit_flops, unit_bw = flops_peak / dev.units, dev.bandwidth / dev.units
    resident = max(1, min(row["occupancy"], math.ceil(programs / dev.units)))
    t_math = tile_flops / unit_flops
    period = tile_period(t_math, dev.latency, _overlap(row))
    # the unit's R programs each finish a tile per `period`, unless bandwidth or flops cap them
    unit_tile_rate = min(resident / period, unit_bw / tile_bytes, unit_flops / tile_flops)
    waves = math.ceil(programs / (resident * dev.units))
    est = waves * tiles * resident / unit_tile_rate
    return {"device": dev.name, "target": dev.target, "kind": kind, "programs": programs, "resident_per_unit": resident,
            "overlap_tiles": _overlap(row), "bytes_in_flight_per_unit": resident * (1 + _overlap(row)) * tile_bytes,
            "floor_us": floor * 1e6, "estimate_us": est * 1e6, "fraction_of_floor": min(1.0, floor / est)}


def paper_model(rows: list[dict]) -> list[dict]:
    """Decode and prefill estimates per device from the > 2 GiB-cache model launches of ``rows``."""
    out = []
    for dev in DEVICES:
        for case in ("decode", "prefill"):
            # NVIDIA compiles the > 2 GiB cache like the small one (one specialisation, named after the first)
            attn = [r for spec in (f"model_{case}_{dev.target}_large_cache", f"model_{case}_{dev.target}")
                    for r in rows if r["target"] == dev.target and r["spec"] == spec
                    and r["kernel"] == "unified_attention" and not r.get("problem")]
            if not attn:
                out.append({"device": dev.name, "target": dev.target, "kind": case, "problem": "not compiled"})
                continue
            row = attn[0]
            parts = int(row["constexprs"].get("SPLIT") == "True") and math.ceil(
                DECODE["context"] / int(row["constexprs"]["PART_SIZE"]))
            est = model_decode(row, dev, parts or 1) if case == "decode" else model_prefill(row, dev)
            out.append(dict(est, case=case, tile=tile_of(row), split=bool(parts), regs=row["regs"],
                            shared_bytes=row["shared_bytes"], occupancy=row["occupancy"]))
    return out


# --------------------------------------------------------------------------------------- hip (today)
def hip_rows_from_resource_usage() -> list[dict]:
    """HIP rows from devtools/hip_compile_check.py's hipcc resource-usage pass (AMD targets it checks):
    registers, LDS, waves per SIMD, spills. Matrix instructions, load widths and bytes in flight
    are left to devtools/hip_compile_check.report_rows (None here: not measured by this fallback)."""
    from devtools import hip_compile_check as cc
    if cc.hipcc() is None:
        raise RuntimeError("hipcc not found")
    rows = []
    for arch in cc.AMD_ARCHS:
        cmd = [cc.hipcc(), "-O3", "-std=c++17", f"--offload-arch={arch}", "--cuda-device-only", "-c",
               str(cc.SOURCE), "-o", os.devnull, "-Rpass-analysis=kernel-resource-usage"]
        rc, log, _ = cc._run(cmd, cc._amd_env())
        if rc != 0:
            raise RuntimeError(f"hipcc failed for {arch}:\n{log[-3000:]}")
        waves = _waves_per_simd(log)
        for kernel, f in sorted(cc.parse_resource_usage(log).items()):
            rows.append({"kernel": _demangle_hint(kernel), "target": arch, "vgprs": f.get("VGPRs"),
                         "sgprs": f.get("SGPRs"), "lds_bytes": f.get("LDS Size"),
                         "waves_per_simd": waves.get(kernel),
                         "spills": f.get("SGPRs Spill", 0) + f.get("VGPRs Spill", 0),
                         "matrix_instructions": None, "load_widths_bytes": None, "bytes_in_flight_per_lane": None})
    return rows


HIP_SHOWN_HEAD_SIZE = 128       # the decode case's head size: the attention rows the report prints


def format_hip(rows: list[dict], full: bool) -> list[str]:
    """The HIP attention kernels at HIP_SHOWN_HEAD_SIZE (every target x query dtype x cache: 16-bit or
    fp8) with their engine; ``full``: every row, generically. Rows from the resource-usage fallback (no
    matrix counts) are printed generically."""
    if full or not rows or "hot_loop_instructions" not in rows[0]:
        return format_generic(rows)
    out = ["target  query cache  engine  vgprs sgprs   lds  waves spills mfma  hot-loop valu/mfma/lds/vmem  "
           "in-flight B/lane"]
    shown = [r for r in rows if r.get("kind") == "attention" and r.get("head_size") == HIP_SHOWN_HEAD_SIZE]
    for r in sorted(shown, key=lambda r: (r["target"], r["dtype"], r.get("cache") or "")):
        mix = r["hot_loop_instructions"]
        out.append(f"{r['target']:7} {r['dtype']:5} {r.get('cache') or r['dtype']:5}  "
                   f"{'MFMA' if r['matrix_instructions'] else 'FMA':6} {r['vgprs']:5} {r['sgprs']:5} "
                   f"{r['lds_bytes']:5} "
                   f"{r['waves_per_simd']:6} {r['spills']:6} {r['matrix_instructions']:4}  "
                   f"{mix.get('valu', 0):>11}/{mix.get('mfma', 0)}/{mix.get('lds', 0)}/{mix.get('vmem', 0):<10} "
                   f"{r['bytes_in_flight_per_lane']:>6}")
    out.append(f"({len(shown)} of {len(rows)} rows: attention at head {HIP_SHOWN_HEAD_SIZE}; --full or --json: all)")
    return out


def hip_threshold_failures(rows: list[dict]) -> list[str]:
    """devtools/hip_compile_check.py's CI thresholds over the HIP section's rows (the fallback's rows carry too
    little to check and are skipped)."""
    from devtools import hip_compile_check as cc
    return [p for r in rows if "hot_loop_instructions" in r for p in cc.row_problems(r)]


def _waves_per_simd(log: str) -> dict[str, int]:
    out, current = {}, None
    for line in log.splitlines():
        m = re.search(r"remark: Function Name: (\S+)", line)
        if m:
            current = m.group(1)
        m = re.search(r"remark:\s+Occupancy \[waves/SIMD\]: (\d+)", line)
        if m and current:
            out[current] = int(m.group(1))
    return out


def _demangle_hint(mangled: str) -> str:
    """A short readable name: the kernel's identifier and its template integers."""
    m = re.match(r"_Z\d+(\w+?)I", mangled) or re.match(r"_Z\d+(\w+)", mangled)
    name = m.group(1) if m else mangled
    dtype = next((n for k, n in (("12hip_bfloat16", "bf16"), ("6__half", "fp16"), ("If", "fp32")) if k in mangled), "")
    ints = re.findall(r"Li(\d+)E", mangled)
    return "_".join(filter(None, [name, dtype, *ints]))


# --------------------------------------------------------------------------------------- sycl fp8
def sycl_fp8_rows() -> list[dict]:
    """The SYCL section's rows for its case over an fp8 e4m3fn cache (kernels.cpp with KVM_CACHE=3)."""
    from devtools import sycl_gpu_evidence as gpu_evidence
    return [dict(r, cache="e4m3") for r in gpu_evidence.report_rows(gpu_evidence.FP8_CONFIG)]


# --------------------------------------------------------------------------------------- report
def run_sections(names: list[str], jobs: int) -> dict[str, dict]:
    """{section: {"rows": [...], "seconds": s} or {"absent": reason}} for each requested section."""
    out = {}
    for name in names:
        t0 = time.monotonic()
        func, source = _section_function(name)
        if func is None:
            out[name] = {"absent": source}
            continue
        try:
            rows = func(jobs=jobs) if name == "triton" else func()
            out[name] = {"rows": rows, "source": source, "seconds": round(time.monotonic() - t0, 1)}
        except Exception as exc:            # a broken section is reported, the others still run
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "source": source}
    return out


def _section_function(name: str):
    for ref in (SECTIONS[name], FALLBACKS.get(name)):
        if ref is None:
            continue
        module, func = ref.split(":")
        try:
            mod = sys.modules[__name__] if module == "gpu_report" else importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, func):
            return getattr(mod, func), ref
    return None, f"no {SECTIONS[name]} (the {name} kernels have not published report rows)"


def threshold_failures(report: dict) -> list[str]:
    """The thresholds the tests enforce, as messages (empty: all hold)."""
    rows = report["sections"].get("triton", {}).get("rows", [])
    fails = [f"{r['target']} {r['name']}: {r['problem']}" for r in rows if r.get("problem")]
    fails += [f"{r['target']} {r['name']}: {r['spills']} spills" for r in rows if r.get("spills")]
    fails += [f"{r['target']} {r['name']}: no matrix instruction" for r in rows
              if r["kernel"] == "unified_attention" and not r.get("problem") and not r.get("matrix_instructions")
              and _matrix_dtype_allowed(r)]
    for target, need in (("gfx942", 2), ("sm_90", 2)):
        for r in rows:
            if (r["target"] == target and r["kernel"] == "unified_attention" and r["spec"].startswith("model_decode")
                    and r.get("occupancy", 0) < need):
                fails.append(f"{target} {r['name']}: decode occupancy {r['occupancy']} < {need} per SM/CU")
    for r in rows:
        if (r["target"] == "sm_90" and r["kernel"] == "unified_attention" and r["spec"].startswith("model_decode")
                and (r.get("kv_tiles_in_flight_at_dot") or 0) < 1):
            fails.append(f"sm_90 {r['name']}: no K/V tile in flight at the dots "
                         f"(cp.async.wait_group {r.get('wait_groups')})")
    fails += hip_threshold_failures(report["sections"].get("hip", {}).get("rows", []))
    return fails


def _matrix_dtype_allowed(row: dict) -> bool:
    """fp16/bf16 dots always have a matrix instruction; fp32 'ieee' dots have none on these targets
    (tf32/xf32 would change the numbers), so fp32 specialisations are exempt."""
    return "fp32" not in row["spec"]


def _fmt_widths(w: dict | None) -> str:
    return " ".join(f"{k}B:{v}" for k, v in (w or {}).items()) or "-"


def format_triton(rows: list[dict], full: bool) -> list[str]:
    cols = "target  kernel-spec                                   warps st  regs spill shared  occ  mma(kind)                       loads(width:count)        kv@dot wait_group"
    out = [cols]
    shown = rows if full else [r for r in rows if r["kernel"] == "unified_attention"]
    for r in sorted(shown, key=lambda r: (r["target"], r["name"])):
        if r.get("problem"):
            out.append(f"{r['target']:7} {r['name'][:45]:45} PROBLEM {r['problem'][:100]}")
            continue
        kind = ",".join(k.replace("wgmma.mma_async", "wgmma").replace("v_mfma_f32_", "") for k in r["matrix_kind"])
        spill = f"{r['spills']}" + (f"s{r['sgpr_spills']}" if r.get("sgpr_spills") else "")
        out.append(f"{r['target']:7} {r['name'][:45]:45} {r['num_warps']:5} {r['num_stages']:2} {r['regs']:5} "
                   f"{spill:>5} {r['shared_bytes']:6} {r['occupancy']:4}  {r['matrix_instructions']:3} {kind[:27]:27} "
                   f"{_fmt_widths(r['load_widths'])[:25]:25} {r.get('kv_tiles_in_flight_at_dot', 0):6.1f} "
                   f"{r.get('wait_groups') or '-'}")
    return out


def format_model(model: list[dict]) -> list[str]:
    out = ["device            case     tile(M,N,D,Dv)      split regs shared occ/unit resident in-flight/unit  floor_us  est_us  fraction"]
    for m in model:
        if m.get("problem"):
            out.append(f"{m['device']:17} {m['kind']:8} {m['problem']}")
            continue
        out.append(f"{m['device']:17} {m['case']:8} {str(m['tile']):19} {str(m['split']):5} {m['regs']:4} {m['shared_bytes']:6} "
                   f"{m['occupancy']:8} {m['resident_per_unit']:8} {m['bytes_in_flight_per_unit']:14} "
                   f"{m['floor_us']:9.1f} {m['estimate_us']:7.1f}  {m['fraction_of_floor']:.2f} ({m['kind']} floor)")
    return out


def format_generic(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    keys = list(rows[0])
    return ["  ".join(keys)] + ["  ".join(str(r.get(k)) for k in keys) for r in rows]


def build_report(section_names: list[str], jobs: int = 2) -> dict:
    t0 = time.monotonic()
    sections = run_sections(section_names, jobs)
    report = {"sections": sections}
    if "rows" in sections.get("triton", {}):
        report["paper_model"] = paper_model(sections["triton"]["rows"])
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["triton_version"] = _triton_version()
    report["threshold_failures"] = threshold_failures(report)
    report["devices"] = [asdict(d) for d in DEVICES]
    return report


def _triton_version() -> str | None:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


def print_report(report: dict, full: bool) -> None:
    for name, sec in report["sections"].items():
        print(f"\n== {name} ==")
        if "absent" in sec or "error" in sec:
            print(sec.get("absent") or f"ERROR from {sec['source']}: {sec['error']}")
            continue
        print(f"({len(sec['rows'])} rows from {sec['source']}, {sec['seconds']} s)")
        lines = (format_triton(sec["rows"], full) if name == "triton" else
                 format_hip(sec["rows"], full) if name == "hip" else format_generic(sec["rows"]))
        print("\n".join(lines))
    if "paper_model" in report:
        print("\n== paper model (ESTIMATE; see the module docstring) ==")
        print("\n".join(format_model(report["paper_model"])))
    print(f"\nthresholds: {'all hold' if not report['threshold_failures'] else 'FAILED'}")
    for f in report["threshold_failures"]:
        print("  " + f)
    print(f"total {report['seconds']} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--json", help="also write the whole report as JSON here")
    p.add_argument("--full", action="store_true",
                   help="every Triton kernel (write_kv, reduce too), not only attention; every HIP row")
    p.add_argument("-j", "--jobs", type=int, default=2, help="compile worker processes")
    a = p.parse_args(argv)
    names = [n for n in a.sections.split(",") if n]
    unknown = set(names) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; known: {list(SECTIONS)}")
    report = build_report(names, a.jobs)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    print_report(report, a.full)
    return 0 if not report["threshold_failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
