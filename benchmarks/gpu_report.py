#!/usr/bin/env python3
"""GPU evidence without GPUs: one static report for every shipped kernel, from compiler output.

    python benchmarks/gpu_report.py [--sections triton,hip,sycl] [--json OUT] [--full] [--targets sm_90,gfx942]

``--targets`` (or ``KVMULTI_EVIDENCE_TARGETS``, devtools/evidence_targets.py) limits the Triton and HIP
sections to the named targets; by default each compiles for all of its own.

Sections come from a registry (:data:`SECTIONS`): each is ``name -> "module:function"``, the
function returning ``list[dict]`` rows with at least ``kernel`` and ``target``. A section whose
module is missing (a kernel family that has not published its rows yet) is listed as absent, not
faked. Adding one is one line in :data:`SECTIONS`.

* ``triton``: every Triton specialisation kvmulti launches (``devtools.triton_cross_compile``)
  cross-compiled for sm_80, sm_90, gfx90a, gfx942: registers, spills, shared/LDS bytes, occupancy
  (CTAs per SM / work-groups per CU from registers and shared memory against the target's
  limits), matrix instructions (static count of mma.sync / wgmma / v_mfma), global load widths,
  cp.async.wait_group immediates, K/V tiles in flight at the KV loop's dots (read from TTGIR:
  ``triton_cross_compile.kv_tiles_in_flight_at_dot``), the KV loop's instruction classes per trip; then the
  roofline model below.
* ``hip``: ``devtools.hip_compile_check.report_rows`` when devtools/hip_compile_check.py provides it,
  else rows built here from its resource-usage pass (registers, LDS, waves/SIMD, spills). Every
  kernel x gfx90a / gfx940 / gfx1030 (hipcc) and gfx942 / gfx1100 / gfx1201 (clang-19, no device
  library), fp8 caches (e4m3fn, e5m2) included; printed: the attention kernels
  at head 128 (the decode case's) per query dtype x cache, with the engine (MFMA / FMA); ``--full``:
  every row. Thresholds: ``compile_check.row_problems`` (an fp16 / bf16 query over a 16-bit or an fp8
  cache uses v_mfma on gfx90a / gfx940 / gfx942, no spills or device-library calls, 16-byte hot-loop loads, occupancy, no block-id
  shuffles in the decode kernel's MFMA hot loop). The in-flight column's second figure: the bytes per lane
  the hot loop keeps outstanding at its head (``hip_compile_check.head_in_flight``).
* ``sycl``: ``devtools.sycl_gpu_evidence.report_rows`` once devtools/ provides it (bf16, head 128);
  ``sycl_fp8``: the same case over an fp8 e4m3fn cache (``gpu_evidence.FP8_CONFIG``, rows with
  ``cache``). Triton's fp8 specialisations (e4m3 / e5m2 caches with bf16 / fp16 / fp32 queries:
  ``cross_compile.fp8_specs``) are rows of the ``triton`` section.

Roofline model (ESTIMATES from compile facts and cited figures, not measurements)
---------------------------------------------------------------------------------
``devtools/roofline.py`` is the one model for every family: each section's rows go through its
adapter (:data:`ADAPTERS`: ``devtools/roofline_{triton,hip,sycl}.py``), which turns them into the
launch the backend makes for DECODE (32 sequences x 4096 keys) and PREFILL (8 x 2048-token prompts,
causal), both 32 / 8 heads, head 128, bf16, block 16, on the target's device
(``roofline.TARGETS``: H100 SXM, A100, MI300X, MI250X one GCD, Max 1550, Arc A770). Per kernel x
target x case the report prints the four bounds (memory, issue, latency, grid; microseconds), the
one that limits, and the fraction of the case's floor (decode: the K/V bytes at peak bandwidth x the
cited DRAM efficiency; prefill: the useful causal flops at the dense bf16 matrix peak). Triton's
launches are compiled with a > 2 GiB cache (a serving cache is larger than 2 GiB, and Triton's AMD
backend compiles that case separately, without buffer loads); HIP's MI300X rows are clang-19's gfx942
assembly.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository root: devtools

from devtools import roofline, roofline_hip, roofline_sycl, roofline_triton  # noqa: E402

#: name -> "module:function" returning list[dict] rows (kernel, target, ...). One line per section.
SECTIONS: dict[str, str] = {
    "triton": "gpu_report:triton_rows",
    "hip": "devtools.hip_compile_check:report_rows",
    "sycl": "devtools.sycl_gpu_evidence:report_rows",
    "sycl_fp8": "gpu_report:sycl_fp8_rows",
}
#: used when a section's own module does not provide report_rows yet
FALLBACKS: dict[str, str] = {"hip": "gpu_report:hip_rows_from_resource_usage"}
#: section -> the roofline adapter that turns its rows into launches (``launches(rows, case)``)
ADAPTERS = {"triton": roofline_triton, "hip": roofline_hip, "sycl": roofline_sycl, "sycl_fp8": roofline_sycl}


# --------------------------------------------------------------------------------------- triton
def triton_rows(jobs: int = 2) -> list[dict]:
    """One row per (Triton specialisation, target): the figures of ``cross_compile.analyse``."""
    from devtools import triton_cross_compile as cross_compile
    rows = []
    for target, results in cross_compile.compile_in_subprocesses(jobs=jobs).items():
        for r in results:
            rows.append(dict(r, kernel=r["kernel"], target=target, spec=r["name"].split("-", 1)[1]))
    return rows


def roofline_rows(sections: dict[str, dict]) -> list[dict]:
    """The roofline model (``devtools/roofline.py``) for every shipped attention kernel x target x
    case of the sections that have rows: one :meth:`roofline.Estimate.row` each (with ``section``,
    ``device``, ``bound`` and ``fraction``), or ``problem`` when the model refuses a launch."""
    out = []
    for name, adapter in ADAPTERS.items():
        rows = sections.get(name, {}).get("rows")
        if not rows:
            continue
        for case in (roofline.DECODE, roofline.PREFILL):
            for launch in adapter.launches(rows, case):
                target = roofline.TARGETS[launch.target]
                try:
                    row = roofline.estimate(launch, target).row()
                except ValueError as exc:
                    row = {"kernel": launch.kernel, "target": launch.target, "case": case.name, "problem": str(exc)}
                out.append(dict(row, section=name, device=target.name))
        # HIP's fp32 prefill, judged against the fp32 matrix peak (devtools/roofline_hip.py)
        for e in getattr(adapter, "fp32_prefill_estimates", lambda _rows: [])(rows):
            out.append(dict(e.row(), judged_against="fp32 matrix peak", section=name,
                            device=roofline.TARGETS[e.target].name))
    return out


# --------------------------------------------------------------------------------------- hip (today)
def hip_rows_from_resource_usage() -> list[dict]:
    """HIP rows from devtools/hip_compile_check.py's hipcc resource-usage pass (AMD targets it checks):
    registers, LDS, waves per SIMD, spills. Matrix instructions, load widths and bytes in flight
    are left to devtools/hip_compile_check.report_rows (None here: not measured by this fallback)."""
    from devtools import hip_compile_check as cc
    rows = []
    for arch in cc.amd_archs():
        if cc.amd_compiler(arch) is None:
            raise RuntimeError(f"no compiler for {arch}: " + "; ".join(cc.missing_tools(nvidia=False)))
        cmd = [cc.amd_compiler(arch), *cc.device_flags(arch), "--cuda-device-only", "-c",
               str(cc.SOURCE), "-o", os.devnull, "-Rpass-analysis=kernel-resource-usage"]
        rc, log, _ = cc._run(cmd, cc._amd_env())
        if rc != 0:
            raise RuntimeError(f"{cmd[0]} failed for {arch}:\n{log[-3000:]}")
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
    from devtools import hip_compile_check as cc
    out = ["target  query cache  engine kernel    vgprs sgprs   lds  waves spills mfma  hot-loop valu/mfma/lds/vmem  "
           "in-flight B/lane peak:head  issue cycles/wave mfma:valu:salu"]
    shown = [r for r in rows if r.get("kind") in ("attention", "prefill") and r.get("head_size") == HIP_SHOWN_HEAD_SIZE]
    for r in sorted(shown, key=lambda r: (r["kind"], r["target"], r["dtype"], r.get("cache") or "")):
        mix = r["hot_loop_instructions"]
        cyc = cc.issue_cycles(r)
        out.append(f"{r['target']:7} {r['dtype']:5} {r.get('cache') or r['dtype']:5}  "
                   f"{'MFMA' if r['matrix_instructions'] else 'FMA':6} {r['kind']:9} {r['vgprs']:5} {r['sgprs']:5} "
                   f"{r['lds_bytes']:5} "
                   f"{r['waves_per_simd']:6} {r['spills']:6} {r['matrix_instructions']:4}  "
                   f"{mix.get('valu', 0):>11}/{mix.get('mfma', 0)}/{mix.get('lds', 0)}/{mix.get('vmem', 0):<10} "
                   f"{r['bytes_in_flight_per_lane']:>6}:{r.get('head_bytes_in_flight_per_lane', 0):<13}      "
                   + (f"{cyc['mfma']}:{cyc['valu']}:{cyc['salu']}" if r['matrix_instructions'] else "-"))
    out.append(f"({len(shown)} of {len(rows)} rows: attention (decode / mixed) and prefill at head "
               f"{HIP_SHOWN_HEAD_SIZE}; --full or --json: all)")
    return out


def hip_threshold_failures(rows: list[dict]) -> list[str]:
    """devtools/hip_compile_check.py's CI thresholds over the HIP section's rows, but for its documented open
    problems (``OPEN_PROBLEMS``; the fallback's rows carry too little to check and are skipped)."""
    from devtools import hip_compile_check as cc
    return [p for r in rows if "hot_loop_instructions" in r for p in cc.failing_problems(r)]


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


def format_roofline(rows: list[dict]) -> list[str]:
    out = [f"{'kernel':42} {'target':8} {'case':8} {'memory':>8} {'issue':>8} {'latency':>8} {'grid':>8}  "
           f"{'bound':8} {'fraction':>8}  of"]
    for r in rows:
        if r.get("problem"):
            out.append(f"{r['kernel'][:42]:42} {r['target']:8} {r['case']:8} PROBLEM {r['problem']}")
            continue
        out.append(f"{r['kernel'][:42]:42} {r['target']:8} {r['case']:8} "
                   + " ".join(f"{r[b + '_us']:8.1f}" for b in roofline.BOUNDS)
                   + f"  {r['bound']:8} {r['fraction']:8.3f}  {r['judged_against']}"
                   + (f" (issue: {r['issue_limiter']})" if r["bound"] == "issue" else ""))
    out.append("(microseconds per bound; fraction = floor / the slowest bound; decode floor at peak bandwidth x "
               "the cited DRAM efficiency, prefill at the dense bf16 matrix peak)")
    return out


def format_generic(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    keys = list(rows[0])
    return ["  ".join(keys)] + ["  ".join(str(r.get(k)) for k in keys) for r in rows]


def build_report(section_names: list[str], jobs: int = 2) -> dict:
    t0 = time.monotonic()
    sections = run_sections(section_names, jobs)
    report = {"sections": sections, "roofline": roofline_rows(sections)}
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["triton_version"] = _triton_version()
    report["threshold_failures"] = threshold_failures(report)
    report["targets"] = [asdict(t) for t in roofline.TARGETS.values()]
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
    if report.get("roofline"):
        print("\n== roofline model (ESTIMATES; devtools/roofline.py, see the module docstring) ==")
        print("\n".join(format_roofline(report["roofline"])))
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
    p.add_argument("--targets", help="comma-separated compile targets of the Triton and HIP sections "
                                     "(sets KVMULTI_EVIDENCE_TARGETS; default: every target)")
    a = p.parse_args(argv)
    if a.targets:
        os.environ["KVMULTI_EVIDENCE_TARGETS"] = a.targets
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
