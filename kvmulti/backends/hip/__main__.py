"""``python -m kvmulti.backends.hip build-rocm [--arch gfx90a ...] [--out DIR] | build-cpu``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .build import build_cpu_library, build_rocm_library


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmulti.backends.hip", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    rocm = sub.add_parser("build-rocm", help="build libkvmulti_hip.so with hipcc (KVMULTI_BUILD_HIP=1 installs)")
    rocm.add_argument("--arch", action="append", help="offload arch (repeatable); default PYTORCH_ROCM_ARCH or "
                                                      "this host's GPUs")
    rocm.add_argument("--out", help="output directory (default: the cache)")
    sub.add_parser("build-cpu", help="build the CPU-harness library")
    args = parser.parse_args(argv)
    if args.cmd == "build-rocm":
        print(build_rocm_library(args.arch, Path(args.out) / "libkvmulti_hip.so" if args.out else None))
    else:
        print(build_cpu_library())
    return 0


if __name__ == "__main__":
    sys.exit(main())
