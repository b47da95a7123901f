"""A NaN in a query row: that row's output is all NaN on every backend (as the math gives), and
every other row is exactly what it would be without it."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvmulti
from kvmulti import reference
from kvmulti.backends.cpu import CPUBackend
from kvmulti.backends.registry import get_backend

from batches import assert_close_to_reference, registered_backends

warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)

BACKENDS = registered_backends()


def _batch(dtype: torch.dtype, order: str):
    """Decode, verification and prefill rows in one batch; 4 query heads over 2 KV heads."""
    torch.manual_seed(3)
    query_lens, seq_lens = [1, 3, 9, 1], [40, 21, 9, 700]
    layout = kvmulti.KVCacheLayout(64, 16, 2, 64, dtype=dtype, order=order)
    table = torch.arange(64, dtype=torch.int32).view(1, 64).repeat(4, 1)
    for i in range(4):
        table[i] = torch.randperm(64, dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens(query_lens, seq_lens, table, 16)
    cache = layout.allocate("cpu")
    cache.copy_(torch.randn(layout.shape).to(dtype))
    query = torch.randn(md.num_actual_tokens, 4, 64).to(dtype)
    return layout, cache, query, md


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS + [f"{name}-split" for name in BACKENDS] + ["CPU-torch"])
def test_nan_query_row_gives_an_all_nan_output_row(backend, dtype, order):
    """``-split``: split-KV with 64-key partitions (the merge of partial rows carries the NaN)."""
    layout, cache, query, md = _batch(dtype, order)
    if backend == "CPU-torch":
        name = CPUBackend(native_kernel=False)
    elif backend.endswith("-split"):
        name = type(get_backend(backend[:-len("-split")]))(partition_size=64)
    else:
        name = backend
    expected = reference.paged_attention(query, cache, layout, md, sliding_window=None, softcap=None)
    poisoned = {(0, 1), (2, 3), (5, 0), (12, 2), (13, 3)}       # (row, head): decode, verify, prefill, long decode
    for row, head in poisoned:
        query[row, head, 7] = float("nan")
    out = kvmulti.paged_attention(query, cache, layout, md, backend=name)
    for row in range(query.shape[0]):
        for head in range(query.shape[1]):
            if (row, head) in poisoned:
                assert torch.isnan(out[row, head]).all(), (backend, row, head, out[row, head, :4])
            else:
                assert_close_to_reference(out[row, head], expected[row, head], dtype, f"{backend} row {row} head {head}")
