"""``kvmulti generate``: speculative decoding with the shipped tiny model pair (or your own)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from importlib import resources
from pathlib import Path

import torch

from .engine import DEFAULT_KV_MEMORY_BYTES, KV_CACHE_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shipped_model(name: str) -> Path:
    """Directory of a model shipped in the package (``target`` or ``draft`` of the tiny pair)."""
    return Path(str(resources.files("kvmulti.models") / "tiny" / name))


class UsageError(ValueError):
    """A mistake in the command line; printed as one line, exit code 2."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _temperature(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _backend_name(text: str) -> str:
    from .backends.registry import canonical_name
    try:
        return canonical_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative_tokens(text: str) -> int:
    from .spec_decode.runner import MAX_SPECULATIVE_TOKENS
    value = int(text)
    if not 1 <= value <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_SPECULATIVE_TOKENS}, got {value}")
    return value


def add_generate_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    from .backends.registry import backend_names
    names = ", ".join(backend_names())
    p = sub.add_parser("generate", help=help_text)
    p.add_argument("prompt", nargs="+", help="one or more prompts (a batch)")
    p.add_argument("--model", metavar="DIR", default=None, help="target HF model dir (default: the shipped tiny target)")
    p.add_argument("--draft", metavar="DIR", default=None,
                   help="draft HF model dir, or 'none' (default: the shipped tiny draft)")
    p.add_argument("-k", "--num-speculative-tokens", metavar="K", type=_speculative_tokens, default=4,
                   help="tokens the draft proposes per step, 1..32 (default: %(default)s)")
    p.add_argument("--temperature", metavar="T", type=_temperature, default=0.0,
                   help="0 is greedy, > 0 samples (default: %(default)s)")
    p.add_argument("--max-new-tokens", metavar="N", type=_positive_int, default=96,
                   help="tokens generated per prompt (default: %(default)s)")
    p.add_argument("--backend", metavar="NAME", type=_backend_name, default=None,
                   help=f"target attention backend: {names} (default: dispatch)")
    p.add_argument("--draft-backend", metavar="NAME", type=_backend_name, default=None,
                   help=f"attention backend of the draft model: {names} (default: dispatch for the draft -- "
                        "KVMULTI_DRAFT_ATTENTION_BACKEND, else KVMULTI_ATTENTION_BACKEND, else platform "
                        "priority; --backend names the target's only)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampler (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="model and KV cache dtype (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="target KV cache dtype: auto (the model's) or fp8 with scale 1.0 (default: %(default)s)")
    p.add_argument("--draft-kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                   help="draft KV cache dtype (default: --kv-cache-dtype's)")
    p.add_argument("--threads", metavar="N", type=_positive_int, default=None,
                   help="torch CPU threads (default: 1 for the shipped tiny pair, whose matmuls are too small "
                        "to split, else torch's default)")
    p.add_argument("--kv-memory-mb", metavar="MB", type=_positive_int, default=DEFAULT_KV_MEMORY_BYTES // 2**20,
                   help="KV-cache memory of EACH model in MiB; raise it for long or many prompts (default: %(default)s)")
    p.add_argument("--truncate-prompt", action="store_true",
                   help="keep only the last bytes of a prompt that, with --max-new-tokens, exceeds the model's "
                        "context (default: such a prompt is an error)")
    p.add_argument("--no-baseline", action="store_true", help="skip the target-only run used for the speed-up")
    p.set_defaults(func=cmd_generate)


def model_context(path: str, what: str) -> int | None:
    """Check that ``path`` is an HF model directory; return its max_position_embeddings (None: not set).
    Raises UsageError naming the option."""
    directory = Path(path)
    if not directory.is_dir():
        raise UsageError(f"{what} {path}: no such directory")
    config = directory / "config.json"
    if not config.is_file():
        raise UsageError(f"{what} {path}: not a model directory (no config.json)")
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{what} {path}: config.json is unreadable ({e})") from None
    if not any(directory.glob("*.safetensors")):
        raise UsageError(f"{what} {path}: no *.safetensors weights")
    value = data.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


def fit_prompts(prompts: list[str], context: int, max_new_tokens: int, truncate: bool) -> list[str]:
    """Prompts whose bytes (+ BOS) and the new tokens fit ``context`` positions: as they are, or
    (``truncate``) cut to their last bytes; else UsageError."""
    room = context - 1 - max_new_tokens
    if room < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context "
                         f"of {context} positions")
    fitted = []
    for i, prompt in enumerate(prompts):
        data = prompt.encode()
        if len(data) > room:
            if not truncate:
                raise UsageError(f"prompt {i + 1} has {len(data)} bytes; with --max-new-tokens {max_new_tokens} it "
                                 f"exceeds the model's context of {context} positions (at most {room} prompt bytes; "
                                 "--truncate-prompt keeps the last ones)")
            prompt = data[-room:].decode(errors="ignore")
        fitted.append(prompt)
    return fitted


class Progress:
    """A one-line progress display on stderr: tokens generated so far, and rate."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.tty = label, total, sys.stderr.isatty()

    def __call__(self, done: int, elapsed_s: float) -> None:
        rate = done / elapsed_s if elapsed_s > 0 else 0.0
        width = 30
        filled = int(width * min(done, self.total) / max(self.total, 1))
        line = f"\r{self.label:<12} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} tokens  {rate:7.1f} tok/s"
        if self.tty:
            sys.stderr.write(line)
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def cmd_generate(args: argparse.Namespace) -> int:
    from .spec_decode.runner import GenerationError, SpeculativeRunner

    target = args.model or str(shipped_model("target"))
    draft = None if (args.draft or "").lower() == "none" else (args.draft or str(shipped_model("draft")))
    contexts = [c for c in (model_context(target, "--model"), draft and model_context(draft, "--draft")) if c]
    if contexts:
        args.prompt = fit_prompts(args.prompt, min(contexts), args.max_new_tokens, args.truncate_prompt)
    dtype = DTYPES[args.dtype]
    shipped_pair = args.model is None and (args.draft is None or args.draft.lower() == "none")
    threads = args.threads if args.threads is not None else (1 if shipped_pair else None)
    if threads is not None:
        torch.set_num_threads(threads)
    memory = args.kv_memory_mb * 2**20
    runner = SpeculativeRunner(target=target, draft=draft, num_speculative_tokens=args.num_speculative_tokens,
                               target_backend=args.backend, draft_backend=args.draft_backend, device="cpu",
                               dtype=dtype, memory_bytes=memory, kv_cache_dtype=args.kv_cache_dtype,
                               draft_kv_cache_dtype=args.draft_kv_cache_dtype)
    print(f"target: {target}   ({torch.get_num_threads()} CPU threads)")
    print(_indent(runner.target.describe()))
    if runner.draft is not None:
        print(f"draft:  {draft}   (k = {args.num_speculative_tokens})")
        print(_indent(runner.draft.describe()))
    used = {b.name: b for r in (runner.target, runner.draft) if r is not None for b in r.backends.values()}
    for name, backend in used.items():
        print(f"{name} backend: {backend.describe()}")
    total = args.max_new_tokens * len(args.prompt)

    try:
        runner.generate(args.prompt[:1], max_new_tokens=4, temperature=args.temperature, seed=args.seed)  # warm-up
        progress = Progress("speculative" if runner.draft is not None else "target-only", total)
        outputs = runner.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  seed=args.seed, progress=progress)
        progress.close()
    except GenerationError as e:
        raise UsageError(f"{e.failures[min(e.failures)]} -- raise --kv-memory-mb (now {args.kv_memory_mb})") from None
    stats = runner.stats
    print()
    for prompt, out in zip(args.prompt, outputs):
        print(f"--- {prompt!r}")
        print(prompt + runner.decode(out))
    print()
    print(f"generated {stats.num_generated_tokens} tokens in {stats.elapsed_s:.2f} s: {stats.tokens_per_s:.1f} tok/s")
    if stats.acceptance_rate is not None:
        rates = " ".join(f"{r:.2f}" for r in stats.per_position_acceptance)
        print(f"acceptance rate {stats.acceptance_rate:.2f}; mean accepted length {stats.mean_accepted_length:.2f} "
              f"tokens per target step; per position: {rates}")
        print(f"time: draft {stats.draft_time_s:.2f} s, target {stats.target_time_s:.2f} s")
        if not args.no_baseline:
            baseline = SpeculativeRunner(target=target, draft=None, target_backend=args.backend, device="cpu",
                                         dtype=dtype, memory_bytes=memory, kv_cache_dtype=args.kv_cache_dtype)
            baseline.generate(args.prompt[:1], max_new_tokens=4, temperature=args.temperature, seed=args.seed)
            bar = Progress("target-only", total)
            base_out = baseline.generate(args.prompt, max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature, seed=args.seed, progress=bar)
            bar.close()
            speedup = stats.tokens_per_s / baseline.stats.tokens_per_s if baseline.stats.tokens_per_s else 0.0
            print(f"target-only: {baseline.stats.tokens_per_s:.1f} tok/s -> speculative speed-up {speedup:.2f}x")
            if args.temperature == 0:
                same = base_out == outputs
                print(f"greedy output identical to target-only decoding: {'yes' if same else 'NO'}")
                if not same:
                    return 1
    return 0


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
