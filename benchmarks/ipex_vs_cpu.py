"""Decode step time of IPEX vs kvmulti's CPU backend on one cache, alternating runs in one process.

Run in .venv-ipex: ``.venv-ipex/bin/python benchmarks/ipex_vs_cpu.py [--reps N]``. Prints a
markdown table (median ms per step of each backend and their ratio) per cache order.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvmulti


def make_step(order: str, backend: str, num_seqs: int, context: int, dtype: torch.dtype):
    bs, hkv, group, head = 16, 8, 4, 128
    blocks = num_seqs * (context // bs + 1)
    layout = kvmulti.KVCacheLayout(num_blocks=blocks, block_size=bs, num_kv_heads=hkv, head_size=head, dtype=dtype,
                                   order=order)
    cache = layout.allocate()
    cache.copy_(torch.randn(layout.shape).to(dtype))
    table = torch.randperm(blocks, dtype=torch.int32).view(num_seqs, -1)
    md = kvmulti.CommonAttentionMetadata.from_lens([1] * num_seqs, [context] * num_seqs, table, bs)
    query = torch.randn(num_seqs, hkv * group, head).to(dtype)
    step = kvmulti.prepare_step(md, layout, hkv * group, backend=backend)
    return lambda: kvmulti.paged_attention(query, cache, layout, step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    print(f"decode, bf16, {args.seqs} sequences x {args.context} keys, 8 KV heads x 4, head 128, block 16, "
          f"{torch.get_num_threads()} threads")
    print("| order | CPU ms | IPEX ms | IPEX / CPU |\n|---|---|---|---|")
    for order in ("NHD", "HND"):
        runs = {name: make_step(order, name, args.seqs, args.context, torch.bfloat16) for name in ("CPU", "IPEX")}
        times = {name: [] for name in runs}
        for name, run in runs.items():
            run()                                  # warm-up (builds, first-touch)
        for _ in range(args.reps):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1e3)
        cpu, ipex = statistics.median(times["CPU"]), statistics.median(times["IPEX"])
        print(f"| {order} | {cpu:.2f} | {ipex:.2f} | {ipex / cpu:.1f} |")


if __name__ == "__main__":
    main()
