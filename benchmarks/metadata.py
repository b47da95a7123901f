"""Per-step CPU overhead of the runners: 2 models x 2 KV groups x 64 requests.

Two runners (a Gemma3-style target and a Gemma2-style draft, each with a full and a sliding
group of different block sizes) each hold 64 requests with 100..2000 tokens of context.

* "metadata": one step's ``prepare`` + ``commit`` per runner -- block allocation, one
  CommonAttentionMetadata per group, and (since the per-step hook) its validation and the backend's
  plan -- then computed lengths advance and sliding groups free blocks; no model runs.
* "metadata + dispatch" (``--dispatch``): the same plus the model's forward with the attention
  backend's kernels replaced by no-ops, i.e. everything the runner does per step around the
  kernels: per-layer op calls (selection, checks, planning where a backend does it per layer) and
  the tiny model's projections.

Printed: microseconds per step, per runner and for both runners together.

    .venv/bin/python benchmarks/metadata.py [--steps 300] [--requests 64] [--prefill 4] [--dispatch]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvmulti.engine import ModelRunner
from kvmulti.models import CausalLM, ModelConfig

FULL, SLIDING = "full_attention", "sliding_attention"


def tiny_model(family: str, layers: int, window: int) -> CausalLM:
    types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(layers))
    cfg = ModelConfig.from_hf(dict(model_type=family, vocab_size=256, hidden_size=64, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=32, sliding_window=window, layer_types=list(types)))
    return CausalLM(cfg)


def make_runner(name: str, model: CausalLM, role: str, requests: int, seed: int) -> ModelRunner:
    runner = ModelRunner(model, role=role, block_size={"full": 16, "sliding": 32}, num_blocks=requests * 160,
                         max_num_batched_tokens=8192)
    gen = torch.Generator().manual_seed(seed)
    for i in range(requests):
        n = int(torch.randint(100, 2000, (1,), generator=gen))
        runner.add_request(i, [1] * n)
        runner.commit(runner.prepare({i: n}, 0))            # context already in the cache
        runner.append_tokens(i, [1])
    runner.name = name
    return runner


def stub_kernels() -> None:
    """Replace the CPU backend's kernels by no-ops (the dispatch rows time everything around them)."""
    from kvmulti.backends.registry import get_backend
    cls = type(get_backend("CPU"))
    cls.paged_attention = lambda self, *args, **kwargs: None
    cls.write_kv = lambda self, *args, **kwargs: None


def step(runner: ModelRunner, prefill: int, dispatch: bool) -> tuple[float, float]:
    """Prepare (+ forward with stubbed kernels) + commit one decode step of every request
    (``prefill`` of them compute 8 tokens)."""
    schedule = {rid: (8 if rid < prefill else 1) for rid in runner.requests}
    for rid, n in schedule.items():
        if n > 1:
            runner.append_tokens(rid, [1] * (n - 1))
    start, cpu = time.perf_counter(), time.thread_time()
    batch = runner.prepare(schedule)
    if dispatch:
        with torch.inference_mode():
            runner.model(batch.input_ids, batch.positions, runner.attention_context(batch))
    runner.commit(batch)
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
    for rid in runner.requests:
        runner.append_tokens(rid, [1])
    return elapsed, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=4, help="requests computing an 8-token chunk in the mixed rows")
    ap.add_argument("--dispatch", action="store_true", help="also run the forward with the kernels stubbed")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.dispatch:
        stub_kernels()
    runners = [make_runner("gemma3-style target", tiny_model("gemma3_text", 4, 512), "target", args.requests, 0),
               make_runner("gemma2-style draft", tiny_model("gemma2", 2, 256), "draft", args.requests, 1)]
    rows = []
    for label, prefill in (("decode", 0), (f"mixed ({args.prefill} x 8-token chunks)", args.prefill)):
        per_runner = {r.name: ([], []) for r in runners}
        totals = ([], [])
        for _ in range(args.steps):
            t = c = 0.0
            for r in runners:
                dt, dc = step(r, prefill, args.dispatch)
                per_runner[r.name][0].append(dt)
                per_runner[r.name][1].append(dc)
                t, c = t + dt, c + dc
            totals[0].append(t)
            totals[1].append(c)
        for r in runners:
            groups = " + ".join(f"{g.spec.kind}/{g.spec.block_size}" for g in r.kv_cache_config.groups)
            rows.append((label, r.name, groups, per_runner[r.name]))
        rows.append((label, "both runners (one step)", "4 groups", totals))

    what = "metadata + dispatch" if args.dispatch else "metadata"
    print(f"{what} per step, {args.requests} requests per runner, {args.steps} steps (prepare: block allocation + "
          f"per-group metadata, its checks and plan; {'forward with stubbed kernels; ' if args.dispatch else ''}"
          "commit: lengths + sliding-window frees)")
    print("wall = elapsed time (includes waiting for a core on a shared machine); cpu = this thread's CPU time")
    print(f"{'batch':<30} {'runner':<24} {'groups (kind/block)':<26} {'wall median us':>15} {'wall p90 us':>12} "
          f"{'cpu median us':>14}")
    for label, name, groups, (wall, cpu) in rows:
        us = sorted(t * 1e6 for t in wall)
        print(f"{label:<30} {name:<24} {groups:<26} {statistics.median(us):>15.1f} {us[int(0.9 * len(us))]:>12.1f} "
              f"{statistics.median(cpu) * 1e6:>14.1f}")


if __name__ == "__main__":
    main()
