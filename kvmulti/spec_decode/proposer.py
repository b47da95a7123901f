"""The draft-model proposer: k tokens per request from a draft ModelRunner."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from ..engine import ModelRunner
from .sampling import probabilities


class DraftProposer:
    """Proposes ``k`` tokens per request with its own draft runner (own KV groups, own backends).

    Invariant between steps: each request's draft state holds every accepted token, the ones it
    has not computed yet pending (the first proposal forward catches up on them).
    """

    def __init__(self, runner: ModelRunner, k: int):
        self.runner, self.k = runner, k

    def propose(self, req_ids: Sequence[Hashable], temperature: float,
                generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens int64 [B, k] and, when sampling (temperature > 0), the draft's probabilities
        [B, k, V] they were drawn from. The proposals are appended to the draft's requests (the
        last one not yet computed); ``runner.truncate`` undoes what the target rejects."""
        tokens, probs = [], []
        new: dict[Hashable, list[int]] = {rid: [] for rid in req_ids}
        for _ in range(self.k):
            logits = self.runner.run(new, num_logits=1)                       # [B, V]
            if temperature == 0:
                proposal = logits.argmax(dim=-1)
            else:
                p = probabilities(logits, temperature)
                probs.append(p)
                proposal = torch.stack([torch.multinomial(row, 1, generator=g).squeeze(0)
                                        for row, g in zip(p.cpu(), generators)]).to(logits.device)
            tokens.append(proposal)
            new = {rid: [int(t)] for rid, t in zip(req_ids, proposal.tolist())}
        for rid, last in new.items():
            self.runner.append_tokens(rid, last)
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)
