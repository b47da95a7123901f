"""Token sampling shared by plain and speculative generation: greedy or seeded temperature.

Every request samples from its own ``torch.Generator`` (seeded from the call's seed and the
request's index), so a request's tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

from typing import Sequence

import torch


def request_generator(seed: int, index: int) -> torch.Generator:
    """The CPU generator of request ``index`` in a call seeded with ``seed``."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + int(index)) % (2**63))


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature) in float32 over the last dimension (temperature > 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(logits: torch.Tensor, temperature: float, generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row of ``logits`` [R, V]: argmax when ``temperature == 0``, else a draw from
    softmax(logits / temperature) with row ``i``'s generator."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if logits.shape[0] != len(generators):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(generators)} generators")
    if temperature == 0:
        return logits.argmax(dim=-1).tolist()
    probs = probabilities(logits, temperature).cpu()
    return [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, generators)]
