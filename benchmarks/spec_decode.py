"""Speculative vs target-only decoding with the shipped tiny pair: k x batch table.

    python benchmarks/spec_decode.py [--max-new-tokens 64] [--threads 1]

Prompts are 8 function headers from the Python standard library (offline); batch 1 runs them one
after another, batch 8 in one call. Greedy; the speculative output is checked to equal the
target-only output. Prints mean accepted length (tokens a request gains per target forward),
acceptance rate, tokens/s of both (wall clock) and the speed-up by wall clock and by this
process's CPU time (the latter is what other jobs on a shared machine disturb least). Target-only
and speculative passes alternate, so both see the same load; each rate is its best pass.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

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


def one_pass(runner: SpeculativeRunner, groups: list[list[str]], max_new_tokens: int) -> dict:
    """Generate every group of prompts once (one generate call each)."""
    tokens = accepted = proposed = verifications = 0
    outputs = []
    wall, cpu = time.perf_counter(), time.process_time()
    for group in groups:
        outputs += runner.generate(group, max_new_tokens=max_new_tokens)
        st = runner.stats
        tokens += st.num_generated_tokens
        accepted, proposed = accepted + st.num_accepted_tokens, proposed + st.num_draft_tokens
        verifications += st.num_verifications
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return dict(tok_s=tokens / wall, cpu_tok_s=tokens / cpu, outputs=outputs,
                acceptance=accepted / proposed if proposed else None,
                mean_accepted_length=(accepted + verifications) / verifications if verifications else None)


def compare(base: SpeculativeRunner, spec: SpeculativeRunner, groups: list[list[str]], max_new_tokens: int,
            repeats: int) -> tuple[dict, dict]:
    """Best of ``repeats`` passes of each runner, the two alternating so that both see the same
    load on a shared machine; wall and CPU-time rates are each the best of their passes."""
    for runner in (base, spec):
        runner.generate(groups[0][:1], max_new_tokens=4)                # warm-up
    passes: tuple[list[dict], list[dict]] = ([], [])
    for _ in range(repeats):
        for results, runner in zip(passes, (base, spec)):
            results.append(one_pass(runner, groups, max_new_tokens))
    return tuple(dict(results[0], tok_s=max(r["tok_s"] for r in results),
                      cpu_tok_s=max(r["cpu_tok_s"] for r in results)) for results in passes)


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
          f"{'speed-up':>9} {'cpu speed-up':>13} {'same':>5}")
    baseline_runner = SpeculativeRunner(target=target, draft=None)
    for batch in (1, 8):
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        for k in (1, 2, 4, 8):
            spec_runner = SpeculativeRunner(target=target, draft=draft, num_speculative_tokens=k)
            base, spec = compare(baseline_runner, spec_runner, groups, args.max_new_tokens, args.repeats)
            row = dict(k=k, batch=batch, mean_accepted_length=spec["mean_accepted_length"],
                       acceptance=spec["acceptance"], spec_tok_s=spec["tok_s"], target_tok_s=base["tok_s"],
                       speedup=spec["tok_s"] / base["tok_s"], cpu_speedup=spec["cpu_tok_s"] / base["cpu_tok_s"],
                       identical=spec["outputs"] == base["outputs"])
            rows.append(row)
            print(f"{k:>3} {batch:>5} {row['mean_accepted_length']:>12.2f} {row['acceptance']:>7.2f} "
                  f"{row['spec_tok_s']:>11.1f} {row['target_tok_s']:>13.1f} {row['speedup']:>8.2f}x "
                  f"{row['cpu_speedup']:>12.2f}x {'yes' if row['identical'] else 'NO':>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
