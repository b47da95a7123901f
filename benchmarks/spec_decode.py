"""Speculative vs target-only decoding with the shipped tiny pair: k x batch table.

    python benchmarks/spec_decode.py [--max-new-tokens 64] [--threads 1]

Prompts are 8 function headers from the Python standard library (offline); batch 1 runs them one
after another, batch 8 in one call. Greedy; the
speculative output is checked to equal the target-only output. Prints mean accepted length
(tokens a request gains per target forward), acceptance rate and tokens/s of both.
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch

from kvmulti.generate_cli import shipped_model
from kvmulti.spec_decode.runner import SpeculativeRunner


def stdlib_prompts(n: int) -> list[str]:
    import collections, json as js, textwrap, argparse as ap  # noqa: E401 -- sources only
    prompts = []
    for module in (collections, js, textwrap, ap):
        for line in inspect.getsource(module).splitlines():
            if line.strip().startswith("def ") and line.endswith(":"):
                prompts.append(line + "\n")
    return prompts[:n]


def run(runner: SpeculativeRunner, groups: list[list[str]], max_new_tokens: int, repeats: int) -> dict:
    """Generate every group of prompts (one generate call each); best of ``repeats`` passes."""
    runner.generate(groups[0][:1], max_new_tokens=4)          # warm-up
    best = None
    for _ in range(repeats):
        tokens = seconds = accepted = proposed = verifications = 0
        outputs = []
        for group in groups:
            outputs += runner.generate(group, max_new_tokens=max_new_tokens)
            st = runner.stats
            tokens, seconds = tokens + st.num_generated_tokens, seconds + st.elapsed_s
            accepted, proposed = accepted + st.num_accepted_tokens, proposed + st.num_draft_tokens
            verifications += st.num_verifications
        result = dict(tok_s=tokens / seconds, outputs=outputs,
                      acceptance=accepted / proposed if proposed else None,
                      mean_accepted_length=(accepted + verifications) / verifications if verifications else None)
        if best is None or result["tok_s"] > best["tok_s"]:
            best = result
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = str(shipped_model("target")), str(shipped_model("draft"))
    prompts = stdlib_prompts(8)
    rows = []
    print(f"{'k':>3} {'batch':>5} {'mean acc len':>12} {'accept':>7} {'spec tok/s':>11} {'target tok/s':>13} "
          f"{'speed-up':>9} {'same':>5}")
    baseline_runner = SpeculativeRunner(target=target, draft=None)
    for batch in (1, 8):
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        base = run(baseline_runner, groups, args.max_new_tokens, args.repeats)
        for k in (1, 2, 4, 8):
            spec = run(SpeculativeRunner(target=target, draft=draft, num_speculative_tokens=k), groups,
                       args.max_new_tokens, args.repeats)
            row = dict(k=k, batch=batch, mean_accepted_length=spec["mean_accepted_length"],
                       acceptance=spec["acceptance"], spec_tok_s=spec["tok_s"], target_tok_s=base["tok_s"],
                       speedup=spec["tok_s"] / base["tok_s"], identical=spec["outputs"] == base["outputs"])
            rows.append(row)
            print(f"{k:>3} {batch:>5} {row['mean_accepted_length']:>12.2f} {row['acceptance']:>7.2f} "
                  f"{row['spec_tok_s']:>11.1f} {row['target_tok_s']:>13.1f} {row['speedup']:>8.2f}x "
                  f"{'yes' if row['identical'] else 'NO':>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
