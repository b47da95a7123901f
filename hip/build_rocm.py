#!/usr/bin/env python3
"""Build libkvmulti_hip.so (hip/launcher.hip + kernels) with hipcc for AMD GPU targets.

Standalone (needs neither torch nor kvmulti), so an install-time hook can run it:
    KVMULTI_BUILD_HIP=1 -> python hip/build_rocm.py --out <package>/kvmulti/hip_src/_build
kvmulti.backends.hip uses the same command when it builds on first use, and loads
``<hip_src>/_build/libkvmulti_hip.so`` when present. Targets: --arch (repeatable), else
PYTORCH_ROCM_ARCH (';'/','/space separated), else this host's GPUs (rocm_agent_enumerator / amdgpu-arch).
Writes ``libkvmulti_hip.json`` ({"archs": [...]}) next to the library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared")


def hipcc() -> str | None:
    rocm = os.environ.get("ROCM_PATH") or os.environ.get("ROCM_HOME")
    if rocm and (Path(rocm) / "bin" / "hipcc").exists():
        return str(Path(rocm) / "bin" / "hipcc")
    return shutil.which("hipcc")


def archs_from_env() -> list[str]:
    env = os.environ.get("PYTORCH_ROCM_ARCH", "").replace(",", ";").replace(" ", ";")
    return [a.strip() for a in env.split(";") if a.strip()]


def host_archs() -> list[str]:
    """gfx targets of this host's GPUs, without torch (empty when no tool reports any)."""
    rocm = os.environ.get("ROCM_PATH") or "/opt/rocm"
    for tool in ("rocm_agent_enumerator", "amdgpu-arch"):
        exe = shutil.which(tool) or (str(Path(rocm) / "bin" / tool) if (Path(rocm) / "bin" / tool).exists() else None)
        if not exe:
            continue
        try:
            out = subprocess.run([exe], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        archs = sorted({line.strip().split(":")[0] for line in out.splitlines()
                        if line.strip().startswith("gfx") and line.strip() != "gfx000"})
        if archs:
            return archs
    return []


def command(compiler: str, archs: list[str], out: Path, source: Path = HERE / "launcher.hip") -> list[str]:
    return [compiler, *FLAGS, *[f"--offload-arch={a}" for a in archs], str(source), "-o", str(out)]


def build(archs: list[str], out: Path) -> Path:
    compiler = hipcc()
    if compiler is None:
        raise RuntimeError("hipcc not found (install ROCm's hipcc or set ROCM_PATH)")
    if not archs:
        raise RuntimeError("no target archs: pass --arch, set PYTORCH_ROCM_ARCH, or run on a host with AMD GPUs")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.so")
    res = subprocess.run(command(compiler, archs, tmp), capture_output=True, text=True,
                         env=dict(os.environ, HIP_PLATFORM="amd"))
    if res.returncode != 0:
        raise RuntimeError(f"hipcc failed:\n{' '.join(command(compiler, archs, tmp))}\n{res.stdout}{res.stderr}")
    os.replace(tmp, out)
    out.with_suffix(".json").write_text(json.dumps({"archs": archs}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", action="append", default=[])
    p.add_argument("--out", type=Path, default=HERE / "_build")
    a = p.parse_args(argv)
    archs = a.arch or archs_from_env() or host_archs()
    print(f"kvmulti: building libkvmulti_hip.so with hipcc for {', '.join(archs) or '(none)'} ...", file=sys.stderr)
    try:
        path = build(archs, a.out / "libkvmulti_hip.so")
    except RuntimeError as e:
        print(f"kvmulti: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
