"""Every bad input gets a TypeError/ValueError naming the argument, and leaves the cache untouched."""

import dataclasses

import pytest
import torch

import kvmulti
from kvmulti.backends.registry import backend_names

LAYOUT = kvmulti.KVCacheLayout(num_blocks=4, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32, order="HND")


def fresh():
    cache = LAYOUT.allocate()
    cache.copy_(torch.randn(LAYOUT.shape))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([3, 1], [6, 5], table, block_size=4)
    t = md.num_actual_tokens
    return cache, md, torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)


def write_case(change):
    cache, md, q, k, v = fresh()
    args = dict(key=k, value=v, kv_cache=cache, layout=LAYOUT, slot_mapping=md.slot_mapping)
    args.update(change(args))
    return cache, args


WRITE_ERRORS = {
    "wrong dtype": (lambda a: {"key": a["key"].half()}, TypeError, "key has dtype"),
    "wrong head size": (lambda a: {"value": torch.randn(4, 2, 6)}, ValueError, "value has head size 6"),
    "wrong num heads": (lambda a: {"key": torch.randn(4, 3, 8)}, ValueError, "key has 3 heads"),
    "cache of other order": (lambda a: {"kv_cache": kvmulti.KVCacheLayout(4, 4, 2, 8, dtype=torch.float32, order="NHD").allocate()},
                             ValueError, "kv_cache has strides"),
    "non-matching layout": (lambda a: {"layout": kvmulti.KVCacheLayout(8, 4, 2, 8, dtype=torch.float32, order="HND")},
                            ValueError, "kv_cache has shape"),
    "slot out of range": (lambda a: {"slot_mapping": torch.tensor([0, 1, 16, 2])}, ValueError, "slot 16"),
    "slot below -1": (lambda a: {"slot_mapping": torch.tensor([0, -2, 1, 2])}, ValueError, "slot -2"),
    "float slots": (lambda a: {"slot_mapping": a["slot_mapping"].float()}, TypeError, "slot_mapping must be an integer"),
    "slots length": (lambda a: {"slot_mapping": a["slot_mapping"][:2]}, ValueError, "slot_mapping has 2 entries"),
    "device": (lambda a: {"key": a["key"].to("meta")}, ValueError, "key is on meta"),
    "layout type": (lambda a: {"layout": "HND"}, TypeError, "layout must be"),
}


@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "step"])
@pytest.mark.parametrize("name", WRITE_ERRORS)
def test_write_kv_rejects(name, prepared):
    change, error, message = WRITE_ERRORS[name]
    cache, args = write_case(change)
    if prepared:       # a prepared step's write checks the same (slot values once per step and slot tensor)
        _, md, *_ = fresh()
        args["step"] = kvmulti.prepare_step(md, LAYOUT, 4)
    before = args["kv_cache"].clone()
    with pytest.raises(error, match=message):
        kvmulti.write_kv(**args)
    assert torch.equal(args["kv_cache"], before)
    assert args["kv_cache"] is not cache or torch.equal(cache, before)


def replace_md(md, **fields):
    import dataclasses
    return dataclasses.replace(md, **fields)


ATTN_ERRORS = {
    "wrong dtype": (lambda a: {"query": a["query"].bfloat16()}, TypeError, "query has dtype"),
    "wrong head size": (lambda a: {"query": torch.randn(4, 4, 16)}, ValueError, "query has head size 16"),
    "heads not multiple": (lambda a: {"query": torch.randn(4, 3, 8)}, ValueError, "not a multiple of num_kv_heads"),
    "cache of other order": (lambda a: {"kv_cache": kvmulti.KVCacheLayout(4, 4, 2, 8, dtype=torch.float32, order="NHD").allocate()},
                             ValueError, "kv_cache has strides"),
    "block id out of range": (lambda a: {"metadata": replace_md(a["metadata"], block_table=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32))},
                              ValueError, r"block_table\[0, 1\] = 9"),
    "query_len > seq_len": (lambda a: {"metadata": replace_md(a["metadata"], seq_lens=torch.tensor([2, 5], dtype=torch.int32), seq_lens_cpu=None)},
                            ValueError, "query_len 3 > seq_len 2"),
    "block table too narrow": (lambda a: {"metadata": replace_md(a["metadata"], block_table=torch.tensor([[0], [2]], dtype=torch.int32))},
                               ValueError, "too narrow"),
    "float block table": (lambda a: {"metadata": replace_md(a["metadata"], block_table=a["metadata"].block_table.float())},
                          TypeError, "metadata.block_table must be an integer"),
    "int64 seq_lens": (lambda a: {"metadata": replace_md(a["metadata"], seq_lens=a["metadata"].seq_lens.long())},
                       TypeError, "metadata.seq_lens must be an integer tensor of torch.int32"),
    "device": (lambda a: {"query": a["query"].to("meta")}, ValueError, "query is on meta"),
    "bad window": (lambda a: {"sliding_window": 0}, ValueError, "sliding_window"),
    "bad softcap": (lambda a: {"softcap": -1.0}, ValueError, "softcap"),
    "too few query rows": (lambda a: {"query": a["query"][:2]}, ValueError, "num_actual_tokens"),
}


@pytest.mark.parametrize("name", ATTN_ERRORS)
def test_paged_attention_rejects(name):
    change, error, message = ATTN_ERRORS[name]
    cache, md, q, _, _ = fresh()
    args = dict(query=q, kv_cache=cache, layout=LAYOUT, metadata=md)
    args.update(change(args))
    before = args["kv_cache"].clone()
    with pytest.raises(error, match=message):
        kvmulti.paged_attention(**args)
    assert torch.equal(args["kv_cache"], before)


PREPARED_ATTN_ERRORS = {name: ATTN_ERRORS[name] for name in (
    "wrong dtype", "wrong head size", "heads not multiple", "cache of other order", "device", "bad window",
    "bad softcap")} | {
    "too few query rows": (lambda a: {"query": a["query"][:2], "out": a["out"][:2]}, ValueError, "num_actual_tokens"),
    "heads not the step's": (lambda a: {"query": torch.randn(4, 2, 8), "out": torch.zeros(4, 2, 8)}, ValueError,
                             "query has 2 heads, metadata was prepared for 4"),
    "out shape": (lambda a: {"out": torch.zeros(4, 4, 4)}, ValueError, "out has shape"),
    "out dtype": (lambda a: {"out": torch.zeros(4, 4, 8, dtype=torch.float64)}, TypeError, "out has dtype"),
    "out device": (lambda a: {"out": torch.zeros(4, 4, 8, device="meta")}, ValueError, "out is on meta"),
    "nan scale": (lambda a: {"scale": float("nan")}, ValueError, "scale must be finite"),
    "scale type": (lambda a: {"scale": "0.5"}, TypeError, "scale must be a float"),
    "inf softcap": (lambda a: {"softcap": float("inf")}, ValueError, "softcap"),
    "other window": (lambda a: {"sliding_window": 3}, ValueError, "prepared for sliding_window=None"),
    "other backend": (lambda a: {"backend": "TRITON"}, ValueError, "prepared by CPU"),
}


@pytest.mark.parametrize("name", PREPARED_ATTN_ERRORS)
def test_prepared_paged_attention_rejects(name):
    """A layer call with a prepared step and an ``out=`` buffer (the fast path's case) refuses what
    the full checks refuse, by name, before any kernel runs."""
    change, error, message = PREPARED_ATTN_ERRORS[name]
    cache, md, q, _, _ = fresh()
    out = torch.full((q.shape[0], 4, 8), 7.0)
    args = dict(query=q, kv_cache=cache, layout=LAYOUT, metadata=kvmulti.prepare_step(md, LAYOUT, 4, backend="CPU"),
                out=out)
    args.update(change(args))
    before, out_before = args["kv_cache"].clone(), args["out"].clone()
    with pytest.raises(error, match=message):
        kvmulti.paged_attention(**args)
    assert torch.equal(args["kv_cache"], before)
    if args["out"].device.type == "cpu":
        assert torch.equal(args["out"], out_before)


def test_prepared_fast_path_equals_the_checked_path():
    """The prepared layer call (fast checks) gives what the fully checked call gives, with and
    without ``out=``: default and explicit scales, softcap 0.0 = off, rows past num_actual_tokens
    zeroed; an equal layout that is another object takes the full checks and the same result."""
    import dataclasses
    cache, md, q, k, v = fresh()
    padded = torch.cat([q, torch.randn(2, 4, 8)])
    step = kvmulti.prepare_step(md, LAYOUT, 4, backend="CPU")
    twin = dataclasses.replace(LAYOUT)
    assert twin == LAYOUT and twin is not LAYOUT
    for kwargs in ({}, {"scale": 0.3}, {"softcap": 0.0}, {"softcap": 5.0, "scale": 0.2}):
        want = kvmulti.paged_attention(padded, cache, LAYOUT, md, backend="CPU", **kwargs)
        for layout in (LAYOUT, twin):
            out = torch.full_like(want, 7.0)
            got = kvmulti.paged_attention(padded, cache, layout, step, out=out, **kwargs)
            assert got is out and torch.equal(out, want), kwargs
            assert torch.all(out[md.num_actual_tokens:] == 0)
            assert torch.equal(kvmulti.paged_attention(padded, cache, layout, step, **kwargs), want), kwargs
    written = LAYOUT.allocate().zero_()
    kvmulti.write_kv(k, v, written, LAYOUT, md.slot_mapping, step=step)
    expected = LAYOUT.allocate().zero_()
    kvmulti.write_kv(k, v, expected, LAYOUT, md.slot_mapping, backend="CPU")
    assert torch.equal(written, expected) and written.abs().sum() > 0


FP8_LAYOUT = kvmulti.KVCacheLayout(num_blocks=4, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float8_e4m3fn)


def test_fp8_activations_into_an_fp8_cache_are_refused_by_name():
    """fp8 keys, values or queries for an fp8 cache: the write and attention checks (their common-case
    fast paths included) raise TypeError naming the argument before any kernel runs."""
    cache = FP8_LAYOUT.allocate()
    before = cache.clone()
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([1, 1], [6, 5], table, block_size=4)
    k = torch.randn(2, 2, 8)
    for key, value, name in ((k.to(torch.float8_e4m3fn), k, "key"), (k, k.to(torch.float8_e4m3fn), "value")):
        with pytest.raises(TypeError, match=f"{name} has dtype"):
            kvmulti.write_kv(key, value, cache, FP8_LAYOUT, md.slot_mapping)
    with pytest.raises(TypeError, match="query has dtype"):
        kvmulti.paged_attention(torch.randn(2, 4, 8).to(torch.float8_e4m3fn), cache, FP8_LAYOUT, md)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def _prepare(md, native_calls):
    """A step whose layer calls take the CPU backend's native checks, or (False) the Python ones."""
    step = kvmulti.prepare_step(md, LAYOUT, 4, backend="CPU")
    if not native_calls:
        step.calls = None
    return step


@pytest.mark.parametrize("native_calls", [True, False], ids=["native calls", "python checks"])
def test_write_with_a_step_checks_slot_values_once_per_step_and_slot_tensor(monkeypatch, native_calls):
    from kvmulti import validation
    calls = []
    check = validation.check_slot_values
    monkeypatch.setattr(validation, "check_slot_values",
                        lambda slots, layout: (calls.append(slots), check(slots, layout)))
    cache, md, _, k, v = fresh()
    step = _prepare(md, native_calls)
    assert (step.calls is not None) == native_calls        # the native kernel builds on every CI host
    checked = (lambda: step.calls.checked_slot_tensors) if native_calls else (lambda: len(calls))
    for _ in range(4):                                   # four layers of one group
        kvmulti.write_kv(k, v, cache, LAYOUT, md.slot_mapping, step=step)
    assert checked() == 1
    bad = md.slot_mapping.clone()
    bad[1] = LAYOUT.num_slots
    before = cache.clone()
    with pytest.raises(ValueError, match=f"slot {LAYOUT.num_slots}"):     # another tensor: checked
        kvmulti.write_kv(k, v, cache, LAYOUT, bad, step=step)
    assert torch.equal(cache, before) and len(calls) == 1 + (not native_calls)
    step = _prepare(md, native_calls)
    kvmulti.write_kv(k, v, cache, LAYOUT, md.slot_mapping, step=step)
    assert (checked() == 1 and len(calls) == 1) if native_calls else len(calls) == 3   # a new step checks again
    other = kvmulti.KVCacheLayout(4, 4, 2, 8, dtype=torch.float32, order="NHD")
    with pytest.raises(ValueError, match="step was prepared for another layout"):
        kvmulti.write_kv(k, v, other.allocate(), other, md.slot_mapping, step=step)
    with pytest.raises(TypeError, match="step must be a StepMetadata"):
        kvmulti.write_kv(k, v, cache, LAYOUT, md.slot_mapping, step=md)


def test_unknown_backend_argument():
    cache, md, q, k, v = fresh()
    with pytest.raises(ValueError, match="valid names: " + ", ".join(backend_names())):
        kvmulti.paged_attention(q, cache, LAYOUT, md, backend="CUDNN")


def test_metadata_checked_again_after_in_place_change():
    """The per-step check is cached across layers, but a modified block table is checked anew."""
    cache, md, q, _, _ = fresh()
    kvmulti.paged_attention(q, cache, LAYOUT, md)
    kvmulti.paged_attention(q, cache, LAYOUT, md)            # cached: same tensors, same versions
    md.block_table[0, 1] = 9
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 9"):
        kvmulti.paged_attention(q, cache, LAYOUT, md)


def test_metadata_checked_again_after_in_place_change_in_inference_mode():
    with torch.inference_mode():
        cache, md, q, _, _ = fresh()
        kvmulti.paged_attention(q, cache, LAYOUT, md)
        md.block_table[1, 0] = -3
        with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -3"):
            kvmulti.paged_attention(q, cache, LAYOUT, md)


def test_lengths_edited_through_a_numpy_view_are_checked_again():
    cache, md, q, _, _ = fresh()
    kvmulti.paged_attention(q, cache, LAYOUT, md)
    md.seq_lens_cpu.numpy()[1] = 0                        # below its query_len 1; no torch version bump
    with pytest.raises(ValueError, match="request 1 has query_len 1 > seq_len 0"):
        kvmulti.paged_attention(q, cache, LAYOUT, md)


def two_groups(block_table_b=None):
    """Two KV-cache groups of one step (block sizes 4 and 8) sharing the length tensors, as an
    engine's are; group "b"'s block table may be replaced."""
    _, md, q, _, _ = fresh()
    layout_b = kvmulti.KVCacheLayout(num_blocks=2, block_size=8, num_kv_heads=2, head_size=8,
                                     dtype=torch.float32, order="HND")
    table_b = torch.tensor([[0], [1]], dtype=torch.int32) if block_table_b is None else block_table_b
    md_b = dataclasses.replace(md, block_table=table_b, slot_mapping=md.slot_mapping.clone())
    return {"a": md, "b": md_b}, {"a": LAYOUT, "b": layout_b}, q


def test_prepare_steps_checks_shared_lengths_once_and_each_block_table(monkeypatch):
    import kvmulti.ops as ops
    from kvmulti import validation
    calls, real = [], validation.check_lengths
    monkeypatch.setattr(ops, "check_lengths", lambda *a: calls.append(a) or real(*a))
    metadata, layouts, q = two_groups()
    steps = kvmulti.prepare_steps(metadata, layouts, 4)
    assert len(calls) == 1 and set(steps) == {"a", "b"}
    for g in steps:
        cache = layouts[g].allocate()
        cache.copy_(torch.randn(layouts[g].shape))
        want = kvmulti.paged_attention(q, cache, layouts[g], metadata[g])
        torch.testing.assert_close(kvmulti.paged_attention(q, cache, layouts[g], steps[g]), want)
    narrow, _, _ = two_groups(torch.tensor([[0], [1]], dtype=torch.int32))
    narrow["b"] = dataclasses.replace(narrow["b"], block_table=torch.tensor([[0]], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table has 1 rows for 2 requests"):
        kvmulti.prepare_steps(narrow, layouts, 4)
    bad_id, _, _ = two_groups(torch.tensor([[0], [5]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 5"):
        kvmulti.prepare_steps(bad_id, layouts, 4)


def test_prepare_steps_checks_groups_with_their_own_lengths_each():
    metadata, layouts, _ = two_groups()
    other = metadata["b"]
    metadata["b"] = dataclasses.replace(other, seq_lens_cpu=torch.tensor([6, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="request 1 has query_len 1 > seq_len 0"):
        kvmulti.prepare_steps(metadata, layouts, 4)
    with pytest.raises(KeyError):
        kvmulti.prepare_steps({"c": other}, layouts, 4)
    with pytest.raises(TypeError, match="metadata must be a kvmulti.CommonAttentionMetadata"):
        kvmulti.prepare_steps({"a": object()}, layouts, 4)
    with pytest.raises(ValueError, match="num_query_heads must be a positive multiple"):
        kvmulti.prepare_steps(metadata, layouts, 3)


HOST_VALUE_ERRORS = {
    "query_start_loc not at 0": (lambda q, s: (q + 1, s), "must start at 0, got 1"),
    "query_start_loc decreases": (lambda q, s: (torch.cat([q[:3], q[2:3] - 1, q[4:]]), s),
                                  r"must not decrease: entry 3 \(\d+\) < entry 2"),
    "negative seq_len": (lambda q, s: (q, torch.cat([s[:4], -s[4:5], s[5:]])), "request 4 has a negative seq_len"),
    "query_len > seq_len": (lambda q, s: (q, torch.cat([s[:5], s[5:6] * 0, s[6:]])),
                            r"request 5 has query_len 2 > seq_len 0"),
    "ends before num_actual_tokens": (lambda q, s: (torch.cat([q[:-1], q[-1:] - 1]), s), "ends at"),
}


@pytest.mark.parametrize("num_reqs", [8, 200], ids=["small-batch", "large-batch"])
@pytest.mark.parametrize("name", HOST_VALUE_ERRORS)
def test_host_values_name_the_first_bad_request_at_any_batch_size(name, num_reqs):
    """The host-copy checks (Python ints for small batches, numpy for large ones) refuse the same
    metadata with the same message, naming the first offending entry."""
    corrupt, message = HOST_VALUE_ERRORS[name]
    table = torch.zeros(num_reqs, 2, dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([2] * num_reqs, [6] * num_reqs, table, block_size=4)
    qsl, seq = corrupt(md.query_start_loc_cpu.clone(), md.seq_lens_cpu.clone())
    bad = replace_md(md, query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq)
    with pytest.raises(ValueError, match=message):
        kvmulti.prepare_step(bad, LAYOUT, 4, check_values=False)
    kvmulti.prepare_step(md, LAYOUT, 4, check_values=False)


@pytest.mark.parametrize("block_size", [True, False, 0, -4, 4.0, "16"])
def test_from_lens_refuses_a_block_size_that_is_not_a_positive_int(block_size):
    """A bool is not a size: True is not taken as block size 1."""
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"block_size must be a positive int, got {block_size!r}"):
        kvmulti.CommonAttentionMetadata.from_lens([1], [3], table, block_size=block_size)


def test_metadata_whose_lengths_disagree_names_every_count():
    """A seq_lens of the wrong length: the message names num_reqs, query_start_loc and seq_lens."""
    table = torch.zeros(2, 4, dtype=torch.int32)
    md = kvmulti.CommonAttentionMetadata.from_lens([1, 1], [3, 3], table, block_size=4)
    md = dataclasses.replace(md, seq_lens=md.seq_lens[:1], seq_lens_cpu=md.seq_lens_cpu[:1], num_reqs=1)
    layout = kvmulti.KVCacheLayout(num_blocks=4, block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"num_reqs = 1, query_start_loc has 3 entries \(2 requests\).*"
                                         r"seq_lens has 1 entries \(1 requests\)"):
        kvmulti.prepare_step(md, layout, 1)
