"""Cross-layer KV-cache allocations (vLLM's BLHNC, BLNHC, LHBNC, BHLNC) on every backend.

One allocation holds every layer's cache; a layer's cache is a view whose block (and head)
strides span the other layers. Each backend writes and attends over ONE layer of a three-layer
allocation full of random data: the write must equal the oracle's byte for byte and leave every
other layer untouched, and the attention must match the oracle's over the same view (mixed
batches: prefill, chunked prefill, verification, decode; GQA; windows; softcap; fp8).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from kvmulti.backends.cpu import CPUBackend
from kvmulti.layout import CROSS_LAYER_ORDERS, ORDERS, KVCacheLayout, token_order

from batches import CaseSpec, check_cross_layer, registered_backends

BACKENDS = [*registered_backends(), "CPU-torch"]
NUM_LAYERS = 3                  # as in batches.check_cross_layer
warnings.filterwarnings("ignore", "kvmulti HIP backend on a CPU tensor", RuntimeWarning)


@pytest.mark.parametrize("physical", CROSS_LAYER_ORDERS)
def test_layer_views_have_the_physical_strides_and_name_their_layout(physical):
    layout = KVCacheLayout(5, 4, 3, 8, head_size_v=6, dtype=torch.bfloat16, order=token_order(physical),
                           cross_layer_order=physical, num_layers=NUM_LAYERS)
    allocation = layout.allocate()
    assert allocation.shape == (NUM_LAYERS, *layout.shape)
    sizes = dict(B=5, L=NUM_LAYERS, H=3, N=4, C=14)
    # the physical tensor is contiguous in the named order
    physical_view = allocation.permute(*("LBNHC".index(c) for c in physical))
    assert physical_view.is_contiguous() and tuple(physical_view.shape) == tuple(sizes[c] for c in physical)
    for i in range(NUM_LAYERS):
        cache = layout.layer(allocation, i)
        assert cache.data_ptr() == allocation.data_ptr() + i * layout.layer_stride * 2
        assert tuple(layout.strides(cache)) == cache.stride()
        named = KVCacheLayout.of_view(cache, head_size=8)
        assert (named.cross_layer_order, named.order, named.head_size_v) == (physical, layout.order, 6)
        named.validate(cache)
    # another physical order's layer views are refused, never reinterpreted
    for other in CROSS_LAYER_ORDERS:
        if other != physical and token_order(other) == layout.order:
            with pytest.raises(ValueError, match="never reinterpreted"):
                dataclasses.replace(layout, cross_layer_order=other).validate(layout.layer(allocation, 1))


def test_per_layer_views_still_name_nhd_and_hnd():
    for order in ORDERS:
        layout = KVCacheLayout(4, 8, 2, 16, dtype=torch.float16, order=order)
        named = KVCacheLayout.of_view(layout.allocate(), 16)
        assert (named.order, named.cross_layer_order, named.num_layers) == (order, None, 1)
    with pytest.raises(ValueError, match="matches no kvmulti layout"):
        KVCacheLayout.of_view(torch.zeros(4, 8, 2, 32).transpose(0, 1).contiguous().transpose(0, 1), 16)


def test_cross_layer_arguments_are_checked():
    with pytest.raises(ValueError, match="needs a cross_layer_order"):
        KVCacheLayout(4, 8, 2, 16, num_layers=2)
    with pytest.raises(ValueError, match="order must be 'HND'"):
        KVCacheLayout(4, 8, 2, 16, cross_layer_order="BLHNC", num_layers=2)
    with pytest.raises(ValueError, match="cross_layer_order must be one of"):
        KVCacheLayout(4, 8, 2, 16, order="HND", cross_layer_order="LBHNC", num_layers=2)
    layout = KVCacheLayout(4, 8, 2, 16, order="HND", cross_layer_order="LHBNC", num_layers=2)
    with pytest.raises(IndexError):
        layout.layer(layout.allocate(), 2)
    with pytest.raises(ValueError, match="per-layer"):
        KVCacheLayout(4, 8, 2, 16).layer(torch.zeros(1), 0)


def backend_arg(backend: str):
    """The ops' ``backend`` argument: the registry name, or for ``CPU-torch`` a CPU backend object
    that runs the torch path."""
    return CPUBackend(native_kernel=False) if backend == "CPU-torch" else backend


SPECS = [  # (dtype, group, query lens, context lens, window, softcap, cache dtype)
    (torch.bfloat16, 4, (1, 5, 7), (40, 17, 0), None, None, None),
    (torch.float16, 2, (1, 1, 3), (33, 9, 20), 12, 25.0, None),
    (torch.float32, 1, (4, 1), (0, 30), None, 10.0, None),
    (torch.bfloat16, 2, (1, 3), (37, 12), 9, None, torch.float8_e4m3fn),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("physical", CROSS_LAYER_ORDERS)
def test_one_layer_of_a_cross_layer_allocation_matches_the_oracle(backend, physical):
    for n, (dtype, group, qlens, ctx, window, softcap, cache_dtype) in enumerate(SPECS):
        spec = CaseSpec(order=token_order(physical), block_size=16, num_kv_heads=2, group=group, head_size=64,
                        dtype=dtype, query_lens=qlens, context_lens=ctx, sliding_window=window, softcap=softcap,
                        extra_blocks=1, seed=n)
        check_cross_layer(spec, physical, backend_arg(backend), cache_dtype)
