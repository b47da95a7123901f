"""The CPU backend against the oracle over hypothesis-generated mixed batches."""

import pytest
import torch
from hypothesis import given, settings
from tiers import examples

from batches import CaseSpec, batch_cases, check_against_reference


@settings(max_examples=examples(120))
@given(batch_cases(head_sizes=(16, 64, 80)))
def test_cpu_matches_reference(spec):
    check_against_reference(spec, "CPU")


@pytest.mark.parametrize("block_size,num_blocks_expected", [(32, 1), (16, 2)])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_tiny_caches(order, block_size, num_blocks_expected):
    spec = CaseSpec(order=order, block_size=block_size, num_kv_heads=2, group=4, head_size=64, dtype=torch.float32,
                    query_lens=(5,) if num_blocks_expected == 1 else (3, 1), context_lens=(20,) if num_blocks_expected == 1 else (0, 9),
                    sliding_window=None)
    check_against_reference(spec, "CPU")


def test_block_size_equals_num_kv_heads_and_single_head():
    for heads in (1, 4):
        spec = CaseSpec(order="HND", block_size=4, num_kv_heads=heads, group=2, head_size=32, dtype=torch.float16,
                        query_lens=(6, 1, 2), context_lens=(0, 13, 7), sliding_window=5, softcap=10.0)
        check_against_reference(spec, "CPU")


def test_head_size_v_differs():
    spec = CaseSpec(order="NHD", block_size=16, num_kv_heads=2, group=2, head_size=64, head_size_v=32,
                    dtype=torch.float32, query_lens=(4, 1), context_lens=(10, 40))
    check_against_reference(spec, "CPU")


def test_memory_chunking_matches(monkeypatch):
    from kvmulti.backends.cpu import torch_path
    from kvmulti.backends.registry import get_backend
    monkeypatch.setattr(get_backend("CPU"), "native_kernel", False)   # the torch path is the one that chunks
    monkeypatch.setattr(torch_path, "SCORE_BUDGET_BYTES", 1)   # one request per chunk
    spec = CaseSpec(order="HND", block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=torch.bfloat16,
                    query_lens=(7, 1, 1, 12), context_lens=(0, 50, 3, 30), sliding_window=20)
    check_against_reference(spec, "CPU")
