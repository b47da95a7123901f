#!/usr/bin/env python3
"""Compile check of every kvmulti HIP kernel instantiation for real GPU targets (no GPU needed).

AMD (HIP_PLATFORM=amd, Debian packages ``hipcc libamdhip64-dev rocm-device-libs``):
  1. ``hipcc -Werror -shared`` builds the fat library of launcher.hip (which instantiates every kernel) for
     gfx90a, gfx940 and gfx1030 (Debian's clang 15 rejects gfx942 and has no device libraries for
     gfx1100; ROCm hosts build for their own targets, see kvmulti/backends/hip.py);
  2. a ``--cuda-device-only -Werror -Rpass-analysis=kernel-resource-usage`` pass per arch: fails on any
     register spill or scratch use, on a missing kernel, and on an instantiation for the arch's own
     wave size (64 on gfx9, 32 on gfx10+) that compiled to an empty body.
NVIDIA: ``nvcc -x cu -I hip/compat`` (kvmulti's HIP->CUDA compat headers) for sm_80 and sm_90 with
  ``-Werror all-warnings`` and ptxas ``-warn-spills -warn-lmem-usage -Werror``.

Usage: python hip/compile_check.py [--amd-only | --nvidia-only] [--out DIR]; exit status 0 = all pass.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "launcher.hip"
AMD_ARCHS = ("gfx90a", "gfx940", "gfx1030")
NVIDIA_ARCHS = ("sm_80", "sm_90")
AMD_LIBRARY = "libkvmulti_hip_amd.so"   # the fat library (all AMD_ARCHS), as a ROCm host builds it
DTYPES = ("f", "6__half", "12hip_bfloat16")   # mangled template arguments
HEAD_SIZES = (64, 80, 96, 128, 256)
WAVES = (32, 64)
#: every kernel the launcher instantiates: attention (dtype x head size x wave), reduce and write_kv per dtype
EXPECTED_KERNELS = len(DTYPES) * len(HEAD_SIZES) * len(WAVES) + 2 * len(DTYPES)


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
    rocm = os.environ.get("ROCM_PATH")
    if rocm and (Path(rocm) / "bin" / "hipcc").exists():
        return str(Path(rocm) / "bin" / "hipcc")
    return shutil.which("hipcc")


def nvcc() -> str | None:
    cuda = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda and (Path(cuda) / "bin" / "nvcc").exists():
        return str(Path(cuda) / "bin" / "nvcc")
    return shutil.which("nvcc")


def missing_tools(amd: bool = True, nvidia: bool = True) -> list[str]:
    missing = []
    if amd and hipcc() is None:
        missing.append("hipcc (Debian: apt-get install hipcc libamdhip64-dev rocm-device-libs)")
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


def amd_fat_object(out: Path) -> Result:
    cmd = [hipcc(), "-O3", "-std=c++17", "-fPIC", "-shared", "-Werror", *[f"--offload-arch={a}" for a in AMD_ARCHS],
           str(SOURCE), "-o", str(out / AMD_LIBRARY)]
    rc, log, secs = _run(cmd, _amd_env())
    return Result(f"hipcc -Werror shared library for {', '.join(AMD_ARCHS)}", rc == 0,
                  f"$ {' '.join(cmd)}\n{log}", secs)


def _wave_of(arch: str) -> int:
    return 64 if arch.startswith("gfx9") else 32


def parse_resource_usage(log: str) -> dict[str, dict[str, int]]:
    """{kernel: {field: value}} from -Rpass-analysis=kernel-resource-usage remarks."""
    kernels: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"remark: Function Name: (\S+)", line)
        if m:
            current = kernels.setdefault(m.group(1), {})
            continue
        m = re.search(r"remark:\s+([A-Za-z ]+?)(?: \[bytes/(?:lane|block)\])?: (\d+)", line)
        if m and current is not None:
            current[m.group(1).strip()] = int(m.group(2))
    return kernels


def amd_resource_usage(arch: str) -> Result:
    cmd = [hipcc(), "-O3", "-std=c++17", "-Werror", f"--offload-arch={arch}", "--cuda-device-only", "-c",
           str(SOURCE), "-o", os.devnull, "-Rpass-analysis=kernel-resource-usage"]
    rc, log, secs = _run(cmd, _amd_env())
    name = f"{arch} device pass: -Werror, no spills / scratch"
    if rc != 0:
        return Result(name, False, f"$ {' '.join(cmd)}\n{log}", secs)
    kernels = parse_resource_usage(log)
    problems = []
    if len(kernels) != EXPECTED_KERNELS:
        problems.append(f"expected {EXPECTED_KERNELS} kernels, found {len(kernels)}")
    wave = _wave_of(arch)
    for k, f in sorted(kernels.items()):
        for key in ("SGPRs Spill", "VGPRs Spill", "ScratchSize"):
            if f.get(key, 0) > 0:
                problems.append(f"{k}: {key} = {f[key]}")
        m = re.search(r"paged_attention_kernelI.*?Li(\d+)ELi(\d+)E", k)
        if m and int(m.group(2)) == wave and f.get("VGPRs", 0) == 0:
            problems.append(f"{k}: wave-{wave} instantiation compiled to an empty body on {arch}")
    return Result(name, not problems, "\n".join(problems) + ("\n" + log if problems else ""), secs, len(kernels))


def nvidia_object(arch: str, out: Path) -> Result:
    cmd = [nvcc(), "-x", "cu", "-I", str(HERE / "compat"), "-O3", "-std=c++17", f"-arch={arch}",
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
    """Run the checks whose compilers exist; a missing compiler is a failed result, never a pass."""
    report = Report()
    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvmulti_hip_check_")
        out = Path(tmp.name)
    out.mkdir(parents=True, exist_ok=True)
    for tool in missing_tools(amd, nvidia):
        report.results.append(Result(f"tool available: {tool}", False, f"{tool} not found"))
    tasks = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        if amd and hipcc():
            tasks.append(pool.submit(amd_fat_object, out))
            tasks += [pool.submit(amd_resource_usage, a) for a in AMD_ARCHS]
        if nvidia and nvcc():
            tasks += [pool.submit(nvidia_object, a, out) for a in NVIDIA_ARCHS]
        report.results += [t.result() for t in tasks]
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
    a = p.parse_args(argv)
    report = run(amd=not a.nvidia_only, nvidia=not a.amd_only, out=a.out, jobs=a.jobs)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
