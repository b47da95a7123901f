"""The steps of the ``torch.compile`` path, prepared once per step instead of once per layer.

Under ``torch.compile`` a layer's attention is the ``kvmulti::paged_attention`` custom op, which
receives the metadata as tensors and scalars, not the :class:`~kvmulti.backends.StepMetadata` the
eager layers share. Every layer of one forward passes the very same tensors with the same values,
so :class:`StepCache` keeps the steps it prepared for the last few metadata it saw: a later call
with the same tensor objects, unchanged (torch's version counter of each) and the same scalars
reuses the step; anything else prepares a new one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from .backends.base import StepMetadata


class StepCache:
    """Steps by (scalars, tensor identities), each valid while its tensors are unchanged."""

    def __init__(self, size: int = 8):
        self.size = size
        self._steps: OrderedDict[tuple, tuple[tuple[torch.Tensor, ...], tuple[int, ...], StepMetadata]] = OrderedDict()

    def get(self, tensors: tuple[torch.Tensor, ...], scalars: Hashable,
            prepare: Callable[[], StepMetadata]) -> StepMetadata:
        """The step ``prepare()`` made for these very ``tensors`` (unchanged since) and ``scalars``,
        else a new one from ``prepare()``. The cache holds the tensors, so their ids stay theirs."""
        key = (scalars, *map(id, tensors))
        versions = tuple(t._version for t in tensors)
        found = self._steps.get(key)
        if found is not None and found[1] == versions and all(a is b for a, b in zip(found[0], tensors)):
            self._steps.move_to_end(key)
            return found[2]
        step = prepare()
        self._steps[key] = (tensors, versions, step)
        self._steps.move_to_end(key)
        while len(self._steps) > self.size:
            self._steps.popitem(last=False)
        return step
