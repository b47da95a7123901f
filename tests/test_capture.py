"""Steps prepared for graph capture (``prepare_step(..., capture=CaptureBucket(...))``), on CPU tensors
under Triton's interpreter: the per-layer calls of such a step allocate nothing, fill nothing and
read nothing back to the host (a dispatch mode records every aten op they make outside the kernels),
and the same step, re-used after the engine updated the metadata's tensors in place for a batch
with grown contexts (what a graph replay sees), matches the oracle. fp8 caches too, their layers'
scales (per tensor and per head, tensors and floats) passed as launch arguments: bit for bit what
the unprepared path computes, and a bad scale raises the unprepared path's error.
"""

from __future__ import annotations

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kvmulti  # noqa: E402
from kvmulti import reference  # noqa: E402
from kvmulti.backends.cpu import CPUBackend  # noqa: E402
from kvmulti.backends.triton import TritonBackend, interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="CPU-tensor Triton tests need TRITON_INTERPRET=1")

HQ, HKV, HEAD, BLOCK, BLOCKS, WIDTH, LAYERS = 4, 2, 16, 4, 48, 10, 2
SEQS = 4                                        # the bucket's requests (decode: one row each)


class OpRecorder(TorchDispatchMode):
    """Every aten op made while active, except inside the kernels (:meth:`kernel`)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self._in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._in_kernel:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def kernel(self):
        self._in_kernel += 1
        try:
            yield
        finally:
            self._in_kernel -= 1


@pytest.fixture
def recorder(monkeypatch):
    """An OpRecorder whose kernel launches (the interpreter's numpy emulation of a GPU launch) are
    not recorded: on a device they are one launch each, no aten op."""
    from kvmulti.backends.triton.launch import KERNELS
    rec = OpRecorder()
    for fn in KERNELS.values():
        original = fn.run

        def run(*args, _original=original, **kwargs):
            with rec.kernel():
                return _original(*args, **kwargs)
        monkeypatch.setattr(fn, "run", run)
    return rec


class Engine:
    """An engine's persistent buffers for one decode bucket of SEQS requests: the metadata tensors,
    the layers' query / key / value / out, their caches. :meth:`fill` writes a batch into them in
    place (requests past the real ones padded with query length 0, slots with -1)."""

    def __init__(self, dtype=torch.float32, cache_dtype=None, scales=None):
        """``dtype``: query, key, value and out's; ``cache_dtype``: the caches' (default ``dtype``);
        ``scales``: each layer's (k_scale, v_scale) for an fp8 cache (default: none passed)."""
        gen = torch.Generator().manual_seed(0)
        cache_dtype = dtype if cache_dtype is None else cache_dtype
        self.layout = kvmulti.KVCacheLayout(BLOCKS, BLOCK, HKV, HEAD, dtype=cache_dtype)
        self.caches = [self.layout.allocate() for _ in range(LAYERS)]
        for cache in self.caches:
            cache.copy_(torch.randn(self.layout.shape, generator=gen).to(cache_dtype))
        self.scales = [(None, None)] * LAYERS if scales is None else scales
        self.tables = torch.randperm(BLOCKS, generator=gen).to(torch.int32)[:SEQS * WIDTH].view(SEQS, WIDTH)
        self.query_start_loc = torch.zeros(SEQS + 1, dtype=torch.int32)
        self.seq_lens = torch.zeros(SEQS, dtype=torch.int32)
        self.block_table = torch.zeros(SEQS, WIDTH, dtype=torch.int32)
        self.slot_mapping = torch.full((SEQS,), -1, dtype=torch.int64)
        self.query = torch.zeros(SEQS, HQ, HEAD, dtype=dtype)
        self.key = torch.zeros(SEQS, HKV, HEAD, dtype=dtype)
        self.value = torch.zeros(SEQS, HKV, HEAD, dtype=dtype)
        self.outs = [torch.zeros(SEQS, HQ, HEAD, dtype=dtype) for _ in range(LAYERS)]
        self.gen = gen

    def fill(self, seq_lens: list[int]) -> kvmulti.CommonAttentionMetadata:
        """Write a decode batch (one new token per request, ``seq_lens`` with it) into the buffers;
        returns the real batch's metadata (the oracle's)."""
        n = len(seq_lens)
        real = kvmulti.CommonAttentionMetadata.from_lens([1] * n, seq_lens, self.tables[:n].clone(), BLOCK)
        self.query_start_loc.copy_(torch.tensor([min(i, n) for i in range(SEQS + 1)], dtype=torch.int32))
        self.seq_lens.copy_(torch.tensor(seq_lens + [0] * (SEQS - n), dtype=torch.int32))
        self.block_table.copy_(self.tables)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n] = real.slot_mapping
        dtype = self.query.dtype
        for buffer in (self.query, self.key, self.value):
            buffer.copy_(torch.randn(buffer.shape, generator=self.gen).to(dtype))
        return real

    def metadata(self, real: kvmulti.CommonAttentionMetadata) -> kvmulti.CommonAttentionMetadata:
        """The bucket's metadata over the persistent buffers (host copies: the CPU tensors themselves)."""
        return kvmulti.CommonAttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_table=self.block_table,
            slot_mapping=self.slot_mapping, num_reqs=SEQS, num_actual_tokens=real.num_actual_tokens,
            max_query_len=1, max_seq_len=real.max_seq_len, query_start_loc_cpu=self.query_start_loc,
            seq_lens_cpu=self.seq_lens)

    def layer_calls(self, step) -> None:
        """What a captured decode step records per layer: the write, then attention into its out."""
        for cache, out, (k_scale, v_scale) in zip(self.caches, self.outs, self.scales):
            kvmulti.write_kv(self.key, self.value, cache, self.layout, self.slot_mapping, step=step,
                             k_scale=k_scale, v_scale=v_scale)
            kvmulti.paged_attention(self.query, cache, self.layout, step, out=out, k_scale=k_scale, v_scale=v_scale)

    def check(self, real: kvmulti.CommonAttentionMetadata, expected_caches: list[torch.Tensor]) -> None:
        """Each layer's cache equals the oracle's writes, its out rows of the real requests the oracle."""
        n = real.num_actual_tokens
        for cache, expected_cache, out, (k_scale, v_scale) in zip(self.caches, expected_caches, self.outs,
                                                                   self.scales):
            reference.write_kv(self.key[:n], self.value[:n], expected_cache, self.layout, real.slot_mapping,
                               k_scale, v_scale)
            assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
            expected = reference.paged_attention(self.query[:n], cache, self.layout, real, k_scale=k_scale,
                                                 v_scale=v_scale)
            torch.testing.assert_close(out[:n], expected, atol=2e-5, rtol=2e-5)


def captured_step(engine: Engine, partition_size: int) -> tuple[kvmulti.StepMetadata,
                                                                 kvmulti.CommonAttentionMetadata]:
    """(step, real batch): the engine filled with contexts [5, 9, 2] and a TRITON step prepared for
    the capture bucket of up to SEQS decoding requests (contexts up to 17 planned)."""
    bucket = kvmulti.CaptureBucket(max_num_seqs=SEQS, max_num_tokens=SEQS, max_query_len=1, max_seq_len=17)
    real = engine.fill([5, 9, 2])
    return kvmulti.prepare_step(engine.metadata(real), engine.layout, HQ, capture=bucket,
                                backend=TritonBackend(partition_size=partition_size)), real


def warm_up_then_replay_grown_contexts(engine: Engine, step: kvmulti.StepMetadata,
                                       real: kvmulti.CommonAttentionMetadata, recorder: OpRecorder) -> list:
    """The warm-up an engine runs before capturing (checked against the oracle), then a replay with
    the contexts grown by one (two cross a block boundary), a fourth request joined, and one
    outgrowing the bucket's max_seq_len and its partitions (the last one runs to its end): the
    per-layer calls make no aten op and match the oracle. Returns the oracle's caches."""
    expected_caches = [cache.clone() for cache in engine.caches]
    engine.layer_calls(step)
    engine.check(real, expected_caches)
    real = engine.fill([6, 10, 3, 36])
    with recorder:
        engine.layer_calls(step)
    assert recorder.ops == [], f"per-layer calls of a captured step made aten ops: {recorder.ops}"
    engine.check(real, expected_caches)
    return expected_caches


@pytest.mark.parametrize("partition_size", [0, 16], ids=["single_pass", "split_kv"])
def test_a_captured_step_replays_grown_contexts_without_allocating_or_host_reads(partition_size, recorder,
                                                                               one_torch_thread):
    engine = Engine()
    step, real = captured_step(engine, partition_size)
    assert (step.plan.split, step.plan.num_parts) == ((True, 2) if partition_size else (False, 1))
    expected_caches = warm_up_then_replay_grown_contexts(engine, step, real, recorder)

    real = engine.fill([4])                    # a smaller batch in the same bucket
    engine.layer_calls(step)
    engine.check(real, expected_caches)


def fp8_scales(kind: str) -> list[tuple]:
    """Each layer's (k_scale, v_scale) of a scale ``kind``: ``per_head``: fp32 [HKV] tensors, one a
    strided view (a column of a [HKV, LAYERS] tensor); ``per_tensor``: a [] tensor and a float, then
    a float and None (1.0)."""
    gen = torch.Generator().manual_seed(1)
    if kind == "per_head":
        columns = torch.rand(HKV, LAYERS, generator=gen) + 0.5
        return [(columns[:, layer], torch.rand(HKV, generator=gen) + 0.5) for layer in range(LAYERS)]
    return [(torch.tensor(0.75), 1.25), (0.5, None)]


FP8_CASES = [pytest.param(torch.float8_e4m3fn, "per_head", 0, id="e4m3fn-per_head-single_pass"),
             pytest.param(torch.float8_e4m3fnuz, "per_tensor", 16, id="e4m3fnuz-per_tensor-split_kv")]


@pytest.mark.parametrize("cache_dtype, kind, partition_size", FP8_CASES)
def test_a_captured_fp8_step_passes_the_layers_scales_without_allocating_or_host_reads(
        cache_dtype, kind, partition_size, recorder, one_torch_thread):
    """An fp8 cache's step prepared for capture: each layer's scales are launch arguments of its
    calls (a [] tensor as it is, a float as a constant the step keeps), so replays make no aten op
    and match the oracle as contexts grow."""
    engine = Engine(cache_dtype=cache_dtype, scales=fp8_scales(kind))
    step, real = captured_step(engine, partition_size)
    assert step.calls is not None and step.plan.split == bool(partition_size)
    warm_up_then_replay_grown_contexts(engine, step, real, recorder)


def test_prepared_fp8_calls_equal_the_unprepared_path_bit_for_bit(one_torch_thread):
    """The prepared calls of an eager step (scales as launch arguments, uncopied: a layer of
    per-head tensors, one a strided view, and a layer of a [] tensor and a float) write the same
    bytes and compute the same outputs as the public ops without a step (scales normalised to fp32
    [HKV] copies)."""
    engine = Engine(cache_dtype=torch.float8_e4m3fn, scales=[fp8_scales("per_head")[0], fp8_scales("per_tensor")[0]])
    real = engine.fill([5, 9, 2, 7])
    step = kvmulti.prepare_step(real, engine.layout, HQ, backend="TRITON")
    unprepared = [cache.clone() for cache in engine.caches]
    engine.layer_calls(step)
    assert all(form.scaled for form in step.calls._attention.values()) and len(step.calls._attention) == LAYERS
    for cache, out, (k_scale, v_scale) in zip(unprepared, engine.outs, engine.scales):
        kvmulti.write_kv(engine.key, engine.value, cache, engine.layout, real.slot_mapping, backend="TRITON",
                         k_scale=k_scale, v_scale=v_scale)
        want = kvmulti.paged_attention(engine.query, cache, engine.layout, real, backend="TRITON",
                                       k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(out, want)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(engine.caches, unprepared))


BAD_SCALES = {"zero": 0.0, "nan": float("nan"), "negative": -1.0, "bool": True,
              "wrong_shape": torch.ones(HKV + 1), "a_zero_head": torch.tensor([1.0, 0.0]),
              "inf_head": torch.tensor([1.0, float("inf")]), "fp64": torch.ones((), dtype=torch.float64),
              "int": torch.ones(HKV, dtype=torch.int32)}


def _error(call) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return info.type, str(info.value)


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_a_bad_scale_raises_the_unprepared_paths_error_on_the_prepared_path(which, one_torch_thread):
    """Every bad scale, before and after the calls' forms were built with good scales of each kind:
    the prepared calls raise exactly what the public ops without a step raise, and the cache stays
    untouched. A scale for a cache that is not fp8 is refused by the step calls and raised."""
    engine = Engine(cache_dtype=torch.float8_e4m3fn)
    real = engine.fill([5, 9, 2, 7])
    step = kvmulti.prepare_step(real, engine.layout, HQ, backend="TRITON")
    cache, out, layout = engine.caches[0], engine.outs[0], engine.layout
    good = {"k_scale": torch.ones(HKV), "v_scale": 0.5}
    for built in (False, True):
        if built:                   # the forms of the good scales' kinds exist: only the values differ
            kvmulti.write_kv(engine.key, engine.value, cache, layout, real.slot_mapping, step=step, **good)
            kvmulti.paged_attention(engine.query, cache, layout, step, out=out, **good)
        for bad in BAD_SCALES.values():
            scales = dict(good, **{which: bad}) if built else {which: bad}
            before = cache.clone()
            want = _error(lambda: kvmulti.write_kv(engine.key, engine.value, cache, layout, real.slot_mapping,
                                                   backend="TRITON", **scales))
            assert _error(lambda: kvmulti.write_kv(engine.key, engine.value, cache, layout, real.slot_mapping,
                                                   step=step, **scales)) == want
            assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
            want = _error(lambda: kvmulti.paged_attention(engine.query, cache, layout, real, backend="TRITON",
                                                          **scales))
            assert _error(lambda: kvmulti.paged_attention(engine.query, cache, layout, step, out=out,
                                                          **scales)) == want
    plain = Engine()
    step = kvmulti.prepare_step(real, plain.layout, HQ, backend="TRITON")
    for scale in (1.0, torch.tensor(1.0)):
        assert not step.calls.write(plain.key, plain.value, plain.caches[0], real.slot_mapping, **{which: scale})
        assert not step.calls.attend(plain.query, plain.caches[0], plain.outs[0], 0.25, 0.0, **{which: scale})
        with pytest.raises(ValueError, match=f"{which} applies to fp8 caches only"):
            kvmulti.write_kv(plain.key, plain.value, plain.caches[0], plain.layout, real.slot_mapping, step=step,
                             **{which: scale})
        with pytest.raises(ValueError, match=f"{which} applies to fp8 caches only"):
            kvmulti.paged_attention(plain.query, plain.caches[0], plain.layout, step, out=plain.outs[0],
                                    **{which: scale})


def test_the_recorder_sees_what_an_eager_step_does(recorder, one_torch_thread):
    """The same calls through an eager step of a padded query record the zeroing of its padding rows:
    the recorder is not blind."""
    engine = Engine()
    real = engine.fill([5, 9, 2])
    step = kvmulti.prepare_step(real, engine.layout, HQ, num_query_rows=SEQS, backend="TRITON")
    kvmulti.paged_attention(engine.query, engine.caches[0], engine.layout, step, out=engine.outs[0])
    with recorder:
        kvmulti.paged_attention(engine.query, engine.caches[0], engine.layout, step, out=engine.outs[0])
    assert any("zero_" in op or "fill_" in op for op in recorder.ops), recorder.ops
    assert not engine.outs[0][3:].any()


def test_capture_refusals_name_the_mismatch(one_torch_thread):
    engine = Engine()
    real = engine.fill([5, 9, 2])
    md = engine.metadata(real)
    bucket = kvmulti.CaptureBucket(max_num_seqs=SEQS, max_num_tokens=SEQS, max_query_len=1, max_seq_len=16)
    step = kvmulti.prepare_step(md, engine.layout, HQ, capture=bucket, backend="TRITON")
    with pytest.raises(ValueError, match="needs out="):
        kvmulti.paged_attention(engine.query, engine.caches[0], engine.layout, step)
    with pytest.raises(ValueError, match="max_num_seqs 8"):
        kvmulti.prepare_step(md, engine.layout, HQ, backend="TRITON",
                             capture=kvmulti.CaptureBucket(8, 8, 1, 16))
    with pytest.raises(ValueError, match="max_seq_len 8"):
        kvmulti.prepare_step(md, engine.layout, HQ, backend="TRITON",
                             capture=kvmulti.CaptureBucket(SEQS, SEQS, 1, 8))
    with pytest.raises(ValueError, match="max_num_tokens"):
        kvmulti.prepare_step(md, engine.layout, HQ, backend="TRITON", num_query_rows=SEQS + 1, capture=bucket)
    with pytest.raises(ValueError, match="cannot prepare steps for graph capture"):
        kvmulti.prepare_step(md, engine.layout, HQ, backend=CPUBackend(native_kernel=False), capture=bucket)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        kvmulti.CaptureBucket(0, 4, 1, 16)
    with pytest.raises(ValueError, match="max_num_tokens=4 rows"):
        kvmulti.paged_attention(engine.query[:3], engine.caches[0], engine.layout, step, out=engine.outs[0][:3])
    other = kvmulti.KVCacheLayout(BLOCKS + 1, BLOCK, HKV, HEAD, dtype=torch.float32).allocate()
    with pytest.raises(ValueError, match="cache.layout"):      # a cache of another shape: refused loudly
        kvmulti.paged_attention(engine.query, other, engine.layout, step, out=engine.outs[0])


def test_a_dropped_step_is_freed_with_its_workspace(one_torch_thread):
    """A step and its calls form no reference cycle: dropping the step frees it (and the split-KV
    workspace its calls own) at once, without waiting for the cyclic garbage collector."""
    import gc
    import weakref
    engine = Engine()
    real = engine.fill([5, 9, 2])
    step = kvmulti.prepare_step(real, engine.layout, HQ, num_query_rows=SEQS,
                                backend=TritonBackend(partition_size=16))
    kvmulti.paged_attention(engine.query, engine.caches[0], engine.layout, step, out=engine.outs[0])
    workspace = weakref.ref(step.calls.workspace[0])
    gc.disable()
    try:
        del step
        assert workspace() is None
    finally:
        gc.enable()
