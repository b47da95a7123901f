"""SpeculativeRunner: generation over a target :class:`~kvmulti.engine.ModelRunner` and,
optionally, a draft one.

With ``draft=None`` it does plain generation: every step schedules decodes and prefill chunks
of all live requests in one target forward and samples one token for each request whose prompt
is fully computed. The draft path (propose k tokens with the draft runner, verify k + 1 positions
with the target in one forward, roll both back with ``ModelRunner.truncate``) plugs in at
:meth:`SpeculativeRunner._generate_speculative`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..kv_cache import OutOfBlocksError
from ..engine import ModelRunner
from .proposer import DraftProposer
from .rejection_sampler import greedy_verify, random_verify
from .sampling import probabilities, request_generator, sample

MAX_SPECULATIVE_TOKENS = 32


@dataclass
class GenerationStats:
    """Counters of the last :meth:`SpeculativeRunner.generate` call."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_target_steps: int = 0
    num_draft_steps: int = 0
    target_time_s: float = 0.0
    draft_time_s: float = 0.0
    elapsed_s: float = 0.0
    num_verifications: int = 0                                        # request-steps the target verified
    num_draft_tokens: int = 0                                         # proposed by the draft
    num_accepted_tokens: int = 0                                      # of those, accepted
    accepted_per_position: list[int] = field(default_factory=list)    # [k]: accepted at position j
    proposed_per_position: list[int] = field(default_factory=list)    # [k]: proposed at position j
    failures: dict[int, str] = field(default_factory=dict)            # prompt index -> error

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None without a draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def mean_accepted_length(self) -> float | None:
        """Mean tokens a request gains per verification (accepted drafts + 1); None without a draft."""
        if not self.num_verifications:
            return None
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications


class GenerationError(RuntimeError):
    """Some requests failed (e.g. out of KV blocks); the others completed.

    ``outputs[i]`` is the generated token list of prompt ``i`` (None where it failed) and
    ``failures`` maps the failed prompt indices to their errors.
    """

    def __init__(self, outputs: list[list[int] | None], failures: dict[int, Exception]):
        self.outputs, self.failures = outputs, failures
        detail = "; ".join(f"prompt {i}: {e}" for i, e in sorted(failures.items()))
        super().__init__(f"{len(failures)} of {len(outputs)} requests failed: {detail}")


class ByteVocab:
    """Byte-level vocabulary of the shipped tiny models: ids 0..255 are bytes, plus BOS/EOS."""

    def __init__(self, bos: int | None, eos: int | None):
        self.bos, self.eos = bos, eos

    @classmethod
    def from_config(cls, spec: dict | None) -> "ByteVocab | None":
        if not spec or spec.get("type") != "bytes":
            return None
        return cls(spec.get("bos"), spec.get("eos"))

    def encode(self, text: str) -> list[int]:
        return ([] if self.bos is None else [self.bos]) + list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


class SpeculativeRunner:
    """Generate with a target model, speculatively with a draft when one is given.

    Args:
        target / draft: HF model directories (or loaded ``CausalLM`` s); ``draft=None`` is plain
            generation with the target.
        num_speculative_tokens: k, tokens the draft proposes per step (1..32).
        target_backend / draft_backend: backend name (or ``{group_id: name}``) per model; None
            dispatches (``KVMULTI_ATTENTION_BACKEND``, or ``KVMULTI_DRAFT_ATTENTION_BACKEND`` for
            the draft -- never inherited from the target).
        block_size, num_blocks, memory_bytes, max_num_batched_tokens: passed to each ModelRunner.
        kv_cache_dtype / draft_kv_cache_dtype: each model's KV cache dtype (ModelRunner's
            ``kv_cache_dtype``: "auto", "fp8_e4m3", "fp8_e5m2"); the draft's defaults to the target's.
    """

    def __init__(self, target, draft=None, num_speculative_tokens: int = 4, target_backend=None,
                 draft_backend=None, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 *, block_size=16, num_blocks=None, memory_bytes: int | None = None,
                 max_num_batched_tokens: int = 512, kv_cache_dtype: torch.dtype | str | None = None,
                 draft_kv_cache_dtype: torch.dtype | str | None = None):
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        self.num_speculative_tokens = k
        runner_args = dict(device=device, dtype=dtype, block_size=block_size, num_blocks=num_blocks,
                           memory_bytes=memory_bytes, max_num_batched_tokens=max_num_batched_tokens)
        # A speculative target rolls back up to k + 1 positions: keep that much sliding-window history.
        self.target = ModelRunner(target, role="target", backend=target_backend, kv_cache_dtype=kv_cache_dtype,
                                  rollback_tokens=0 if draft is None else k + 1, **runner_args)
        self.draft: ModelRunner | None = None
        self.proposer: DraftProposer | None = None
        if draft is not None:
            # Its own KV groups, its own backend per group (draft role: never the target's choice).
            draft_kv = kv_cache_dtype if draft_kv_cache_dtype is None else draft_kv_cache_dtype
            self.draft = ModelRunner(draft, role="draft", backend=draft_backend, rollback_tokens=k + 1,
                                     kv_cache_dtype=draft_kv, **runner_args)
            if self.draft.config.vocab_size != self.target.config.vocab_size:
                raise ValueError(f"draft and target must share the vocabulary: the draft has "
                                 f"{self.draft.config.vocab_size} tokens, the target "
                                 f"{self.target.config.vocab_size}")
            self.proposer = DraftProposer(self.draft, k)
        self.vocab = ByteVocab.from_config(self.target.config.byte_vocab)
        eos = self.target.config.eos_token_ids or (() if self.vocab is None or self.vocab.eos is None
                                                   else (self.vocab.eos,))
        self.eos_token_ids = frozenset(eos)
        self.stats = GenerationStats()
        self._call = itertools.count()

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: a list of ids as is, a str through the byte vocabulary."""
        if isinstance(prompt, str):
            if self.vocab is None:
                raise TypeError("str prompts need a byte-level model (config.json 'kvmulti_vocab'); "
                                "pass token-id lists for this model")
            return self.vocab.encode(prompt)
        return [int(t) for t in prompt]

    def decode(self, tokens: Sequence[int]) -> str:
        if self.vocab is None:
            raise TypeError("decode needs a byte-level model (config.json 'kvmulti_vocab')")
        return self.vocab.decode(tokens)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 32,
                 temperature: float = 0.0, seed: int = 0,
                 progress: Callable[[int, float], None] | None = None) -> list[list[int]]:
        """Generated token ids (prompt excluded, EOS included when hit) for each prompt.

        Greedy when ``temperature == 0``, else seeded sampling from softmax(logits / temperature).
        A request that fails (e.g. OutOfBlocksError) leaves the others running; after they finish
        a :class:`GenerationError` carries every output and the failures. ``progress(tokens
        generated so far, seconds elapsed)`` is called after every step.
        """
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts (str or token-id lists)")
        if max_new_tokens < 0 or temperature < 0:
            raise ValueError("max_new_tokens and temperature must be >= 0")
        token_lists = [self.encode(p) for p in prompts]
        self.stats = GenerationStats(num_requests=len(token_lists),
                                     num_prompt_tokens=sum(len(t) for t in token_lists))
        start = time.perf_counter()
        report = (lambda outs: progress(sum(len(o) for o in outs if o), time.perf_counter() - start)) \
            if progress is not None else (lambda outs: None)
        generate = self._generate_plain if self.draft is None else self._generate_speculative
        outputs, failures = generate(token_lists, max_new_tokens, temperature, seed, report)
        self.stats.elapsed_s = time.perf_counter() - start
        self.stats.num_generated_tokens = sum(len(o) for o in outputs if o is not None)
        self.stats.failures = {i: str(e) for i, e in failures.items()}
        if failures:
            raise GenerationError(outputs, failures)
        return outputs

    def _generate_plain(self, token_lists, max_new_tokens, temperature, seed, report):
        runner, call = self.target, next(self._call)
        outputs: list[list[int] | None] = [[] for _ in token_lists]
        failures: dict[int, Exception] = {}
        if max_new_tokens == 0:
            return outputs, failures
        index = {(call, i): i for i in range(len(token_lists))}
        generators = {rid: request_generator(seed, i) for rid, i in index.items()}
        live = set()
        try:
            for rid, i in index.items():
                runner.add_request(rid, token_lists[i])
                live.add(rid)
            while live:
                schedule = runner.schedule()
                done = [rid for rid, n in schedule.items() if runner.requests[rid].num_pending == n]
                t0 = time.perf_counter()
                try:
                    logits = runner.forward(schedule, {rid: 1 for rid in done})
                except OutOfBlocksError as err:
                    failures[index[err.req_id]] = err
                    outputs[index[err.req_id]] = None
                    runner.remove_request(err.req_id)
                    live.discard(err.req_id)
                    continue
                self.stats.target_time_s += time.perf_counter() - t0
                self.stats.num_target_steps += 1
                for rid, tok in zip(done, sample(logits, temperature, [generators[r] for r in done])):
                    out = outputs[index[rid]]
                    out.append(tok)
                    if tok in self.eos_token_ids or len(out) >= max_new_tokens:
                        runner.remove_request(rid)
                        live.discard(rid)
                    else:
                        runner.append_tokens(rid, [tok])
                report(outputs)
        finally:
            for rid in live:
                runner.remove_request(rid)
        return outputs, failures

    def _generate_speculative(self, token_lists, max_new_tokens, temperature, seed, report):
        """Each step: the draft proposes k tokens per live request (catching up first on the tokens
        accepted last step), the target scores k + 1 positions per request in ONE forward, the
        rejection sampler accepts a prefix plus one target token, and both runners roll back to the
        accepted length (rejected slots are overwritten later)."""
        target, draft, k, stats = self.target, self.draft, self.num_speculative_tokens, self.stats
        call = next(self._call)
        outputs: list[list[int] | None] = [[] for _ in token_lists]
        failures: dict[int, Exception] = {}
        stats.accepted_per_position, stats.proposed_per_position = [0] * k, [0] * k
        if max_new_tokens == 0:
            return outputs, failures
        index = {(call, i): i for i in range(len(token_lists))}
        generators = {rid: request_generator(seed, i) for rid, i in index.items()}
        live: list = []
        try:
            for rid, i in index.items():
                live.append(rid)
                target.add_request(rid, token_lists[i])
                draft.add_request(rid, token_lists[i])
            while live:
                lengths = {rid: len(target.requests[rid].tokens) for rid in live}
                gens = [generators[rid] for rid in live]
                t0 = time.perf_counter()
                try:
                    drafts, draft_probs = self.proposer.propose(live, temperature, gens)
                    t1 = time.perf_counter()
                    logits = target.run({rid: row for rid, row in zip(live, drafts.tolist())}, num_logits=k + 1)
                except OutOfBlocksError as err:
                    failures[index[err.req_id]] = err
                    outputs[index[err.req_id]] = None
                    live.remove(err.req_id)
                    self._remove(err.req_id)
                    self._undo_step(live, lengths)
                    continue
                t2 = time.perf_counter()
                stats.draft_time_s += t1 - t0
                stats.target_time_s += t2 - t1
                stats.num_draft_steps += k
                stats.num_target_steps += 1
                logits = logits.view(len(live), k + 1, -1)
                if temperature == 0:
                    verdict = greedy_verify(drafts, logits)
                else:
                    verdict = random_verify(drafts, draft_probs, probabilities(logits, temperature), gens)
                finished = []
                for row, rid in enumerate(live):
                    accepted, emitted = int(verdict.num_accepted[row]), verdict.emitted(row)
                    self._count(accepted)
                    out = outputs[index[rid]]
                    out.extend(self._clip(emitted, max_new_tokens - len(out)))
                    if len(out) >= max_new_tokens or out[-1] in self.eos_token_ids:
                        finished.append(rid)
                        continue
                    for runner in (target, draft):
                        runner.truncate(rid, lengths[rid] + accepted)
                        runner.append_tokens(rid, emitted[-1:])
                for rid in finished:
                    live.remove(rid)
                    self._remove(rid)
                report(outputs)
        finally:
            for rid in live:
                self._remove(rid)
        return outputs, failures

    def _clip(self, tokens: list[int], budget: int) -> list[int]:
        """``tokens`` cut to ``budget`` and after the first EOS (kept)."""
        tokens = tokens[:budget]
        for j, tok in enumerate(tokens):
            if tok in self.eos_token_ids:
                return tokens[: j + 1]
        return tokens

    def _count(self, accepted: int) -> None:
        stats, k = self.stats, self.num_speculative_tokens
        stats.num_verifications += 1
        stats.num_draft_tokens += k
        stats.num_accepted_tokens += accepted
        for j in range(k):
            stats.proposed_per_position[j] += 1
            stats.accepted_per_position[j] += j < accepted

    def _remove(self, rid) -> None:
        self.target.remove_request(rid)
        self.draft.remove_request(rid)

    def _undo_step(self, live: list, lengths: dict) -> None:
        """After a failed step: the target computed nothing (truncate drops the appended drafts);
        the draft may have computed proposals, so it restarts from the accepted tokens."""
        for rid in live:
            tokens = self.target.requests[rid].tokens[: lengths[rid]]
            self.target.truncate(rid, lengths[rid])
            self.draft.remove_request(rid)
            self.draft.add_request(rid, tokens)
