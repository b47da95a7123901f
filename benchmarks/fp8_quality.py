#!/usr/bin/env python
"""Quality of an fp8 KV cache on the shipped tiny pair (CPU backend, bf16 model, scales 1.0).

    python benchmarks/fp8_quality.py [--windows N] [--max-new-tokens N]

1. Per-token log-likelihood of held-out text under the tiny target with a bf16 KV cache and with
   fp8 e4m3 / e5m2 caches. The target was trained on the Python standard library's sources; the
   held-out text is kvmulti's own Python sources (not in that corpus), cut into 512-byte windows
   (the training length), each scored in one prefill whose attention reads the cache just written.
2. Speculative decoding acceptance with the draft's cache in fp8 (target cache bf16), greedy,
   k = 4, on the prompts of benchmarks/spec_decode.py.
3. The largest |K| and |V| the target writes on that text: against the formats' ranges, why the
   runner's scale of 1.0 neither saturates nor falls into subnormals much (docs/fp8.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import kvmulti
from kvmulti.generate_cli import shipped_model
from kvmulti.engine import ModelRunner
from kvmulti.spec_decode.runner import SpeculativeRunner
from spec_decode import stdlib_prompts

KV = ("auto", "fp8_e4m3", "fp8_e5m2")
WINDOW = 512
BOS = 256


def held_out_windows(n: int) -> list[list[int]]:
    """n byte windows of kvmulti's own sources, BOS first."""
    text = b"".join(p.read_bytes() for p in sorted(Path(kvmulti.__file__).parent.glob("*.py")))
    step = max(WINDOW, len(text) // n)
    return [[BOS, *text[i:i + WINDOW]] for i in range(0, step * n, step)][:n]


def token_log_likelihoods(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """log p(token[i + 1] | tokens[:i + 1]) for every position, one prefill."""
    runner.add_request("w", tokens)
    try:
        logits = runner.forward({"w": len(tokens)}, num_logits=len(tokens))
    finally:
        runner.remove_request("w")
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def kv_amax(runner: ModelRunner, tokens: list[int]) -> tuple[float, float]:
    """Largest |K| and |V| the target writes for ``tokens`` (read back from its bf16 caches)."""
    runner.add_request("a", tokens)
    runner.forward({"a": len(tokens)})
    k = max(float(lay.keys(c).abs().max()) for lay, c in
            ((runner.layouts[runner.layer_to_group[n]], c) for n, c in runner.kv_caches.items()))
    v = max(float(lay.values(c).abs().max()) for lay, c in
            ((runner.layouts[runner.layer_to_group[n]], c) for n, c in runner.kv_caches.items()))
    runner.remove_request("a")
    return k, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = str(shipped_model("target")), str(shipped_model("draft"))
    windows = held_out_windows(args.windows)

    runners = {kv: ModelRunner(target, backend="CPU", dtype=torch.bfloat16, kv_cache_dtype=kv,
                               max_num_batched_tokens=2 * WINDOW) for kv in KV}
    ll = {kv: torch.cat([token_log_likelihoods(r, w) for w in windows]) for kv, r in runners.items()}
    base = ll["auto"]
    print(f"held-out text: {len(windows)} windows x {WINDOW} bytes of kvmulti/*.py ({base.numel()} tokens)")
    print("| KV cache | mean log-likelihood / token (nats) | difference vs bf16 | relative | max |per-token| diff |")
    print("|---|---|---|---|---|")
    for kv, x in ll.items():
        diff = x.mean() - base.mean()
        print(f"| {'bf16' if kv == 'auto' else kv} | {x.mean():.5f} | {diff:+.5f} | {100 * abs(diff) / abs(base.mean()):.3f} % "
              f"| {(x - base).abs().max():.4f} |")
    k, v = kv_amax(runners["auto"], windows[0])
    print(f"\nlargest |K| / |V| written (first window, all layers): {k:.2f} / {v:.2f} "
          f"(e4m3 normal range 2^-6 .. 448, e5m2 2^-14 .. 57344)")

    prompts = stdlib_prompts(8)
    print("\n| draft KV cache | acceptance | mean accepted length | greedy output = bf16-draft run |")
    print("|---|---|---|---|")
    outputs = {}
    for kv in KV:
        runner = SpeculativeRunner(target=target, draft=draft, num_speculative_tokens=4, dtype=torch.bfloat16,
                                   target_backend="CPU", draft_backend="CPU", kv_cache_dtype="auto",
                                   draft_kv_cache_dtype=kv)
        outputs[kv] = runner.generate(prompts, max_new_tokens=args.max_new_tokens)
        st = runner.stats
        print(f"| {'bf16' if kv == 'auto' else kv} | {st.acceptance_rate:.3f} | {st.mean_accepted_length:.2f} | "
              f"{'yes' if outputs[kv] == outputs['auto'] else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
