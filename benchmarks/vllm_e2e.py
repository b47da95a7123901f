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

``--model-config NAME`` runs a real model's shape instead (``benchmarks/model_configs/NAME/config.json``:
llama-3.2-1b, qwen3-0.6b; random weights through vLLM's ``load_format="dummy"``, bf16 unless
``--dtype`` says otherwise, no prefix caching) at every prompt length of ``--prompt-lens`` and batch
of ``--batches``: per engine, each generation is preceded by a timed 1-token generation of the same prompts (time to first token, TTFT).
Printed per row: output tokens per second (generated tokens / the generation's time, its prefill
included) and median TTFT of both engines, and their ratios. A row whose KV cache would not fit in
``--kv-budget-gib`` is printed as skipped with the memory it needs. Random weights make nearly
uniform attention, so "same ids" there is a weak check; the tiny-model rows are the correctness ones.

``--json OUT`` writes the rows (batch, mode, tokens/s of both, the ratios, same ids) for
``benchmarks/plot.py``; a ``--model-config`` row also keeps every round's tokens/s and TTFT.
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
MODEL_CONFIGS = ROOT / "benchmarks" / "model_configs"
#: The model dtypes --dtype takes (vLLM's names) and their element size, which sizes a row's KV cache.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def run_engine(kvmulti: bool, engine_args: list[str], kv_gib: int, python: Path, timeout_s: int) -> dict:
    """One ``engine_run`` process (vLLM's offline engine, in-process workers) with the plugin on or
    off; its JSON result, after checking that the engine asked for was the one that served it."""
    env = {k: v for k, v in os.environ.items() if k != "KVMULTI_VLLM"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
    if kvmulti:
        env["KVMULTI_VLLM"] = "1"
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvmulti-e2e-{os.getpid()}.json"
    cmd = [str(python), "-m", "kvmulti.integrations.vllm.engine_run", *engine_args, "--count-calls",
           "--out", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if run.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    if (result["kvmulti_forward_calls"] > 0) != kvmulti:
        raise SystemExit(f"expected {'kvmulti' if kvmulti else 'CPU_ATTN'} to serve the run, "
                         f"kvmulti served {result['kvmulti_forward_calls']} calls")
    return result


def tiny_run(kvmulti: bool, batch: int, speculative: bool, args: argparse.Namespace) -> dict:
    """The tiny target (and draft) model: ``--gens`` generations of ``batch`` prompts."""
    engine_args = ["--model", str(MODELS / "target"), "--block-size", "32", "--prompts", str(batch),
                   "--max-num-seqs", str(batch), "--max-tokens", str(args.max_tokens), "--rounds", str(args.gens),
                   "--dtype", args.dtype]
    if speculative:
        engine_args += ["--draft", str(MODELS / "draft"), "--num-spec-tokens", "3"]
    return run_engine(kvmulti, engine_args, 1, args.python, 1800)


def kv_bytes_per_token(config: dict, dtype_bytes: int = 2) -> int:
    """K and V bytes one token takes in every layer of a model with this HF config."""
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * heads * head * dtype_bytes


def real_shape_run(kvmulti: bool, model: Path, prompt_len: int, batch: int, kv_gib: int,
                   args: argparse.Namespace) -> dict:
    """One engine on a config-only model: ``--gens`` generations, each after its TTFT probe."""
    max_len = -(-(prompt_len + args.max_tokens) // 256) * 256
    engine_args = ["--model", str(model), "--load-format", "dummy", "--dtype", args.dtype, "--block-size", "32",
                   "--prompts", str(batch), "--max-num-seqs", str(batch), "--prompt-len", str(prompt_len),
                   "--max-tokens", str(args.max_tokens), "--max-model-len", str(max_len), "--rounds", str(args.gens),
                   "--ttft", "--no-prefix-caching"]
    return run_engine(kvmulti, engine_args, kv_gib, args.python, 3600)


def real_shapes(args: argparse.Namespace) -> None:
    """The ``--model-config`` table."""
    model = MODEL_CONFIGS / args.model_config
    if not (model / "config.json").is_file():
        names = ", ".join(sorted(p.name for p in MODEL_CONFIGS.iterdir()))
        raise SystemExit(f"no config {args.model_config!r}; shipped: {names}")
    per_token = kv_bytes_per_token(json.loads((model / "config.json").read_text()), DTYPE_BYTES[args.dtype])
    print(f"vLLM CPU engine, {args.model_config} shape (random weights, {args.dtype}, block 32, no prefix caching), "
          f"greedy, {args.max_tokens} tokens per prompt; median of {args.rounds} alternating rounds, "
          f"fastest of {args.gens - 1 or 1} timed generations each")
    print(f"{'prompt':>6} {'batch':>5} {'CPU_ATTN tok/s':>15} {'kvmulti tok/s':>14} {'tok/s ratio':>12} "
          f"{'CPU_ATTN TTFT s':>16} {'kvmulti TTFT s':>15} {'TTFT ratio':>11} {'same ids':>9}")
    table = []
    for prompt_len in args.prompt_lens:
        for batch in args.batches:
            need = per_token * batch * (prompt_len + args.max_tokens)
            kv_gib = -(-int(need * 1.25) // 2 ** 30)
            if kv_gib > args.kv_budget_gib:
                print(f"{prompt_len:>6} {batch:>5}  skipped: the KV cache needs {need / 2 ** 30:.1f} GiB "
                      f"(> --kv-budget-gib {args.kv_budget_gib})")
                continue
            speeds, ttft, ids = {False: [], True: []}, {False: [], True: []}, {}
            for r in range(args.rounds):
                for kvmulti in ((False, True) if r % 2 == 0 else (True, False)):
                    result = real_shape_run(kvmulti, model, prompt_len, batch, kv_gib, args)
                    speeds[kvmulti].append(tokens_per_second(result))
                    ttft[kvmulti].append(min(result["ttft_seconds"][1:] or result["ttft_seconds"]))
                    ids[kvmulti] = result["token_ids"]
            tok = {k: statistics.median(v) for k, v in speeds.items()}
            first = {k: statistics.median(v) for k, v in ttft.items()}
            print(f"{prompt_len:>6} {batch:>5} {tok[False]:>15.2f} {tok[True]:>14.2f} {tok[True] / tok[False]:>11.2f}x "
                  f"{first[False]:>16.2f} {first[True]:>15.2f} {first[True] / first[False]:>10.2f}x "
                  f"{str(ids[False] == ids[True]):>9}")
            sys.stdout.flush()
            table.append(dict(prompt_len=prompt_len, batch=batch, cpu_attn_tok_s=tok[False], kvmulti_tok_s=tok[True],
                              cpu_attn_ttft_s=first[False], kvmulti_ttft_s=first[True],
                              same_ids=ids[False] == ids[True], rounds=dict(
                                  cpu_attn_tok_s=speeds[False], kvmulti_tok_s=speeds[True],
                                  cpu_attn_ttft_s=ttft[False], kvmulti_ttft_s=ttft[True])))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model_config=args.model_config, dtype=args.dtype, rounds=args.rounds,
                                                   max_tokens=args.max_tokens, load_average=os.getloadavg(),
                                                   rows=table), indent=1))


def tokens_per_second(result: dict) -> float:
    timed = result["seconds"][1:] or result["seconds"]              # the first generation warms up
    return result["generated_tokens"] / min(timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gens", type=int, default=3, help="generations per engine (the first warms up)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES),
                    help="model dtype: float32 (the tiny model's default) or bfloat16 (--model-config's default)")
    ap.add_argument("--python", default=str(VLLM_PYTHON), help="an interpreter with vllm-cpu and kvmulti")
    ap.add_argument("--quick", action="store_true", help="1 round, 32 tokens, 2 generations")
    ap.add_argument("--json", default=None, help="also write the rows here (benchmarks/plot.py reads them)")
    ap.add_argument("--model-config", default=None, help="a real model's shape: llama-3.2-1b, qwen3-0.6b")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--kv-budget-gib", type=int, default=12, help="skip --model-config rows needing more KV cache")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.max_tokens, args.gens = 1, 32, 2
    if args.dtype is None:
        args.dtype = "bfloat16" if args.model_config else "float32"
    if not Path(args.python).is_file():
        raise SystemExit(f"{args.python} missing: run scripts/setup.sh --test")
    if args.model_config:
        real_shapes(args)
        return
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
                result = tiny_run(kvmulti, batch, spec, args)
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
