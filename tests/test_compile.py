"""The public ops are torch.library custom ops: torch.compile(fullgraph=True) traces them."""

import pytest
import torch

import kvmulti
from kvmulti import reference


@pytest.mark.parametrize("cross_layer_order", [None, "BHLNC"])
def test_compile_fullgraph_write_and_attend(cross_layer_order):
    layout = kvmulti.KVCacheLayout(4, 4, 2, 16, dtype=torch.float32, order="HND",
                                   cross_layer_order=cross_layer_order, num_layers=2 if cross_layer_order else 1)
    cache = layout.layer(layout.allocate(), 1) if cross_layer_order else layout.allocate()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([5, 1], [5, 7], table, block_size=4)
    cache.copy_(torch.randn(layout.shape))
    q, k, v = torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)

    def step(q, k, v, cache):
        kvmulti.write_kv(k, v, cache, layout, md.slot_mapping)
        return kvmulti.paged_attention(q * 2, cache, layout, md, sliding_window=3) + 1

    # a copy with the same strides (for a cross-layer layout: the same layer of another allocation)
    expected_cache = layout.layer(layout.allocate(), 1) if cross_layer_order else layout.allocate()
    expected_cache.copy_(cache)
    reference.write_kv(k, v, expected_cache, layout, md.slot_mapping)
    expected = reference.paged_attention(q * 2, expected_cache, layout, md, sliding_window=3) + 1
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, cache)
    torch.testing.assert_close(cache, expected_cache)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_ops_are_registered():
    import kvmulti.ops  # noqa: F401  (the package imports its modules at first use)
    assert hasattr(torch.ops.kvmulti, "write_kv") and hasattr(torch.ops.kvmulti, "paged_attention")


def test_compile_fullgraph_prepared_layer_call():
    """A prepared step's layer calls (the fast-checked eager path) trace with fullgraph too: under
    torch.compile they go through the custom ops, never through the fast checks."""
    layout = kvmulti.KVCacheLayout(4, 4, 2, 16, dtype=torch.float32, order="HND")
    cache = layout.allocate()
    cache.copy_(torch.randn(layout.shape))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([5, 1], [5, 7], table, block_size=4)
    q, k, v = torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    prepared = kvmulti.prepare_step(md, layout, 4, backend="CPU")

    def layer(q, k, v, cache, out):
        kvmulti.write_kv(k, v, cache, layout, md.slot_mapping, step=prepared)
        return kvmulti.paged_attention(q, cache, layout, prepared, out=out)

    expected_cache = cache.clone()
    reference.write_kv(k, v, expected_cache, layout, md.slot_mapping)
    expected = reference.paged_attention(q, expected_cache, layout, md)
    out = torch.zeros(6, 4, 16)
    torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v, cache, out)
    torch.testing.assert_close(cache, expected_cache)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_compiled_layers_prepare_their_step_once(monkeypatch):
    """Under torch.compile every layer's custom op gets the metadata tensors; the layers of one
    forward share one prepared step, and a step's metadata changed in place is prepared again."""
    import kvmulti.ops as ops
    layout = kvmulti.KVCacheLayout(4, 4, 2, 16, dtype=torch.float32, order="HND")
    caches = [layout.allocate() for _ in range(3)]
    for cache in caches:
        cache.copy_(torch.randn(layout.shape))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([5, 1], [5, 7], table, block_size=4)
    q = torch.randn(6, 4, 16)
    kvmulti.paged_attention(q, caches[0], layout, md)          # eager: the backend's selection made
    prepared = []
    real_prepare = ops.prepare_step
    monkeypatch.setattr(ops, "prepare_step", lambda *a, **k: prepared.append(1) or real_prepare(*a, **k))

    def forward(q):
        return [kvmulti.paged_attention(q, cache, layout, md) for cache in caches]

    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    for out, cache in zip(compiled(q), caches):
        torch.testing.assert_close(out, reference.paged_attention(q, cache, layout, md), atol=2e-5, rtol=2e-5)
    assert len(prepared) == 1
    compiled(q)
    assert len(prepared) == 1
    md.seq_lens.copy_(torch.tensor([5, 6], dtype=torch.int32))     # in place: the next step's lengths
    md.seq_lens_cpu.copy_(md.seq_lens)
    compiled(q)
    assert len(prepared) == 2
