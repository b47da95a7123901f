"""The CPU backend's native step calls (``StepMetadata.calls``, cpu/prepared_step.cpp).

A prepared layer call is checked in C++ and runs the kernel, or is refused (False) untouched and
goes through the Python checks: the result is the same either way, and a malformed call still gets
the Python error that names its argument.
"""

import dataclasses

import pytest
import torch

import kvmulti
from kvmulti import reference
from kvmulti.backends.cpu import CPUBackend

HQ, HKV, HEAD = 4, 2, 16


def make_case(dtype=torch.float32, order="NHD", query_lens=(3, 1, 1), seq_lens=(7, 9, 4), block_size=4):
    gen = torch.Generator().manual_seed(0)
    layout = kvmulti.KVCacheLayout(12, block_size, HKV, HEAD, dtype=dtype, order=order)
    cache = layout.allocate()
    cache.copy_(torch.randn(layout.shape, generator=gen).to(dtype))
    table = torch.randperm(12, generator=gen).to(torch.int32)[:9].view(3, 3)
    md = kvmulti.CommonAttentionMetadata.from_lens(list(query_lens), list(seq_lens), table, block_size)
    t = md.num_actual_tokens
    q = torch.randn(t, HQ, HEAD, generator=gen).to(dtype)
    k, v = (torch.randn(t, HKV, HEAD, generator=gen).to(dtype) for _ in range(2))
    return layout, cache, md, q, k, v


def python_step(step):
    """The same step without its native calls: the Python checks and the backend object run it."""
    return dataclasses.replace(step, calls=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_step_calls_exist_for_plain_caches_and_match_the_python_path(dtype, order):
    layout, cache, md, q, k, v = make_case(dtype, order)
    step = kvmulti.prepare_step(md, layout, HQ, backend="CPU", sliding_window=5)
    assert step.calls is not None
    other = cache.clone()
    kvmulti.write_kv(k, v, cache, layout, md.slot_mapping, step=step)
    kvmulti.write_kv(k, v, other, layout, md.slot_mapping, step=python_step(step))
    assert torch.equal(cache, other)
    out = torch.full((q.shape[0] + 2, HQ, HEAD), 7.0, dtype=dtype)     # padding rows: zeroed
    padded = torch.cat([q, torch.randn(2, HQ, HEAD).to(dtype)])
    assert step.calls.attend(padded, cache, out, 0.3, 2.0)
    expected = kvmulti.paged_attention(padded, cache, layout, python_step(step), scale=0.3, sliding_window=5,
                                       softcap=2.0)
    assert torch.equal(out, expected) and not out[q.shape[0]:].any()
    oracle = reference.paged_attention(q, cache, layout, md, scale=0.3, sliding_window=5, softcap=2.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:q.shape[0]].float(), oracle.float(), atol=tol, rtol=tol)
    fresh = kvmulti.paged_attention(q, cache, layout, step, scale=0.3, sliding_window=5, softcap=2.0)   # out=None
    assert torch.equal(fresh, expected[:q.shape[0]])


def test_no_step_calls_for_fp8_latent_or_the_torch_path():
    layout, cache, md, q, k, v = make_case()
    fp8 = kvmulti.KVCacheLayout(12, 4, HKV, HEAD, dtype=torch.float8_e4m3fn)
    assert kvmulti.prepare_step(md, fp8, HQ, backend="CPU").calls is None
    latent = kvmulti.KVCacheLayout(12, 4, 1, HEAD, head_size_v=0, dtype=torch.float32)
    assert kvmulti.prepare_step(md, latent, HQ, backend="CPU").calls is None
    assert CPUBackend(native_kernel=False).build_metadata(md, layout, HQ, None).calls is None


def refused(layout, cache, md, q, k, v):
    """(name, call) pairs of layer calls of another form than the step's: each must return False."""
    step = kvmulti.prepare_step(md, layout, HQ, backend="CPU")
    out = torch.zeros(q.shape[0], HQ, HEAD)
    wide = torch.zeros(q.shape[0], HQ, 2 * HEAD)
    other_order = kvmulti.KVCacheLayout(12, 4, HKV, HEAD, dtype=torch.float32, order="HND").allocate()
    a, w = step.calls.attend, step.calls.write
    slots = md.slot_mapping
    return step, {
        "query dtype": lambda: a(q.double(), cache, out, 0.25, 0.0),
        "query heads": lambda: a(q[:, :2], cache, out[:, :2], 0.25, 0.0),
        "query head size": lambda: a(torch.zeros(q.shape[0], HQ, 8), cache, out, 0.25, 0.0),
        "query rows short": lambda: a(q[:-1], cache, out[:-1], 0.25, 0.0),
        "query last dim strided": lambda: a(torch.zeros(q.shape[0], HQ, 2 * HEAD)[..., ::2], cache, out, 0.25, 0.0),
        "query 2-d": lambda: a(q.flatten(1), cache, out, 0.25, 0.0),
        "query on meta": lambda: a(q.to("meta"), cache, out, 0.25, 0.0),
        "out rows": lambda: a(q, cache, out[:-1], 0.25, 0.0),
        "out dtype": lambda: a(q, cache, out.double(), 0.25, 0.0),
        "out last dim strided": lambda: a(q, cache, wide[..., ::2], 0.25, 0.0),
        "cache of another order": lambda: a(q, other_order, out, 0.25, 0.0),
        "cache cut": lambda: a(q, cache[:6], out, 0.25, 0.0),
        "cache dtype": lambda: a(q, cache.double(), out, 0.25, 0.0),
        "scale nan": lambda: a(q, cache, out, float("nan"), 0.0),
        "scale inf": lambda: a(q, cache, out, float("inf"), 0.0),
        "softcap negative": lambda: a(q, cache, out, 0.25, -1.0),
        "softcap nan": lambda: a(q, cache, out, 0.25, float("nan")),
        "slot out of range": lambda: w(k, v, cache, torch.tensor([0, 1, 48, 2, 3])),
        "slot below -1": lambda: w(k, v, cache, torch.tensor([0, -2, 1, 2, 3])),
        "slots short": lambda: w(k, v, cache, slots[:-1]),
        "slots float": lambda: w(k, v, cache, slots.float()),
        "slots strided": lambda: w(k, v, cache, torch.stack([slots, slots], 1)[:, 0]),
        "key dtype": lambda: w(k.double(), v, cache, slots),
        "key heads": lambda: w(k[:, :1], v, cache, slots),
        "value rows": lambda: w(k, v[:-1], cache, slots),
        "value head size": lambda: w(k, torch.zeros(k.shape[0], HKV, 8), cache, slots),
        "write cache of another order": lambda: w(k, v, other_order, slots),
    }


def test_calls_of_another_form_are_refused_untouched():
    layout, cache, md, q, k, v = make_case()
    step, cases = refused(layout, cache, md, q, k, v)
    before = cache.clone()
    for name, call in cases.items():
        assert call() is False, name
        assert torch.equal(cache, before), name
    assert step.calls.checked_slot_tensors == 0


def test_public_ops_still_run_or_name_what_is_wrong_when_the_native_calls_refuse():
    layout, cache, md, q, k, v = make_case()
    step = kvmulti.prepare_step(md, layout, HQ, backend="CPU")
    py = python_step(step)
    strided_q = torch.zeros(q.shape[0], HQ, 2 * HEAD)[..., ::2]
    strided_q.copy_(q)
    assert torch.equal(kvmulti.paged_attention(strided_q, cache, layout, step),      # run the Python way
                       kvmulti.paged_attention(q, cache, layout, py))
    strided_out = torch.zeros(q.shape[0], HQ, 2 * HEAD)[..., ::2]
    kvmulti.paged_attention(q, cache, layout, step, out=strided_out)
    assert torch.equal(strided_out, kvmulti.paged_attention(q, cache, layout, py))
    before = cache.clone()
    with pytest.raises(ValueError, match="slot 48"):
        kvmulti.write_kv(k, v, cache, layout, torch.tensor([0, 1, 48, 2, 3]), step=step)
    with pytest.raises(TypeError, match="query has dtype"):
        kvmulti.paged_attention(q.double(), cache, layout, step)
    with pytest.raises(ValueError, match="softcap"):
        kvmulti.paged_attention(q, cache, layout, step, softcap=-1.0)
    with pytest.raises(ValueError, match="scale"):
        kvmulti.paged_attention(q, cache, layout, step, scale=float("nan"))
    assert torch.equal(cache, before)
    int32_slots = md.slot_mapping.to(torch.int32)                     # accepted, like int64
    assert step.calls.write(k, v, cache, int32_slots)
    other = before.clone()
    kvmulti.write_kv(k, v, other, layout, md.slot_mapping, step=py)
    assert torch.equal(cache, other)
