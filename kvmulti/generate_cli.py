"""``kvmulti generate``: speculative decoding with the shipped tiny model pair (or your own)."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shipped_model(name: str) -> Path:
    """Directory of a model shipped in the package (``target`` or ``draft`` of the tiny pair)."""
    return Path(str(resources.files("kvmulti.models") / "tiny" / name))


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="speculative decoding: print the text, backends, acceptance and speed")
    p.add_argument("prompt", nargs="+", help="one or more prompts (a batch)")
    p.add_argument("--model", default=None, help="target HF model dir (default: the shipped tiny target)")
    p.add_argument("--draft", default=None, help="draft HF model dir (default: the shipped tiny draft; 'none' to disable)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--backend", default=None, help="target backend (default: dispatch)")
    p.add_argument("--draft-backend", default=None, help="draft backend (default: dispatch, never the target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for the shipped tiny pair, whose matmuls are too small "
                        "to split, else torch's default)")
    p.add_argument("--no-baseline", action="store_true", help="skip the target-only run used for the speed-up")
    p.set_defaults(func=cmd_generate)


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
    from .spec_decode.runner import SpeculativeRunner

    target = args.model or str(shipped_model("target"))
    draft = None if (args.draft or "").lower() == "none" else (args.draft or str(shipped_model("draft")))
    dtype = DTYPES[args.dtype]
    shipped_pair = args.model is None and (args.draft is None or args.draft.lower() == "none")
    threads = args.threads if args.threads is not None else (1 if shipped_pair else None)
    if threads is not None:
        if threads < 1:
            raise SystemExit(f"kvmulti generate: --threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    runner = SpeculativeRunner(target=target, draft=draft, num_speculative_tokens=args.num_speculative_tokens,
                               target_backend=args.backend, draft_backend=args.draft_backend, device="cpu",
                               dtype=dtype)
    print(f"target: {target}   ({torch.get_num_threads()} CPU threads)")
    print(_indent(runner.target.describe()))
    if runner.draft is not None:
        print(f"draft:  {draft}   (k = {args.num_speculative_tokens})")
        print(_indent(runner.draft.describe()))
    total = args.max_new_tokens * len(args.prompt)

    runner.generate(args.prompt[:1], max_new_tokens=4, temperature=args.temperature, seed=args.seed)  # warm-up
    progress = Progress("speculative" if runner.draft is not None else "target-only", total)
    outputs = runner.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              seed=args.seed, progress=progress)
    progress.close()
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
                                         dtype=dtype)
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
