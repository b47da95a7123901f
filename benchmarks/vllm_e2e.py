"""vLLM engine throughput with kvmulti's plugin vs vLLM's own CPU attention (CPU_ATTN).

Each row runs vLLM's offline engine (``kvmulti.integrations.vllm.engine_run``, in vLLM's venv
``.venv-vllm`` made by ``scripts/setup.sh --test``) on the shipped tiny target: greedy, token-id
prompts, one engine process, block 32 (CPU_ATTN needs a multiple of 32). Per round, CPU_ATTN and
kvmulti (``KVMULTI_VLLM=1``) each start an engine and generate ``--gens`` times; the first
generation warms up, the fastest of the rest counts. The two alternate, the order flipping every
round. Printed: median generated tokens per second over the rounds, the ratio of those medians
kvmulti / CPU_ATTN (> 1: kvmulti faster), the median of the per-round ratios (each round's two
engines ran back to back, so this one is less moved by the machine's drift between rounds) and
whether both generated the same token ids.

    python benchmarks/vllm_e2e.py [--rounds 3] [--max-tokens 64] [--gens 3] [--quick] [--json OUT]

``--json OUT`` writes the rows (batch, mode, tokens/s of both, the ratios, same ids) for
``benchmarks/plot.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODELS = ROOT / "kvmulti" / "models" / "tiny"


def engine_run(kvmulti: bool, batch: int, speculative: bool, args: argparse.Namespace) -> dict:
    """One engine's JSON result (engine_run's output line)."""
    env = {k: v for k, v in os.environ.items() if k != "KVMULTI_VLLM"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if kvmulti:
        env["KVMULTI_VLLM"] = "1"
    cmd = [str(args.python), "-m", "kvmulti.integrations.vllm.engine_run", "--model", str(MODELS / "target"),
           "--block-size", "32", "--prompts", str(batch), "--max-num-seqs", str(batch), "--max-tokens",
           str(args.max_tokens), "--rounds", str(args.gens), "--dtype", args.dtype, "--count-calls"]
    if speculative:
        cmd += ["--draft", str(MODELS / "draft"), "--num-spec-tokens", "3"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    served = result["kvmulti_forward_calls"] > 0
    if served != kvmulti:
        raise SystemExit(f"expected {'kvmulti' if kvmulti else 'CPU_ATTN'} to serve the run, "
                         f"kvmulti served {result['kvmulti_forward_calls']} calls")
    return result


def tokens_per_second(result: dict) -> float:
    timed = result["seconds"][1:] or result["seconds"]              # the first generation warms up
    return result["generated_tokens"] / min(timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gens", type=int, default=3, help="generations per engine (the first warms up)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--python", default=str(VLLM_PYTHON), help="an interpreter with vllm-cpu and kvmulti")
    ap.add_argument("--quick", action="store_true", help="1 round, 32 tokens, 2 generations")
    ap.add_argument("--json", default=None, help="also write the rows here (benchmarks/plot.py reads them)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.max_tokens, args.gens = 1, 32, 2
    if not Path(args.python).is_file():
        raise SystemExit(f"{args.python} missing: run scripts/setup.sh --test")
    rows = [(batch, spec) for spec in (False, True) for batch in (1, 8)]
    print(f"vLLM CPU engine, tiny target ({args.dtype}, block 32), greedy, {args.max_tokens} tokens per prompt; "
          f"median of {args.rounds} alternating rounds, fastest of {args.gens - 1 or 1} timed generations each")
    print(f"{'batch':>5} {'mode':<22} {'CPU_ATTN tok/s':>15} {'kvmulti tok/s':>14} {'kvmulti/CPU_ATTN':>17} "
          f"{'per-round ratio':>16} {'same ids':>9}")
    table = []
    for batch, spec in rows:
        speeds = {False: [], True: []}
        ids = {}
        for r in range(args.rounds):
            for kvmulti in ((False, True) if r % 2 == 0 else (True, False)):
                result = engine_run(kvmulti, batch, spec, args)
                speeds[kvmulti].append(tokens_per_second(result))
                ids[kvmulti] = result["token_ids"]
        base, ours = statistics.median(speeds[False]), statistics.median(speeds[True])
        paired = statistics.median(k / c for k, c in zip(speeds[True], speeds[False]))
        mode = "draft_model spec, k=3" if spec else "plain"
        print(f"{batch:>5} {mode:<22} {base:>15.1f} {ours:>14.1f} {ours / base:>16.2f}x {paired:>15.2f}x "
              f"{str(ids[False] == ids[True]):>9}")
        sys.stdout.flush()
        table.append(dict(batch=batch, mode=mode, cpu_attn_tok_s=base, kvmulti_tok_s=ours, ratio=ours / base,
                          per_round_ratio=paired, same_ids=ids[False] == ids[True]))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(dtype=args.dtype, rounds=args.rounds, max_tokens=args.max_tokens,
                                                   load_average=os.getloadavg(), rows=table), indent=1))


if __name__ == "__main__":
    main()
