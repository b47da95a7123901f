#!/usr/bin/env python3
"""Compile check of every kvmulti HIP kernel instantiation for real GPU targets (no GPU needed).

AMD (HIP_PLATFORM=amd, Debian packages ``hipcc libamdhip64-dev rocm-device-libs``):
  1. ``hipcc -Werror -shared`` builds the library of launcher.hip (which instantiates every kernel): its host
     code, link and C ABI, with device code for LIBRARY_ARCH (gfx1030);
  2. a ``--cuda-device-only -S -Werror -Rpass-analysis=kernel-resource-usage`` pass per arch -- hipcc for
     gfx90a, gfx940 and gfx1030 (Debian's clang 15 with ROCm 5.2's device libraries), Debian's clang-19 with
     ``-nogpulib -DKVM_NO_DEVICE_LIBS`` for gfx942 (MI300X), gfx1100 (RDNA3) and gfx1201 (RDNA4), which
     those device libraries lack (the kernels take work-item ids, exp2 and tanh from compiler builtins, see
     hip/kvmulti_common.h); ROCm hosts build for their own targets, see kvmulti/backends/hip/build.py --,
     kept in the kvmulti cache by source hash, whose
     remarks and assembly give per kernel: VGPRs, SGPRs, LDS, occupancy (waves/SIMD), spills, v_mfma
     count, global load widths, the decode hot loop's loads (see ``analyze_function``) and the kernel
     descriptor's fp16 denormal mode. It fails on any register spill or scratch use, a call into a device
     library (a symbol the assembly uses and does not define) or any function call left (s_swappc_b64), a
     missing kernel, an
     instantiation for the arch's own wave size (64 on gfx9, 32 on gfx10+) that compiled to an empty
     body, an attention kernel with an fp16 / bf16 query -- over a cache of its own type or of fp8 codes
     -- or a prefill kernel with an fp32 query without v_mfma on gfx90a / gfx940 (the one attention kernel serves prefill, chunked prefill,
     decode and verification), such an fp8-cache kernel whose descriptor does not keep fp16 denormals
     (its widening of e4m3 codes relies on them), a hot loop with a global load narrower than 16 bytes
     (the FMA engine over an fp8 cache: 8, its lanes' pieces) or fewer than 4 such loads in flight per lane, an occupancy below 2 waves/SIMD, and a prefill kernel
     (fp16 / bf16 / fp32 query, gfx90a / gfx940) whose hot loop issues fewer MFMA than VALU cycles over a
     cache of its type (fp32: v_mfma_f32_16x16x4f32 cycles), or more than MAX_FP8_PREFILL_VALU_PER_MFMA (FNUZ: MAX_FNUZ_PREFILL_VALU_PER_MFMA) VALU cycles per MFMA cycle over an fp8 cache, and a
     decode kernel (fp16 / bf16 query, gfx90a / gfx940) whose hot loop shuffles more than the softmax's
     DECODE_SOFTMAX_SHUFFLES values with ds_bpermute (its block ids are scalars). The rows also carry the
     loads the hot loop keeps in flight at its head (``head_in_flight``); ``decode_pipeline_problems``
     judges them (an MFMA decode kernel: a tile in flight there, no vmcnt(0)), one of the thresholds.
  ``report_rows()`` returns these figures as dicts (benchmarks/gpu_report.py); ``--report`` prints them.
NVIDIA: ``nvcc -x cu -I hip/compat`` (kvmulti's HIP->CUDA compat headers) for sm_80 and sm_90 with
  ``-Werror all-warnings`` and ptxas ``-warn-spills -warn-lmem-usage -Werror``.

Usage: python devtools/hip_compile_check.py [--amd-only | --nvidia-only] [--out DIR] [--report];
exit status 0 = all pass.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HIP_DIR = Path(__file__).resolve().parents[1] / "hip"   # the HIP kernel folder
SOURCE = HIP_DIR / "launcher.hip"
HIPCC_ARCHS = ("gfx90a", "gfx940", "gfx1030")    # hipcc (clang 15) with ROCm 5.2's device libraries
CLANG_ARCHS = ("gfx942", "gfx1100", "gfx1201")   # clang-19 -nogpulib: no device library
AMD_ARCHS = HIPCC_ARCHS + CLANG_ARCHS
CLANG = "clang-19"
NVIDIA_ARCHS = ("sm_80", "sm_90")


def amd_archs() -> tuple[str, ...]:
    """The AMD targets checked: :data:`AMD_ARCHS`, or those ``KVMULTI_EVIDENCE_TARGETS`` names."""
    from devtools import evidence_targets
    return evidence_targets.selected(AMD_ARCHS)


def nvidia_archs() -> tuple[str, ...]:
    """The NVIDIA targets checked: :data:`NVIDIA_ARCHS`, or those ``KVMULTI_EVIDENCE_TARGETS`` names."""
    from devtools import evidence_targets
    return evidence_targets.selected(NVIDIA_ARCHS)
AMD_LIBRARY = "libkvmulti_hip_amd.so"   # the checked library (device code for LIBRARY_ARCH)
DTYPES = ("f", "6__half", "12hip_bfloat16")   # mangled template arguments
HEAD_SIZES = (64, 80, 96, 128, 256)
WAVES = (32, 64)
#: cache element types per query dtype: the query's own, fp8 e4m3fn, e5m2, e4m3fnuz and e5m2fnuz (MFMA engine
#: for fp16 / bf16 queries on gfx90a / gfx940 / gfx942, FMA engine otherwise)
CACHES_PER_DTYPE = 5
#: every kernel the launcher instantiates: attention (dtype x cache x head size x wave), prefill, reduce per
#: dtype, write_kv per dtype x cache
#: prefill (launcher.hip's prefill_served): fp16 / bf16, wave64, over a cache of their own type at every
#: head size or over each fp8 format at FP8_PREFILL_HEAD_SIZES; fp32 over fp32 or each fp8 format at
#: FP32_PREFILL_HEAD_SIZES (both: every head size); wave32, every query type over a cache of its own type at
#: WAVE32_PREFILL_HEAD_SIZES (the WMMA engine for fp16 / bf16 on gfx11 / gfx12, the FMA tile engine otherwise)
FP8_PREFILL_HEAD_SIZES = HEAD_SIZES
FP32_PREFILL_HEAD_SIZES = HEAD_SIZES
WAVE32_PREFILL_HEAD_SIZES = (64, 80, 96, 128)
WAVE64_PREFILL_KERNELS = (2 * (len(HEAD_SIZES) + (CACHES_PER_DTYPE - 1) * len(FP8_PREFILL_HEAD_SIZES))
                          + CACHES_PER_DTYPE * len(FP32_PREFILL_HEAD_SIZES))
WAVE32_PREFILL_KERNELS = len(DTYPES) * len(WAVE32_PREFILL_HEAD_SIZES)
PREFILL_KERNELS = WAVE64_PREFILL_KERNELS + WAVE32_PREFILL_KERNELS
EXPECTED_KERNELS = (len(DTYPES) * CACHES_PER_DTYPE * len(HEAD_SIZES) * len(WAVES) + PREFILL_KERNELS + len(DTYPES)
                    + len(DTYPES) * CACHES_PER_DTYPE)
#: report-row kinds of the attention kernels (decode / mixed: paged_attention_kernel; prefill:
#: paged_prefill_kernel); the attention thresholds apply to both
ATTENTION_KINDS = ("attention", "prefill")


@dataclass
class Result:
    name: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0
    kernels: int = 0


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)

    def summary(self) -> str:
        return "\n".join(f"{'PASS' if r.ok else 'FAIL'} {r.name} ({r.seconds:.1f}s"
                         + (f", {r.kernels} kernels" if r.kernels else "") + ")"
                         + (f"\n{r.detail}" if r.detail and not r.ok else "") for r in self.results)


def hipcc() -> str | None:
    """The host's hipcc, looked up once for everyone by the standalone builder hip/build_rocm.py."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("kvmulti_hip_build_rocm", HIP_DIR / "build_rocm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hipcc()


def nvcc() -> str | None:
    cuda = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda and (Path(cuda) / "bin" / "nvcc").exists():
        return str(Path(cuda) / "bin" / "nvcc")
    return shutil.which("nvcc")


def clang() -> str | None:
    """Debian's clang-19 (``apt-get install clang-19``), which compiles HIP for gfx942 / gfx11 / gfx12."""
    return shutil.which(CLANG)


def amd_compiler(arch: str) -> str | None:
    """The compiler of ``arch``'s device pass: clang-19 for :data:`CLANG_ARCHS`, hipcc otherwise."""
    return clang() if arch in CLANG_ARCHS else hipcc()


def device_flags(arch: str) -> list[str]:
    """The flags every device-only compile for ``arch`` takes (HIP language, target, device libraries)."""
    flags = ["-O3", "-std=c++17", f"--offload-arch={arch}"]
    if arch in CLANG_ARCHS:   # hipcc's own defaults: every device function inlined, no calls
        flags = ["-x", "hip", *flags, "-nogpulib", "-DKVM_NO_DEVICE_LIBS",
                 "-mllvm", "-amdgpu-early-inline-all=true", "-mllvm", "-amdgpu-function-calls=false"]
    return flags


def missing_tools(amd: bool = True, nvidia: bool = True) -> list[str]:
    missing = []
    if amd and hipcc() is None:
        missing.append("hipcc (Debian: apt-get install hipcc libamdhip64-dev rocm-device-libs)")
    if amd and clang() is None and any(a in CLANG_ARCHS for a in amd_archs()):
        missing.append(f"{CLANG} (Debian: apt-get install clang-19), for {', '.join(CLANG_ARCHS)}")
    if nvidia and nvcc() is None:
        missing.append("nvcc (CUDA toolkit)")
    return missing


def _run(cmd: list[str], env: dict | None = None) -> tuple[int, str, float]:
    import time
    t = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return res.returncode, res.stdout + res.stderr, time.monotonic() - t


def _amd_env() -> dict:
    return dict(os.environ, HIP_PLATFORM="amd")   # else hipcc picks nvcc when it is on PATH


#: the shared library's device code: one target. Each AMD target's device code is compiled with -Werror by
#: its device pass (the same compile, to assembly); building it into the library a second time would
#: double the check's cost (gfx90a and gfx940 are ~95 % of it) and test nothing the passes do not.
LIBRARY_ARCH = "gfx1030"


def amd_fat_object(out: Path) -> Result:
    """``hipcc -Werror -shared``: the host code, the link and the exported C ABI (device code for LIBRARY_ARCH)."""
    cmd = [hipcc(), "-O3", "-std=c++17", "-fPIC", "-shared", "-Werror", f"--offload-arch={LIBRARY_ARCH}",
           str(SOURCE), "-o", str(out / AMD_LIBRARY)]
    rc, log, secs = _run(cmd, _amd_env())
    return Result(f"hipcc -Werror shared library (host code, link, C ABI; device code for {LIBRARY_ARCH})",
                  rc == 0, f"$ {' '.join(cmd)}\n{log}", secs)


def _wave_of(arch: str) -> int:
    return 64 if arch.startswith("gfx9") else 32


MFMA_ARCHS = ("gfx90a", "gfx940", "gfx942")   # targets whose fp16 / bf16-query attention kernels must use v_mfma
WMMA_ARCHS = ("gfx1100", "gfx1201")   # targets whose fp16 / bf16-query prefill kernels must use v_wmma
_MATRIX_OP = re.compile(r"^\s*v_(?:mfma|wmma)_")   # a matrix instruction: CDNA's v_mfma_*, RDNA3 / RDNA4's v_wmma_*
MIN_WAVES_PER_SIMD = 2
MIN_LOADS_IN_FLIGHT_PER_LANE = 4
#: prefill over an fp8 cache: its hot loop widens each tile's codes once, when they are staged in LDS (4 x 16
#: bytes per thread at heads 64 (128-key tiles), 80, 96 and 128), on top of the 16-bit loop; at most this
#: many VALU issue cycles per MFMA issue cycle (in-loop widening, per wave and fragment, issues about 6.4 on
#: gfx940)
MAX_FP8_PREFILL_VALU_PER_MFMA = 2.5
#: the same for the FNUZ formats, whose once-per-tile widening costs more VALU (about 2.1-2.8 VALU per MFMA
#: cycle on gfx940 / gfx942): each pair also maps 0x80 to NaN, and e5m2fnuz halves e5m2's fp16 bits
MAX_FNUZ_PREFILL_VALU_PER_MFMA = 3.0


def parse_resource_usage(log: str) -> dict[str, dict[str, int]]:
    """{kernel: {field: value}} from -Rpass-analysis=kernel-resource-usage remarks (fields: "SGPRs",
    "VGPRs", "AGPRs", "ScratchSize", "Occupancy", "SGPRs Spill", "VGPRs Spill", "LDS Size")."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"remark: Function Name: (\S+)", line)
        if m:
            current = kernels.setdefault(m.group(1), {})
            continue
        m = re.search(r"remark:\s+([A-Za-z ]+?)(?: \[[^\]]+\])?: (\d+)", line)
        if m and current is not None:
            current[m.group(1).strip()] = int(m.group(2))
    return kernels


# ----------------------------------------------------------------------------------- assembly
#: bytes per lane of each global / buffer load opcode suffix
_LOAD_BYTES = {"ubyte": 1, "sbyte": 1, "ubyte_d16": 1, "ubyte_d16_hi": 1, "sbyte_d16": 1, "sbyte_d16_hi": 1,
               "ushort": 2, "sshort": 2, "short_d16": 2, "short_d16_hi": 2,
               "dword": 4, "dwordx2": 8, "dwordx3": 12, "dwordx4": 16,
               # gfx11 / gfx12 spellings
               "u8": 1, "i8": 1, "d16_u8": 1, "d16_hi_u8": 1, "d16_i8": 1, "d16_hi_i8": 1,
               "u16": 2, "i16": 2, "d16_b16": 2, "d16_hi_b16": 2,
               "b32": 4, "b64": 8, "b96": 12, "b128": 16}
_LOAD_RE = re.compile(r"^\s*(?:global|buffer|flat)_load_(\w+)")
_WAIT_RE = re.compile(r"^\s*s_waitcnt\b(.*)")
_VMCNT_RE = re.compile(r"vmcnt\((\d+)\)")
_LOADCNT_RE = re.compile(r"^\s*s_wait_loadcnt(_dscnt)?\s+(0x[0-9a-fA-F]+|\d+)")   # gfx12


def _vmcnt(line: str) -> int | None:
    """N of a wait for all but the N newest global loads: ``s_waitcnt vmcnt(N)`` (gfx9 - gfx11),
    ``s_wait_loadcnt N`` or ``s_wait_loadcnt_dscnt`` (loadcnt in bits 8-13; gfx12); None for other lines."""
    m = _WAIT_RE.match(line)
    if m:
        v = _VMCNT_RE.search(m.group(1))
        return int(v.group(1)) if v else None
    m = _LOADCNT_RE.match(line)
    if m:
        imm = int(m.group(2), 0)
        return (imm >> 8) & 0x3F if m.group(1) else imm
    return None


_LABEL_RE = re.compile(r"^(\.LBB\w+|; %bb\.\d+):?(.*)$")


def split_functions(asm: str) -> dict[str, list[str]]:
    """{symbol: its instruction lines} for every function in an AMDGPU assembly file."""
    funcs: dict[str, list[str]] = {}
    current = None
    for line in asm.splitlines():
        m = re.match(r"^(_Z\w+):", line)
        if m:
            current = funcs.setdefault(m.group(1), [])
            continue
        if line.startswith(".Lfunc_end"):
            current = None
        elif current is not None:
            current.append(line)
    return funcs


def kernel_descriptors(asm: str) -> dict[str, dict[str, int]]:
    """{kernel: {directive: value}} from the ``.amdhsa_kernel`` blocks of an AMDGPU assembly file (e.g.
    ``"float_denorm_mode_16_64": 3`` for ``.amdhsa_float_denorm_mode_16_64 3``)."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in asm.splitlines():
        m = re.match(r"^\s*\.amdhsa_kernel\s+(\S+)", line)
        if m:
            current = out.setdefault(m.group(1), {})
            continue
        if re.match(r"^\s*\.end_amdhsa_kernel", line):
            current = None
            continue
        m = re.match(r"^\s*\.amdhsa_(\w+)\s+(-?\d+)\s*$", line)
        if m and current is not None:
            current[m.group(1)] = int(m.group(2))
    return out


def _blocks(lines: list[str]) -> list[tuple[str, str, list[str]]]:
    """Basic blocks as (label, loop header it belongs to or "", lines); headers belong to themselves."""
    blocks = [("entry", "", [])]
    for line in lines:
        m = _LABEL_RE.match(line)
        if m:
            label, comment = m.group(1), m.group(2)
            name = label.lstrip(".").replace("; %bb.", "BB")
            header = ""
            if "Loop Header" in comment:
                header = name.replace("LBB", "BB")
            else:
                h = re.search(r"Header=(BB\w+)", comment)
                header = h.group(1) if h else ""
            blocks.append((name.replace("LBB", "BB"), header, []))
            continue
        if line.lstrip().startswith("; =>") and "Inner Loop Header" in line:
            label, _, body = blocks[-1]
            blocks[-1] = (label, label, body)   # a header whose comment wrapped onto the next line
            continue
        blocks[-1][2].append(line)
    return blocks


def _load_width(line: str) -> int | None:
    m = _LOAD_RE.match(line)
    return _LOAD_BYTES.get(m.group(1)) if m else None


def _loop_bodies(lines: list[str]) -> dict[str, list[str]]:
    """{header: lines of its blocks, starting at the header block (rotated loops wrap around)}.
    Blocks carry the innermost loop that holds them, so these are the innermost loops' own blocks."""
    blocks = _blocks(lines)
    loops: dict[str, list[list[str]]] = {}
    order: dict[str, list[str]] = {}
    for label, header, body in blocks:
        if header:
            order.setdefault(header, []).append(label)
            loops.setdefault(header, []).append(body)
    bodies = {}
    for header, labels in order.items():
        start = labels.index(header) if header in labels else 0
        seq = loops[header][start:] + loops[header][:start]
        bodies[header] = [line for body in seq for line in body]
    return bodies


def loop_load_profile(body: list[str]) -> dict:
    """Global loads of one loop body in program order, with s_waitcnt vmcnt(N) retiring all but the N
    newest (vmcnt retires in order): peak bytes outstanding per lane, bytes issued from the body's first
    load up to its first vmcnt(0), and the widths."""
    outstanding: list[int] = []
    peak = 0
    widths: set[int] = set()
    before_drain = 0
    drained = False
    seen_load = False
    for line in body:
        w = _load_width(line)
        if w is not None:
            outstanding.append(w)
            widths.add(w)
            seen_load = True
            if not drained:
                before_drain += w
            peak = max(peak, sum(outstanding))
            continue
        n = _vmcnt(line)
        if n is not None:
            outstanding = outstanding[max(0, len(outstanding) - n):] if n else []
            if n == 0 and seen_load:
                drained = True
    return {"peak_bytes_per_lane": peak, "bytes_before_vmcnt0_per_lane": before_drain,
            "load_widths_bytes": sorted(widths), "loads": sum(1 for l in body if _load_width(l) is not None)}


def serial_share(body: list[str]) -> float:
    """The share of a loop body's instructions (those :func:`instruction_mix` counts) that wait for a
    load of the same iteration: everything from the first ``s_waitcnt vmcnt(N)`` that retires a load
    issued earlier in the same trip (vmcnt retires in order, all but the N newest) to the end of the
    body, in the loop's steady state (the body replayed twice, the second trip counted). 0: each trip
    waits only for loads an earlier trip issued (the next tile is in flight during this tile's work);
    near 1: a wave computes only after its loads have returned."""
    pending: list[bool] = []            # outstanding loads, oldest first: issued in the counted trip?
    counted = blocked = 0
    waiting = False
    for trip in (0, 1):
        for line in body:
            if _load_width(line) is not None:
                pending.append(trip == 1)
            else:
                n = _vmcnt(line)
                if n is not None:
                    keep = max(0, len(pending) - n)
                    retired, pending = (pending[:keep], pending[keep:]) if n else (pending, [])
                    waiting = waiting or (trip == 1 and any(retired))
                    continue
                if not sum(instruction_mix([line]).values()):
                    continue
            if trip == 1:
                counted += 1
                blocked += waiting
    return blocked / counted if counted else 0.0


def head_in_flight(body: list[str]) -> dict:
    """The loads a loop keeps in flight across its back edge, in its steady state (the body replayed
    three times, vmcnt retiring in order all but the N newest): ``head_bytes_per_lane``, the global-load
    bytes per lane still outstanding when a trip begins (what the previous trip issued and nothing has
    waited for yet), and ``min_vmcnt``, the smallest N of the body's ``s_waitcnt vmcnt(N)`` (None: no
    such wait). A loop whose waits all keep N > 0 outstanding never drains the memory pipe at its head."""
    pending: list[int] = []
    head = 0
    waits: list[int] = []
    for trip in range(3):
        if trip == 2:
            head = sum(pending)
        for line in body:
            w = _load_width(line)
            if w is not None:
                pending.append(w)
                continue
            n = _vmcnt(line)
            if n is not None:
                pending = pending[max(0, len(pending) - n):] if n else []
                if trip == 0:
                    waits.append(n)
    return {"head_bytes_per_lane": head, "min_vmcnt": min(waits) if waits else None}


def decode_tile_load_bytes(head: int, elem: int) -> int:
    """Global-load bytes per lane of one tile of the decode kernel's MFMA engine (MfmaGeom in
    hip/kvmulti_attention.hip; 16-byte loads, aligned cache): per 16-key sub-tile ceil(NCH / 4) K chunks,
    and 4 x ceil(NCH / 16) V pieces (16-bit cache) or ceil(16 NCH / 64) V chunks (fp8), NCH = head x elem /
    16; sub-tiles per tile: 1 above head 128, else 2."""
    nch = head * elem // 16
    nsub = 1 if head > 128 else 2
    vin = -(-16 * nch // 64) if elem == 1 else 4 * -(-head // 8 // 16)
    return 16 * nsub * (-(-nch // 4) + vin)


_MFMA_SHAPE = re.compile(r"^\s*v_mfma_\w+?_(\d+)x(\d+)x(\d+)")


def mfma_flops(body: list[str]) -> int:
    """Flops of a loop body's MFMA instructions per wave: 2 x M x N x K of each ``v_mfma_*_MxNxK*``."""
    return sum(2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) for m in map(_MFMA_SHAPE.match, body) if m)


#: the comment an inline asm puts into the loop a kernel spends its time in, over a 16-byte aligned cache:
#: the prefill kernel's unmasked tile loop (its masked edge loops issue as many loads and more VALU), the
#: tile loops of the MFMA and FMA engines (the misaligned-cache variants issue narrower loads)
HOT_LOOP_MARKER = "kvmulti-hot-loop"


def analyze_function(lines: list[str]) -> dict:
    """Static figures of one kernel's assembly: v_mfma + v_wmma count, global load widths (whole kernel), and
    its hot loop = the innermost loop holding HOT_LOOP_MARKER if one does, else the innermost loop issuing
    the most global-load bytes per iteration."""
    widths = sorted({w for w in map(_load_width, lines) if w is not None})
    mfma = sum(1 for l in lines if _MATRIX_OP.match(l))
    hot = None
    for header, body in _loop_bodies(lines).items():
        prof = loop_load_profile(body)
        issued = sum(w for w in map(_load_width, body) if w is not None)
        marked = any(HOT_LOOP_MARKER in l for l in body)
        if issued and (hot is None or (marked, issued) > (hot[3], hot[0])):
            hot = (issued, header, prof, marked)
    row = {"matrix_instructions": mfma, "load_widths_bytes": widths, "hot_loop": None,
           "hot_loop_load_widths_bytes": [], "bytes_in_flight_per_lane": 0, "bytes_before_vmcnt0_per_lane": 0,
           "hot_loop_instructions": {}, "hot_loop_serial_share": None, "hot_loop_mfma_flops": 0,
           "hot_loop_narrow_loads": 0, "hot_loop_loads": 0, "head_bytes_in_flight_per_lane": 0,
           "hot_loop_min_vmcnt": None,
           "hot_loop_ds_bpermute": 0}
    if hot:
        body = _loop_bodies(lines)[hot[1]]
        load_widths = [w for w in map(_load_width, body) if w is not None]
        flight = head_in_flight(body)
        row.update(hot_loop=hot[1], hot_loop_load_widths_bytes=hot[2]["load_widths_bytes"],
                   bytes_in_flight_per_lane=hot[2]["peak_bytes_per_lane"],
                   bytes_before_vmcnt0_per_lane=hot[2]["bytes_before_vmcnt0_per_lane"],
                   hot_loop_instructions=instruction_mix(body),
                   hot_loop_serial_share=round(serial_share(body), 4),
                   hot_loop_mfma_flops=mfma_flops(body),
                   hot_loop_narrow_loads=sum(1 for w in load_widths if w < 16),
                   hot_loop_loads=len(load_widths),
                   head_bytes_in_flight_per_lane=flight["head_bytes_per_lane"], hot_loop_min_vmcnt=flight["min_vmcnt"],
                   hot_loop_ds_bpermute=sum(1 for l in body if re.match(r"^\s*ds_bpermute", l)))
    return row


#: issue cycles of one wave64 instruction on a CDNA SIMD: VALU and SALU through the SIMD's issue slot
#: (once per 4 cycles), v_mfma_f32_16x16x16 (f16 / bf16): 8 passes = 32 cycles on CDNA2, 4 passes x 4 =
#: 16 on CDNA3 (MI250X 383 / MI300X 1307 TFLOP/s dense bf16 at 220 / 304 CUs: 256 / 512 flop/cycle/SIMD)
MFMA_16X16X16_CYCLES = {"gfx90a": 32, "gfx940": 16, "gfx942": 16}
#: v_mfma_f32_16x16x4f32 (fp32 prefill): 32 cycles on CDNA2 and CDNA3 (AMD's matrix instruction calculator,
#: --detail-instruction: "Execution cycles: 32", 256 flops/CU/cycle), i.e. 8 passes
MFMA_16X16X4F32_CYCLES = {"gfx90a": 32, "gfx940": 32, "gfx942": 32}
VALU_CYCLES = 4
SALU_CYCLES = 4


def issue_cycles(row: dict) -> dict[str, int]:
    """Issue cycles per wave of the hot loop's matrix, vector and scalar instructions (``mfma`` from the
    flops at the target's rate of the row's shape: 16x16x16 for 16-bit queries, 16x16x4f32 for fp32)."""
    mix = row.get("hot_loop_instructions") or {}
    fp32 = row.get("dtype") == "fp32"
    per_mfma = (MFMA_16X16X4F32_CYCLES if fp32 else MFMA_16X16X16_CYCLES).get(row.get("target"), 0)
    flops = row.get("hot_loop_mfma_flops") or 0
    return {"mfma": flops * per_mfma // (2 * 16 * 16 * (4 if fp32 else 16)), "valu": mix.get("valu", 0) * VALU_CYCLES,
            "salu": mix.get("salu", 0) * SALU_CYCLES}


def instruction_mix(body: list[str]) -> dict[str, int]:
    """Static instruction counts of a loop body by unit: mfma, valu, salu, lds, vmem (waits and branches
    not counted). Static: both sides of a branch count (an upper bound of what one iteration issues)."""
    mix = {"mfma": 0, "valu": 0, "salu": 0, "lds": 0, "vmem": 0}
    for line in body:
        op = line.strip().split(maxsplit=1)[0] if line.strip() else ""
        if not op or op.startswith((";", ".")) or op.startswith(("s_waitcnt", "s_wait_", "s_cbranch", "s_branch", "s_nop",
                                                                         "s_delay_alu")):
            continue
        unit = ("mfma" if op.startswith(("v_mfma", "v_wmma")) else "valu" if op.startswith("v_") else
                "lds" if op.startswith("ds_") else "vmem" if op.startswith(("global_", "buffer_", "flat_")) else
                "salu" if op.startswith("s_") else None)
        if unit:
            mix[unit] += 1
    return mix


_DT = {"f": "fp32", "6__half": "fp16", "12hip_bfloat16": "bf16"}
# the cache type argument after the query's: the same type ("f" again, or a substitution) or fp8
_CACHE = r"(f|S\d*_|NS_7Fp8E4M3E|NS_7Fp8E5M2E|NS_11Fp8E4M3FnuzE|NS_11Fp8E5M2FnuzE)"
_FP8_NAMES = {"NS_7Fp8E4M3E": "e4m3", "NS_7Fp8E5M2E": "e5m2", "NS_11Fp8E4M3FnuzE": "e4m3fnuz",
              "NS_11Fp8E5M2FnuzE": "e5m2fnuz"}


def _kernel_kind(name: str) -> tuple[str, str | None, int | None, int | None]:
    """(kind, dtype, head size, wave) from a mangled kernel name; kind: attention / reduce / write_kv;
    dtype: the query's (attention, write_kv: the key's) -- see :func:`cache_kind` for the cache's."""
    m = re.search(r"paged_(attention|prefill)_kernelI(f|6__half|12hip_bfloat16)" + _CACHE + r"Li(\d+)ELi(\d+)E", name)
    if m:
        return m.group(1), _DT[m.group(2)], int(m.group(4)), int(m.group(5))
    m = re.search(r"write_kv_kernelI(f|6__half|12hip_bfloat16)" + _CACHE + "E", name)
    if m:
        return "write_kv", _DT[m.group(1)], None, None
    m = re.search(r"paged_attention_reduce_kernelI(f|6__half|12hip_bfloat16)E", name)
    if m:
        return "reduce", _DT[m.group(1)], None, None
    return "other", None, None, None


def cache_kind(name: str) -> str | None:
    """"e4m3" / "e5m2" / "e4m3fnuz" / "e5m2fnuz" for an fp8-cache instantiation, None when the cache has the query's type."""
    m = re.search(r"(?:paged_attention_kernel|paged_prefill_kernel|write_kv_kernel)I(?:f|6__half|12hip_bfloat16)"
                  + _CACHE, name)
    return _FP8_NAMES.get(m.group(1)) if m else None


def short_name(name: str) -> str:
    kind, dtype, hs, wave = _kernel_kind(name)
    cache = cache_kind(name)
    dtype = f"{dtype},{cache}" if cache else dtype
    if kind in ATTENTION_KINDS:
        return f"paged_{kind}<{dtype},{hs},wave{wave}>"
    return f"{kind}<{dtype}>" if dtype else name


@dataclass
class DevicePass:
    arch: str
    ok: bool
    log: str
    seconds: float
    resources: dict[str, dict[str, int]] = field(default_factory=dict)
    asm: dict[str, dict] = field(default_factory=dict)
    descriptors: dict[str, dict[str, int]] = field(default_factory=dict)
    library_calls: list[str] = field(default_factory=list)   # symbols the assembly uses but does not define
    function_calls: int = 0                                   # s_swappc_b64: calls left after inlining
    cached: bool = False            # the compile's output was kept from an earlier run (see amd_device_pass)


def amd_device_pass(arch: str, out: Path) -> DevicePass:
    """One device-only compile for ``arch``: resource-usage remarks + assembly (analysed). A compile that
    succeeded is kept in ``<kvmulti cache>/hip_check/`` under the hash of every HIP source, the command
    and the compiler's version (``--version``), so the suite's several readers of one source compile it once."""
    asm_path = out / f"kvmulti_hip_{arch}.s"
    flags = [*device_flags(arch), "-Werror", "-Wno-unused-command-line-argument",
             "--cuda-device-only", "-S", "-Rpass-analysis=kernel-resource-usage"]
    cmd = [amd_compiler(arch), *flags[:-1], str(SOURCE), "-o", str(asm_path), flags[-1]]
    cached = _device_pass_cache(flags, arch)
    if cached.exists():
        kept = json.loads(gzip.decompress(cached.read_bytes()))
        log, text, secs = kept["log"], kept["asm"], kept["seconds"]
        dp = DevicePass(arch, True, f"$ {' '.join(cmd)}\n(kept from {cached})\n{log}", secs, cached=True)
    else:
        rc, log, secs = _run(cmd, _amd_env())
        dp = DevicePass(arch, rc == 0, f"$ {' '.join(cmd)}\n{log}", secs)
        if rc != 0:
            return dp
        text = asm_path.read_text()
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(gzip.compress(json.dumps({"log": log, "asm": text, "seconds": secs}).encode()))
        os.replace(tmp, cached)
    dp.resources = parse_resource_usage(log)
    dp.asm = {name: analyze_function(lines) for name, lines in split_functions(text).items()}
    dp.descriptors = kernel_descriptors(text)
    dp.library_calls = device_library_calls(text)
    dp.function_calls = len(re.findall(r"^\s*s_swappc_b64\b", text, re.M))
    return dp


def device_library_calls(asm: str) -> list[str]:
    """The symbols an assembly refers to (``sym@rel32@lo`` / ``@gotpcrel32``) without defining them, sorted:
    what it would take from a device library (``__ockl_*``, ``__ocml_*``, ``__atomic_work_item_fence``, ...)."""
    used = set(re.findall(r"\b([A-Za-z_.$][\w.$]*)@(?:rel32|gotpcrel32|abs32)@(?:lo|hi)", asm))
    defined = set(re.findall(r"^([A-Za-z_.$][\w.$]*):", asm, re.M))
    return sorted(used - defined)


def _compiler_version(arch: str = "gfx90a") -> str:
    return subprocess.run([amd_compiler(arch), "--version"], capture_output=True, text=True, env=_amd_env()).stdout


def _device_pass_cache(flags: list[str], arch: str = "gfx90a") -> Path:
    from kvmulti import native_build
    sources = [SOURCE, *sorted(p for p in HIP_DIR.rglob("*") if p.is_file() and p.suffix in (".hip", ".h"))]
    key = native_build.build_key(sources, [_compiler_version(arch), *flags])
    return native_build.cache_root() / "hip_check" / f"{key}.json.gz"


LDS_PER_CU = 64 * 1024                 # gfx90a / gfx94x; gfx10 / 11 / 12 in CU mode
SIMDS_PER_CU = {"gfx90a": 4, "gfx940": 4, "gfx942": 4, "gfx1030": 2, "gfx1100": 2, "gfx1201": 2}
ATTENTION_WAVES_PER_BLOCK = 4          # kNumWarps


def effective_occupancy(arch: str, register_waves: int, lds_bytes: int, waves_per_block: int) -> int:
    """Waves per SIMD: the compiler's register-limited figure, further limited by the LDS the blocks
    need (blocks per CU = 64 KiB // LDS per block)."""
    if lds_bytes <= 0:
        return register_waves
    simds = SIMDS_PER_CU.get(arch, 4)
    return min(register_waves, (LDS_PER_CU // lds_bytes) * waves_per_block // simds)


def rows_of(dp: DevicePass) -> list[dict]:
    """One report row per kernel instantiation that runs on dp.arch (wave-mismatched ones are empty)."""
    rows = []
    wave = _wave_of(dp.arch)
    for name, f in sorted(dp.resources.items()):
        kind, dtype, hs, kwave = _kernel_kind(name)
        if kind in ATTENTION_KINDS and kwave != wave:
            continue
        a = dp.asm.get(name, analyze_function([]))
        rows.append({
            "kernel": short_name(name), "symbol": name, "kind": kind, "dtype": dtype, "cache": cache_kind(name),
            "head_size": hs,
            "target": dp.arch, "wave": wave,
            "vgprs": f.get("VGPRs", 0), "agprs": f.get("AGPRs", 0), "sgprs": f.get("SGPRs", 0),
            "lds_bytes": f.get("LDS Size", 0),
            "waves_per_simd": effective_occupancy(dp.arch, f.get("Occupancy", 0), f.get("LDS Size", 0),
                                                  ATTENTION_WAVES_PER_BLOCK),
            "waves_per_simd_registers": f.get("Occupancy", 0),
            "spills": f.get("VGPRs Spill", 0) + f.get("SGPRs Spill", 0), "scratch_bytes": f.get("ScratchSize", 0),
            "matrix_instructions": a["matrix_instructions"], "load_widths_bytes": a["load_widths_bytes"],
            "hot_loop_load_widths_bytes": a["hot_loop_load_widths_bytes"],
            "bytes_in_flight_per_lane": a["bytes_in_flight_per_lane"],
            "bytes_before_vmcnt0_per_lane": a["bytes_before_vmcnt0_per_lane"],
            "hot_loop_instructions": a["hot_loop_instructions"],
            "hot_loop_serial_share": a["hot_loop_serial_share"],
            "hot_loop_mfma_flops": a["hot_loop_mfma_flops"],
            "hot_loop_narrow_loads": a.get("hot_loop_narrow_loads", 0), "hot_loop_loads": a.get("hot_loop_loads", 0),
            "head_bytes_in_flight_per_lane": a.get("head_bytes_in_flight_per_lane", 0),
            "hot_loop_min_vmcnt": a.get("hot_loop_min_vmcnt"),
            "hot_loop_ds_bpermute": a.get("hot_loop_ds_bpermute", 0),
            # 3: fp16 (and fp64) denormals kept on input and output (the hardware default mode)
            "fp16_denorm_mode": dp.descriptors.get(name, {}).get("float_denorm_mode_16_64"),
        })
    return rows


#: ds_bpermute per decode tile that the online softmax needs: the row max over the 4 lane groups (2
#: butterflies) and the 4 rows' rescale factors broadcast to the accumulator lanes; block ids (block size a
#: multiple of 16, aligned cache: the hot loop) are wave-uniform scalars (v_readlane_b32), not shuffles
DECODE_SOFTMAX_SHUFFLES = 6


def _mfma_decode(row: dict) -> bool:
    return (row["kind"] == "attention" and row["target"] in MFMA_ARCHS and row["dtype"] in ("fp16", "bf16")
            and bool(row["matrix_instructions"]))


def decode_pipeline_problems(row: dict) -> list[str]:
    """The decode pipelining criterion (one of :func:`row_problems`): an MFMA decode
    kernel's hot loop has no ``s_waitcnt vmcnt(0)`` and keeps at least one tile's loads
    (:func:`decode_tile_load_bytes`) in flight at its head (:func:`head_in_flight`)."""
    if not _mfma_decode(row):
        return []
    tile = decode_tile_load_bytes(row["head_size"], 1 if row.get("cache") else 2)
    if row.get("hot_loop_min_vmcnt") == 0 or row.get("head_bytes_in_flight_per_lane", 0) < tile:
        return [f"{row['target']} {row['kernel']}: decode hot loop keeps {row.get('head_bytes_in_flight_per_lane', 0)} "
                f"bytes per lane in flight at its head (one tile: {tile}), smallest vmcnt "
                f"{row.get('hot_loop_min_vmcnt')} (want > 0)"]
    return []


def hot_loop_load_bytes(row: dict) -> int:
    """The global-load width (bytes per lane) an attention kernel's tile loop must use: 16, except the FMA
    engine over an fp8 cache, whose lanes read one 8-byte piece (8 codes: the lane's 8 head dims) of a row."""
    return 8 if row.get("cache") and not row["matrix_instructions"] else 16


def prefill_table_loads_only(row: dict) -> bool:
    """Whether a prefill hot loop's 4-byte loads are the next tile's block-table entries only: one per lane
    beside each copy of the tile's loads, at least 4 of them (the FMA tile engine has two copies, one on the path
    of a wave that skips the tile's arithmetic)."""
    narrow = row.get("hot_loop_narrow_loads", 0)
    return 1 <= narrow and 4 * narrow <= row.get("hot_loop_loads", 0) - narrow


def row_problems(row: dict) -> list[str]:
    """The CI thresholds for one report row (empty: passes)."""
    k = f"{row['target']} {row['kernel']}"
    problems = []
    if row["spills"] or row["scratch_bytes"]:
        problems.append(f"{k}: {row['spills']} spilled registers, {row['scratch_bytes']} scratch bytes/lane")
    if row["waves_per_simd"] < MIN_WAVES_PER_SIMD:
        problems.append(f"{k}: occupancy {row['waves_per_simd']} < {MIN_WAVES_PER_SIMD} waves/SIMD")
    if row["kind"] in ATTENTION_KINDS:
        if row["vgprs"] == 0:
            problems.append(f"{k}: wave-{row['wave']} instantiation compiled to an empty body")
        mfma_dtypes = ("fp16", "bf16", "fp32") if row["kind"] == "prefill" else ("fp16", "bf16")
        if row["target"] in MFMA_ARCHS and row["dtype"] in mfma_dtypes and row["matrix_instructions"] == 0:
            cache = f"{row['cache']} cache" if row.get("cache") else "16-bit cache"
            problems.append(f"{k}: {row['dtype']} query over a {cache}: attention tiles without v_mfma")
        if (row["kind"] == "prefill" and row["target"] in WMMA_ARCHS and row["dtype"] in ("fp16", "bf16")
                and row["matrix_instructions"] == 0):
            cache = f"{row['cache']} cache" if row.get("cache") else "16-bit cache"
            problems.append(f"{k}: {row['dtype']} query over a {cache}: prefill tiles without v_wmma")
        if row.get("cache") and row["matrix_instructions"] and row.get("fp16_denorm_mode") != 3:
            problems.append(f"{k}: fp8 codes widened through fp16 with fp16 denormals not kept "
                            f"(.amdhsa_float_denorm_mode_16_64 {row.get('fp16_denorm_mode')}, want 3)")
        want = hot_loop_load_bytes(row)
        narrow = [w for w in row["hot_loop_load_widths_bytes"] if w < want]
        if row["kind"] == "prefill" and narrow == [4] and prefill_table_loads_only(row):
            narrow = []
        if narrow or not row["hot_loop_load_widths_bytes"]:
            problems.append(f"{k}: hot-loop global loads of {row['hot_loop_load_widths_bytes']} bytes (want {want} only)")
        if (row["kind"] == "prefill" and row["target"] in MFMA_ARCHS and row["dtype"] in ("fp16", "bf16", "fp32")
                and not row.get("cache")):
            cyc = issue_cycles(row)
            if cyc["mfma"] < cyc["valu"]:
                problems.append(f"{k}: hot loop issues {cyc['mfma']} MFMA cycles < {cyc['valu']} VALU cycles per wave")
        if (row["kind"] == "prefill" and row["target"] in MFMA_ARCHS and row["dtype"] in ("fp16", "bf16", "fp32")
                and row.get("cache")):
            cyc = issue_cycles(row)
            limit = MAX_FNUZ_PREFILL_VALU_PER_MFMA if row["cache"].endswith("fnuz") else MAX_FP8_PREFILL_VALU_PER_MFMA
            if cyc["valu"] > limit * cyc["mfma"]:
                problems.append(f"{k}: hot loop issues {cyc['valu']} VALU cycles > {limit} x "
                                f"{cyc['mfma']} MFMA cycles per wave (fp8 codes not widened once per tile?)")
        if _mfma_decode(row) and row.get("hot_loop_ds_bpermute", 0) > DECODE_SOFTMAX_SHUFFLES:
            problems.append(f"{k}: decode hot loop issues {row['hot_loop_ds_bpermute']} ds_bpermute (> the softmax's "
                            f"{DECODE_SOFTMAX_SHUFFLES}: block ids shuffled?)")
        problems += decode_pipeline_problems(row)
        if row["bytes_in_flight_per_lane"] < MIN_LOADS_IN_FLIGHT_PER_LANE * want:
            problems.append(f"{k}: {row['bytes_in_flight_per_lane']} bytes in flight per lane in the hot loop "
                            f"(< {MIN_LOADS_IN_FLIGHT_PER_LANE} x {want}-byte loads)")
    return problems


#: what a row problem is (:func:`problem_kind`), from the message :func:`row_problems` writes
_PROBLEM_KINDS = (("spills", "spilled registers"), ("occupancy", "occupancy"), ("empty", "empty body"),
                  ("no_mfma", "without v_mfma"), ("no_wmma", "without v_wmma"), ("denorm", "denormals"), ("narrow_loads", "hot-loop global loads"),
                  ("mfma_share", "MFMA cycles <"), ("fp8_widening", "VALU cycles >"), ("shuffles", "ds_bpermute"),
                  ("pipeline", "decode hot loop keeps"), ("in_flight", "bytes in flight per lane"))

#: Thresholds the clang-19 targets do not meet yet: (arch, problem kind, kernel kind) -> why. hip/README.md
#: lists them. The device pass reports them as open, not as passes, and fails on every other problem -- and
#: on an entry here that no kernel has any longer (the gap closed: remove it here and from the README).
#: A 4-tuple (arch, problem kind, kernel kind, "fp8 FMA") lists a problem of the FMA engine's kernels over an
#: fp8 cache only (a cache set, no matrix instructions).
OPEN_PROBLEMS: dict[tuple[str, ...], str] = {}


def problem_kind(message: str) -> str:
    """The kind of a :func:`row_problems` message (``spills``, ``narrow_loads``, ...; ``other`` if unknown)."""
    return next((kind for kind, text in _PROBLEM_KINDS if text in message), "other")


def _open_key(row: dict, message: str) -> tuple[str, ...] | None:
    """The :data:`OPEN_PROBLEMS` entry listing the problem ``message`` of ``row`` (None: not listed)."""
    key = (row["target"], problem_kind(message), row["kind"])
    fp8_fma = bool(row.get("cache")) and not row.get("matrix_instructions")
    return next((k for k in (key, (*key, "fp8 FMA") if fp8_fma else None) if k in OPEN_PROBLEMS), None)


def open_problems(row: dict) -> list[str]:
    """The row's problems that :data:`OPEN_PROBLEMS` lists for its target and kernel kind."""
    return [m for m in row_problems(row) if _open_key(row, m)]


def failing_problems(row: dict) -> list[str]:
    """The row's problems that :data:`OPEN_PROBLEMS` does not list: the CI thresholds it fails."""
    return [m for m in row_problems(row) if not _open_key(row, m)]


def split_open(arch: str, rows: list[dict]) -> tuple[list[str], list[str]]:
    """(failures, open problems) of one target's rows against :data:`OPEN_PROBLEMS`; an open entry of
    ``arch`` that no row shows any longer is a failure."""
    failures, opened = [], []
    for row in rows:
        failures += failing_problems(row)
        opened += open_problems(row)
    seen = {_open_key(row, m) for row in rows for m in open_problems(row)}
    for key in OPEN_PROBLEMS:
        if key[0] == arch and key not in seen:
            failures.append(f"{arch}: open problem {key[1:]} no longer occurs: remove it from OPEN_PROBLEMS "
                            "and hip/README.md")
    return failures, opened


def amd_resource_usage(arch: str, out: Path | None = None, device_pass: DevicePass | None = None) -> Result:
    tmp = None
    if device_pass is None:
        if out is None:
            tmp = tempfile.TemporaryDirectory(prefix="kvmulti_hip_check_")
            out = Path(tmp.name)
        device_pass = amd_device_pass(arch, out)
    dp = device_pass
    name = (f"{arch} device pass: -Werror, no spills / scratch / device-library calls, MFMA (16-bit and fp8 caches), 16-byte hot loop, "
            "occupancy" + (" (compile kept from an earlier run)" if dp.cached else ""))
    if not dp.ok:
        return Result(name, False, dp.log, dp.seconds)
    problems = []
    if dp.library_calls:
        problems.append(f"calls into a device library: {', '.join(dp.library_calls)}")
    if dp.function_calls:
        problems.append(f"{dp.function_calls} function calls (s_swappc_b64) left: every device function must inline")
    if len(dp.resources) != EXPECTED_KERNELS:
        problems.append(f"expected {EXPECTED_KERNELS} kernels, found {len(dp.resources)}")
    failures, opened = split_open(arch, rows_of(dp))
    problems += failures
    if opened:
        name += f" ({len(opened)} open problems of OPEN_PROBLEMS)"
    if tmp is not None:
        tmp.cleanup()
    return Result(name, not problems, "\n".join(problems + [f"open: {m}" for m in opened]), dp.seconds,
                  len(dp.resources))


_REPORT_CACHE: dict[tuple[str, ...], list[dict]] = {}


def report_rows(archs: tuple[str, ...] | None = None, jobs: int = 2) -> list[dict]:
    """Static figures per kernel x AMD target (needs hipcc; compiles once per process): one dict per
    kernel instantiation that runs on the target, with keys kernel, target, vgprs, sgprs, lds_bytes,
    waves_per_simd (register- and LDS-limited; waves_per_simd_registers: the compiler's figure), spills, matrix_instructions (v_mfma count), load_widths_bytes (all global loads),
    bytes_in_flight_per_lane (peak global-load bytes outstanding per lane in the hot loop, simulating
    s_waitcnt vmcnt), plus symbol, kind, dtype, cache (None, or "e4m3" / "e5m2" / "e4m3fnuz" / "e5m2fnuz" for an fp8 cache),
    head_size, wave, agprs, scratch_bytes, hot_loop_load_widths_bytes, bytes_before_vmcnt0_per_lane (bytes
    issued in the hot loop from its first load up to its first s_waitcnt vmcnt(0); x wave size = per
    wave), hot_loop_instructions, hot_loop_serial_share (see :func:`serial_share`), hot_loop_mfma_flops (per
    wave and iteration, :func:`mfma_flops`) and fp16_denorm_mode (the descriptor's; 3 = denormals kept). Raises
    RuntimeError when a compile fails or hipcc is missing. ``archs`` defaults to :func:`amd_archs`."""
    key = amd_archs() if archs is None else tuple(archs)
    if key not in _REPORT_CACHE:
        missing = [a for a in key if amd_compiler(a) is None]
        if missing:
            raise RuntimeError(f"no compiler for {', '.join(missing)}: " + "; ".join(missing_tools(nvidia=False)))
        with tempfile.TemporaryDirectory(prefix="kvmulti_hip_report_") as tmp:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                passes = list(pool.map(lambda a: amd_device_pass(a, Path(tmp)), key))
        failed = [dp for dp in passes if not dp.ok]
        if failed:
            raise RuntimeError("\n".join(dp.log for dp in failed))
        _REPORT_CACHE[key] = [row for dp in passes for row in rows_of(dp)]
    return [dict(r) for r in _REPORT_CACHE[key]]


def format_report(rows: list[dict]) -> str:
    cols = ("target", "kernel", "vgprs", "agprs", "sgprs", "lds_bytes", "waves_per_simd", "spills",
            "matrix_instructions", "load_widths_bytes", "hot_loop_load_widths_bytes", "bytes_in_flight_per_lane",
            "bytes_before_vmcnt0_per_lane")
    lines = [" | ".join(cols)]
    for r in rows:
        lines.append(" | ".join(str(r[c]) for c in cols))
    return "\n".join(lines)


def nvidia_object(arch: str, out: Path) -> Result:
    cmd = [nvcc(), "-x", "cu", "-I", str(HIP_DIR / "compat"), "-O3", "-std=c++17", f"-arch={arch}",
           "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Werror,-fPIC",
           "-Xptxas", "-v,-warn-spills,-warn-lmem-usage,-Werror",
           "-c", str(SOURCE), "-o", str(out / f"kvmulti_hip_{arch}.o")]
    rc, log, secs = _run(cmd)
    spills = [l for l in log.splitlines() if re.search(r"[1-9]\d* bytes spill (stores|loads)", l)]
    entries = len(re.findall(r"Compiling entry function", log))
    ok = rc == 0 and not spills and entries == EXPECTED_KERNELS
    detail = f"$ {' '.join(cmd)}\n" + (f"expected {EXPECTED_KERNELS} entry functions, found {entries}\n"
                                       if entries != EXPECTED_KERNELS else "") + "\n".join(spills) + "\n" + log
    return Result(f"nvcc -x cu via hip/compat for {arch}", ok, detail, secs, entries)


def run(amd: bool = True, nvidia: bool = True, out: Path | None = None, jobs: int = 2) -> Report:
    """Run the checks whose compilers exist; a missing compiler is a failed result, never a pass.
    The AMD device passes' figures are kept for report_rows()."""
    report = Report()
    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvmulti_hip_check_")
        out = Path(tmp.name)
    out.mkdir(parents=True, exist_ok=True)
    for tool in missing_tools(amd, nvidia):
        report.results.append(Result(f"tool available: {tool}", False, f"{tool} not found"))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        fat = pool.submit(amd_fat_object, out) if amd and hipcc() else None
        passes = [pool.submit(amd_device_pass, a, out) for a in amd_archs() if amd and amd_compiler(a)]
        nv = [pool.submit(nvidia_object, a, out) for a in nvidia_archs()] if nvidia and nvcc() else []
        if fat is not None:
            report.results.append(fat.result())
        device_passes = [f.result() for f in passes]
        report.results += [amd_resource_usage(dp.arch, device_pass=dp) for dp in device_passes]
        report.results += [f.result() for f in nv]
    if device_passes and all(dp.ok for dp in device_passes):
        _REPORT_CACHE[amd_archs()] = [row for dp in device_passes for row in rows_of(dp)]
    if tmp is not None:
        tmp.cleanup()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--amd-only", action="store_true")
    g.add_argument("--nvidia-only", action="store_true")
    p.add_argument("--out", type=Path, help="keep the objects here")
    p.add_argument("-j", "--jobs", type=int, default=2)
    p.add_argument("--report", action="store_true", help="also print the per-kernel static figures")
    a = p.parse_args(argv)
    report = run(amd=not a.nvidia_only, nvidia=not a.amd_only, out=a.out, jobs=a.jobs)
    print(report.summary())
    if a.report and not a.nvidia_only and amd_archs() in _REPORT_CACHE:
        print(format_report(_REPORT_CACHE[amd_archs()]))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HIP_DIR.parent))   # the repository root: devtools as a package
    sys.exit(main())
