"""``python -m kvmulti.backends.sycl [info | build ...]``: the runtime and its devices, or build the
shim and pre-compile kernels into the persistent cache."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ...layout import KVCacheLayout
from .backend import SyclBackend
from .runtime import default_session


def main(argv: list[str] | None = None) -> int:
    """``python -m kvmulti.backends.sycl [info | build [--dtypes fp32,fp16,bf16] [--head-sizes 64,128]]``:
    show the runtime and devices, or build the shim and pre-compile kernels into the persistent cache."""
    ap = argparse.ArgumentParser(prog="python -m kvmulti.backends.sycl", description=main.__doc__)
    ap.add_argument("command", choices=("info", "build"), nargs="?", default="info")
    ap.add_argument("--dtypes", default="fp32,fp16,bf16")
    ap.add_argument("--head-sizes", default="64,128")
    args = ap.parse_args(argv)
    backend = SyclBackend()
    print(f"SYCL backend: {backend.describe()}")
    reasons = backend.unavailable_reasons()
    if reasons:
        print("unavailable: " + "; ".join(reasons))
        return 1
    session = default_session()
    print(f"default device: {session.device.line()}")
    if args.command == "build":
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        for dt in args.dtypes.split(","):
            for hs in args.head_sizes.split(","):
                t0 = time.perf_counter()
                backend.bundle(session, KVCacheLayout(1, 16, 1, int(hs), dtype=names[dt.strip()]))
                print(f"kernels {dt} head_size={hs}: {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
