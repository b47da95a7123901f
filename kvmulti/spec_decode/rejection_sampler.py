"""Exact speculative-decoding verification, vectorised over the batch.

Greedy: accept draft tokens while they equal the target's argmax. Random: accept draft token x
with probability min(1, p_target(x) / p_draft(x)); at the first rejection sample the recovered token
from normalise(max(p_target - p_draft, 0)). When all k are accepted the target's distribution at
position k gives a bonus token. The accepted tokens are distributed exactly as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

#: One generator for the whole batch (vectorised draws) or one per request (a request's draws do
#: not depend on its batch-mates), or None for torch's global generator.
Generators = torch.Generator | Sequence[torch.Generator] | None


@dataclass
class Verdict:
    """``tokens`` [B, k + 1] int64: accepted tokens then the recovered/bonus one, -1 after;
    ``num_accepted`` [B]: how many draft tokens each request accepted (0 .. k)."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    def emitted(self, row: int) -> list[int]:
        """Tokens request ``row`` emits this step: its accepted drafts plus one target token."""
        return self.tokens[row, : int(self.num_accepted[row]) + 1].tolist()


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """draft_tokens [B, k] int64; target_logits [B, k + 1, V] (position i scores token i)."""
    target_tokens = target_logits.argmax(dim=-1)                               # [B, k + 1]
    k = draft_tokens.shape[1]
    matches = (draft_tokens == target_tokens[:, :k]).int()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)                          # leading matches
    return Verdict(_mask_after(target_tokens, num_accepted), num_accepted)


def random_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                  generator: Generators = None) -> Verdict:
    """draft_tokens [B, k]; draft_probs [B, k, V] (the distributions the drafts were sampled from);
    target_probs [B, k + 1, V]. Probabilities, not logits, both at the sampling temperature."""
    batch, k = draft_tokens.shape
    index = draft_tokens.unsqueeze(-1)
    p_target = target_probs[:, :k].gather(-1, index).squeeze(-1)
    p_draft = draft_probs.gather(-1, index).squeeze(-1)
    uniform = _uniform(batch, k, generator, draft_tokens.device)
    accepted = (uniform * p_draft < p_target).int()                            # u < p_t / p_d without dividing
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)

    residual = (target_probs[:, :k] - draft_probs).clamp_(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0                               # p_t == p_d: never rejected
    residual = torch.where(empty, target_probs[:, :k], residual)
    # Row k is the bonus distribution: the target's own at position k.
    final = torch.cat([residual, target_probs[:, k:]], dim=1)                 # [B, k + 1, V]
    chosen = final[torch.arange(batch, device=final.device), num_accepted]    # [B, V]
    extra = _multinomial(chosen, generator)
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)
    tokens[torch.arange(batch, device=tokens.device), num_accepted] = extra
    return Verdict(_mask_after(tokens, num_accepted), num_accepted)


def _mask_after(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    return tokens.masked_fill(positions[None, :] > num_accepted[:, None], -1)


def _uniform(batch: int, k: int, generator: Generators, device: torch.device) -> torch.Tensor:
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(batch, k, generator=generator, device=device)
    return torch.stack([torch.rand(k, generator=g) for g in generator]).to(device)


def _multinomial(probs: torch.Tensor, generator: Generators) -> torch.Tensor:
    """One draw per row of probs [B, V]."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    rows = probs.cpu()
    return torch.tensor([int(torch.multinomial(p, 1, generator=g)) for p, g in zip(rows, generator)],
                        device=probs.device)
