#!/usr/bin/env python
"""Compute-only timing of the native CPU decode kernel, as a fraction of this core's FMA peak.

    OMP_NUM_THREADS=1 python benchmarks/cpu_compute.py [--variants 'a=;b=-DKV_X=0'] [--orders HND,NHD]

The case is bf16 decode (8 query / 2 KV heads, head size 64) of --reqs requests x --seq keys, but
every request's block table points into the same --resident-keys keys, so the K/V blocks stay in
L2 and the time is the kernel's compute (plus a few microseconds of call overhead per call).

The count: per key and KV head, QK^T and P.V over the G = 4 query heads of that KV head need
G x (D + Dv) = 512 fp32 FMAs, i.e. 64 8-lane FMAs; the peak is measured here, by an unrolled loop
of 12 independent vfmadd231ps ymm chains (benchmarks/fma_peak.c, compiled with cc at run time),
in 8-lane FMAs per second per core. "% of FMA peak" = needed 8-lane FMAs / time / (peak x threads).

Variants (name=EXTRA_CFLAGS, ';'-separated) are built side by side (KVMULTI_CPU_EXTRA_CFLAGS) and
their timings alternate in rounds in this one process; each figure is the minimum over all calls
(the 2 cores are shared with other jobs, so the minimum is the least disturbed call).

``--cold`` times benchmarks/attention.py's own case instead (scattered blocks, 1 GiB written before
every call; medians), over a bf16 or, with ``--dtype e4m3|e5m2``, an fp8 cache (bf16 queries).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import kvmulti
from kvmulti.backends.cpu import CPUBackend
from kvmulti.backends.cpu import native as cpu_native
from kvmulti.fp8 import FP8_DTYPES

HQ, HKV, HEAD = 8, 2, 64
CACHE_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fma_peak() -> float | None:
    """8-lane FMAs per second of one core (best of 400 short runs), or None without cc / x86."""
    src = Path(__file__).with_name("fma_peak.c")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "fma_peak"
        try:
            subprocess.run(["cc", "-O2", str(src), "-o", str(exe)], check=True, capture_output=True)
            out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
    return float(out.split()[0]) * 1e9


def build_case(order: str, block_size: int, reqs: int, seq: int, resident_keys: int):
    """A decode batch whose block tables all point into the same `resident_keys` keys."""
    gen = torch.Generator().manual_seed(0)
    nb = max(1, resident_keys // block_size)
    layout = kvmulti.KVCacheLayout(num_blocks=nb, block_size=block_size, num_kv_heads=HKV, head_size=HEAD,
                                   dtype=torch.bfloat16, order=order)
    cache = layout.allocate()
    cache.copy_(torch.randn(layout.shape, generator=gen).to(torch.bfloat16))
    per = -(-seq // block_size)
    table = (torch.arange(reqs * per) % nb).to(torch.int32).view(reqs, per)
    md = kvmulti.CommonAttentionMetadata.from_lens([1] * reqs, [seq] * reqs, table, block_size)
    query = torch.randn(reqs, HQ, HEAD, generator=gen).to(torch.bfloat16)
    out = torch.zeros(reqs, HQ, HEAD, dtype=torch.bfloat16)
    return layout, cache, md, query, out


def build_cold_case(order: str, block_size: int, reqs: int, seq: int, dtype: torch.dtype = torch.bfloat16):
    """The benchmark's own decode case (benchmarks/attention.py): scattered blocks, huge-page cache;
    ``dtype``: the cache's (an fp8 cache gets bf16 queries and scales of 1)."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    import attention
    layout, cache, md, query, _ = attention.build(f"decode {reqs}x{seq}", dtype, block_size, order)
    return layout, cache, md, query, torch.zeros_like(query)


def variant_step(backend, module, md, layout, isa):
    """The backend's per-step metadata, with the native module of one build variant in its plan."""
    step = backend.build_metadata(md, layout, HQ, None)
    plan = dataclasses.replace(step.plan, module=module, isa=cpu_native.ISAS[cpu_native.selected_isa(module, isa)])
    return dataclasses.replace(step, plan=plan)


def load_variant(flags: str):
    os.environ["KVMULTI_CPU_EXTRA_CFLAGS"] = flags
    module, reason = cpu_native._build()
    if module is None:
        raise SystemExit(f"build with {flags!r} failed: {reason}")
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="current=", help="name=EXTRA_CFLAGS;name2=...")
    ap.add_argument("--orders", default="HND,NHD")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reqs", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--resident-keys", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=40, help="timed calls per variant and round")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--dtype", default="bf16", choices=sorted(CACHE_DTYPES),
                    help="the cache's dtype (--cold only; fp8 caches read with bf16 queries)")
    ap.add_argument("--cold", action="store_true",
                    help="the benchmark's real case (scattered blocks), 1 GiB written before every call; "
                         "figures are the median of all calls")
    args = ap.parse_args()
    if args.dtype != "bf16" and not args.cold:
        ap.error("--dtype applies to --cold only (the compute-only case is bf16)")

    variants = {}
    for item in filter(None, (s.strip() for s in args.variants.split(";"))):
        name, _, flags = item.partition("=")
        variants[name] = load_variant(flags)
    backend = CPUBackend(partition_size=-1)
    peak = fma_peak()
    threads = torch.get_num_threads()
    fmas = args.reqs * args.seq * HKV * (HQ // HKV) * (2 * HEAD) / 8     # 8-lane FMAs per call
    print(f"threads {threads}; FMA peak per core: "
          + (f"{peak / 1e9:.2f} G 8-lane FMA/s" if peak else "unknown (no cc)")
          + f"; needed per call: {fmas / 1e6:.2f} M 8-lane FMAs")
    for order in args.orders.split(","):
        scales = {}
        if args.cold:
            layout, cache, md, query, out = build_cold_case(order, args.block_size, args.reqs, args.seq,
                                                            CACHE_DTYPES[args.dtype])
            if CACHE_DTYPES[args.dtype] in FP8_DTYPES:
                scales = dict(k_scale=torch.ones(HKV), v_scale=torch.ones(HKV))
            flush = torch.empty(2**28, dtype=torch.float32)
        else:
            layout, cache, md, query, out = build_case(order, args.block_size, args.reqs, args.seq, args.resident_keys)
        best = {name: float("inf") for name in variants}
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, module in variants.items():
                step = variant_step(backend, module, md, layout, args.isa)
                fn = lambda: backend.paged_attention(query, cache, step, HEAD ** -0.5, None, out, **scales)
                fn()
                for i in range(args.calls):
                    if args.cold:
                        flush.fill_(float(i))
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    best[name] = min(best[name], times[name][-1])
        if args.cold:
            for name, ts in times.items():
                print(f"cold {order} block {args.block_size} {name:>12}: median {statistics.median(ts) * 1e3:.3f} ms, "
                      f"min {min(ts) * 1e3:.3f} ms over {len(ts)} calls")
            continue
        for name, t in best.items():
            key_heads = args.reqs * args.seq * HKV
            pct = f"{100 * fmas / t / (peak * threads):.1f}%" if peak else "n/a"
            cyc = f"{t * threads * (peak / 2) / key_heads:.1f}" if peak else "n/a"   # peak = 2 FMAs per cycle
            print(f"{order} block {args.block_size} {name:>12}: {t * 1e3:.3f} ms  "
                  f"{t * threads * 1e9 / key_heads:.2f} ns per key and KV head per thread  "
                  f"{cyc} cycles  {pct} of FMA peak")


if __name__ == "__main__":
    main()
