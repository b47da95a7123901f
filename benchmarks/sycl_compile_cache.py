"""Time the SYCL backend's run-time kernel compile: a cold compile vs persistent-cache hits.

Each run is a fresh Python process (so nothing is cached in memory) sharing one SYCL persistent
cache directory (SYCL_CACHE_PERSISTENT=1, SYCL_CACHE_DIR=<fresh temp dir>):

    python benchmarks/sycl_compile_cache.py [--dtype bf16] [--head-size 64] [--runs 3] [--keep DIR]

Columns: runtime = loading the shim + runtime and listing devices; build = compiling (or loading)
the kernel bundle for one (dtype, head size); first call = write_kv + paged_attention on a small
batch right after (includes any remaining lazy JIT work).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def child(dtype_name: str, head_size: int) -> None:
    t0 = time.perf_counter()
    import torch

    import kvmulti
    from kvmulti.backends import sycl
    t_import = time.perf_counter() - t0

    t0 = time.perf_counter()
    reasons = sycl.runtime_reasons()
    if reasons:
        raise SystemExit("SYCL unavailable: " + "; ".join(reasons))
    session = sycl.default_session()
    t_runtime = time.perf_counter() - t0

    dtype = getattr(torch, DTYPES[dtype_name])
    layout = kvmulti.KVCacheLayout(num_blocks=8, block_size=16, num_kv_heads=2, head_size=head_size, dtype=dtype)
    t0 = time.perf_counter()
    kvmulti.backends.get_backend("SYCL").bundle(session, layout)
    t_build = time.perf_counter() - t0

    cache = layout.allocate("cpu", allocator=sycl.usm_allocator)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    md = kvmulti.CommonAttentionMetadata.from_lens([5, 1], [5, 40], table, 16)
    q = torch.randn(6, 4, head_size).to(dtype)
    k = torch.randn(6, 2, head_size).to(dtype)
    t0 = time.perf_counter()
    kvmulti.write_kv(k, k, cache, layout, md.slot_mapping, backend="SYCL")
    kvmulti.paged_attention(q, cache, layout, md, backend="SYCL")
    t_call = time.perf_counter() - t0
    print(json.dumps({"import": t_import, "runtime": t_runtime, "build": t_build, "call": t_call,
                      "device": session.device.name}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="processes after the cold one")
    ap.add_argument("--keep", help="use (and keep) this cache directory instead of a fresh temp dir")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.dtype, args.head_size)
        return

    cache_dir = args.keep or tempfile.mkdtemp(prefix="kvmulti-sycl-cache-")
    env = dict(os.environ, SYCL_CACHE_PERSISTENT="1", SYCL_CACHE_DIR=cache_dir)
    rows = []
    try:
        for i in range(1 + args.runs):
            res = subprocess.run([sys.executable, __file__, "--child", "--dtype", args.dtype,
                                  "--head-size", str(args.head_size)], capture_output=True, text=True, env=env)
            if res.returncode != 0:
                raise SystemExit(f"run {i} failed:\n{res.stdout}{res.stderr}")
            r = json.loads(res.stdout.strip().splitlines()[-1])
            r["label"] = "cold (empty cache)" if i == 0 and not args.keep else f"cache run {i}"
            rows.append(r)
    finally:
        if not args.keep:
            shutil.rmtree(cache_dir, ignore_errors=True)

    print(f"SYCL kernel compile, {args.dtype} head_size={args.head_size} on {rows[0]['device']}")
    print(f"persistent cache: {cache_dir}{'' if args.keep else ' (removed)'}")
    print(f"{'run':<22}{'runtime s':>11}{'build s':>10}{'first call s':>14}")
    for r in rows:
        print(f"{r['label']:<22}{r['runtime']:>11.2f}{r['build']:>10.2f}{r['call']:>14.3f}")
    cold, best = rows[0]["build"], min(r["build"] for r in rows[1:]) if len(rows) > 1 else float("nan")
    print(f"cold build / best cached build: {cold / best:.1f}x")


if __name__ == "__main__":
    main()
