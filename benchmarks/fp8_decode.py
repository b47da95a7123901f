#!/usr/bin/env python
"""CPU decode with an fp8 KV cache vs bf16: the native kernel's cold time ratio, measured alternately.

    python benchmarks/fp8_decode.py [--rounds N] [--cases "decode 32x1024,decode 4x16384"]
                                    [--block-sizes 16,128] [--orders HND,NHD]

Same shapes as benchmarks/attention.py (8 query / 2 KV heads, head size 64, scattered blocks).
For each configuration the bf16 cache and the two fp8 caches (bf16 queries, scales 1.0) are
timed in turn, round after round, in this one process, each call cold (a 1 GiB write first), so
load on this shared machine falls on all three alike; the table gives the median of the per-round
ratios fp8 / bf16 (goal: <= 0.75 cold).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attention import CASES, FLUSH_BYTES, build
from kvmulti.backends.cpu import CPUBackend

DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def decode_fn(backend: CPUBackend, case: str, dtype: torch.dtype, block_size: int, order: str):
    layout, cache, md, query, kv_bytes = build(case, dtype, block_size, order)
    hq, head = CASES[case].hq, CASES[case].head
    step = backend.build_metadata(md, layout, hq, None)
    out = torch.zeros(query.shape[0], hq, head, dtype=query.dtype)
    scales = torch.ones(layout.num_kv_heads) if dtype != torch.bfloat16 else None
    return (lambda: backend.paged_attention(query, cache, step, head ** -0.5, None, out, scales, scales)), kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cases", default="decode 32x1024,decode 4x16384")
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--orders", default="HND,NHD")
    args = ap.parse_args()
    backend = CPUBackend(native_kernel=True)
    print("kvmulti CPU backend:", backend.describe(), f"; torch threads {torch.get_num_threads()}")
    flush = torch.empty(FLUSH_BYTES // 4)
    print("| case | block | order | bf16 cold ms | e4m3 cold ms | e5m2 cold ms | e4m3 / bf16 | e5m2 / bf16 |"
          " bf16 hot ms | e4m3 hot ms | e4m3 / bf16 hot |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        for bs in map(int, args.block_sizes.split(",")):
            for order in args.orders.split(","):
                fns = {name: decode_fn(backend, case, dt, bs, order)[0] for name, dt in DTYPES.items()}
                cold = {name: [] for name in fns}
                hot = {name: [] for name in fns}
                for fn in fns.values():
                    fn()
                for r in range(args.rounds):
                    for name, fn in fns.items():
                        flush.fill_(float(r))                 # evict the caches: the KV comes from RAM
                        t0 = time.perf_counter()
                        fn()
                        cold[name].append(time.perf_counter() - t0)
                        fn()
                        t0 = time.perf_counter()
                        fn()
                        hot[name].append(time.perf_counter() - t0)
                med = {n: statistics.median(v) * 1e3 for n, v in cold.items()}
                hmed = {n: statistics.median(v) * 1e3 for n, v in hot.items()}
                ratio = {n: statistics.median(a / b for a, b in zip(cold[n], cold["bf16"])) for n in fns}
                hratio = statistics.median(a / b for a, b in zip(hot["fp8_e4m3"], hot["bf16"]))
                print(f"| {case} | {bs} | {order} | {med['bf16']:.2f} | {med['fp8_e4m3']:.2f} | "
                      f"{med['fp8_e5m2']:.2f} | {ratio['fp8_e4m3']:.2f} | {ratio['fp8_e5m2']:.2f} | "
                      f"{hmed['bf16']:.2f} | {hmed['fp8_e4m3']:.2f} | {hratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
