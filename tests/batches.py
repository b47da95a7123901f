"""Random mixed batches and the oracle comparison every backend's tests share.

A :class:`CaseSpec` is a small, printable description (hypothesis draws it); :func:`build_case`
turns it into tensors: a cache full of random data (so a read of a wrong slot shows), a shuffled
block table whose entries outside a request's sliding window point OUTSIDE the cache (so a backend
that reads them fails), the new tokens' key/value/query and the metadata.
:func:`check_against_reference` writes and attends with a backend and with ``kvmulti.reference``
and compares caches (exactly) and outputs (per-dtype tolerance).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import kvmulti
from kvmulti import reference
from kvmulti.layout import ORDERS, token_order

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: backends whose tests run in a venv of their own (IPEX: .venv-ipex, tests/test_ipex_backend.py)
OWN_VENV = ("IPEX",)
TOLERANCE = {torch.float32: (2e-4, 2e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@dataclass(frozen=True)
class CaseSpec:
    order: str
    block_size: int
    num_kv_heads: int
    group: int                      # query heads per KV head
    head_size: int
    dtype: torch.dtype
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]   # tokens already cached before this step
    extra_blocks: int = 0
    sliding_window: int | None = None
    softcap: float | None = None
    head_size_v: int | None = None
    seed: int = 0
    sinks: bool = False             # fp32 attention-sink logits per query head (some dominating their rows)
    alibi: bool = False             # fp32 ALiBi slopes per query head (the geometric series of the ALiBi paper)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.context_lens, self.query_lens))


@dataclass
class Case:
    spec: CaseSpec
    layout: kvmulti.KVCacheLayout
    cache: torch.Tensor
    metadata: kvmulti.CommonAttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor

    @property
    def sinks(self) -> torch.Tensor | None:
        """fp32 [Hq] attention-sink logits in [-3, 5) when the spec has sinks (some dominate their rows)."""
        if not self.spec.sinks:
            return None
        gen = torch.Generator().manual_seed(self.spec.seed + 7)
        return (torch.rand(self.query.shape[1], generator=gen) * 8 - 3).to(self.query.device)

    @property
    def alibi_slopes(self) -> torch.Tensor | None:
        """fp32 [Hq] ALiBi slopes 2^(-8 (h + 1) / Hq) when the spec has ALiBi (bias up to tens of logits)."""
        if not self.spec.alibi:
            return None
        hq = self.query.shape[1]
        return torch.pow(2.0, -8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq).to(self.query.device)


@st.composite
def batch_cases(draw, dtypes=ALL_DTYPES, block_sizes=(1, 16, 32), head_sizes=(64,), groups=(1, 2, 4, 8),
                kv_heads=(1, 2), max_reqs: int = 4, max_context: int = 80, max_query: int = 20,
                orders=ORDERS, windows: bool = True, softcaps: bool = True, sinks: bool = False) -> CaseSpec:
    """A mixed batch: prefills (no context), chunked prefills and verifications (context + several
    new tokens) and decodes (context + one token), in any mix."""
    num_reqs = draw(st.integers(1, max_reqs))
    kinds = draw(st.lists(st.sampled_from(["prefill", "chunk", "decode"]), min_size=num_reqs, max_size=num_reqs))
    query_lens, context_lens = [], []
    for kind in kinds:
        context = 0 if kind == "prefill" else draw(st.integers(1, max_context))
        query_lens.append(1 if kind == "decode" else draw(st.integers(1, max_query)))
        context_lens.append(context)
    return CaseSpec(
        order=draw(st.sampled_from(orders)),
        block_size=draw(st.sampled_from(block_sizes)),
        num_kv_heads=draw(st.sampled_from(kv_heads)),
        group=draw(st.sampled_from(groups)),
        head_size=draw(st.sampled_from(head_sizes)),
        dtype=draw(st.sampled_from(dtypes)),
        query_lens=tuple(query_lens), context_lens=tuple(context_lens),
        extra_blocks=draw(st.integers(0, 2)),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 48))) if windows else None,
        softcap=draw(st.one_of(st.none(), st.floats(2.0, 30.0))) if softcaps else None,
        seed=draw(st.integers(0, 2**16)),
        sinks=draw(st.booleans()) if sinks else False,
    )


def build_case(spec: CaseSpec, device: str | torch.device = "cpu") -> Case:
    gen = torch.Generator().manual_seed(spec.seed)
    bs = spec.block_size
    blocks_needed = [-(-s // bs) for s in spec.seq_lens]
    num_blocks = sum(blocks_needed) + spec.extra_blocks
    layout = kvmulti.KVCacheLayout(num_blocks=num_blocks, block_size=bs, num_kv_heads=spec.num_kv_heads,
                                   head_size=spec.head_size, head_size_v=spec.head_size_v, dtype=spec.dtype,
                                   order=spec.order)
    cache = layout.allocate(device)
    cache.copy_(torch.randn(layout.shape, generator=gen).to(spec.dtype))
    width = max(blocks_needed) + 1
    table = torch.full((len(spec.seq_lens), width), num_blocks + 1000, dtype=torch.int32)  # out of range
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for i, (seq, q) in enumerate(zip(spec.seq_lens, spec.query_lens)):
        ids = [free.pop() for _ in range(blocks_needed[i])]
        first = reference.lowest_visible_position(seq, q, spec.sliding_window) // bs
        table[i, first:blocks_needed[i]] = torch.tensor(ids[first:], dtype=torch.int32)
    metadata = kvmulti.CommonAttentionMetadata.from_lens(list(spec.query_lens), list(spec.seq_lens), table, bs,
                                                         device=device)
    tokens, heads = metadata.num_actual_tokens, spec.num_kv_heads
    query = torch.randn(tokens, heads * spec.group, spec.head_size, generator=gen).to(spec.dtype).to(device)
    key = torch.randn(tokens, heads, spec.head_size, generator=gen).to(spec.dtype).to(device)
    value = torch.randn(tokens, heads, layout.value_size, generator=gen).to(spec.dtype).to(device)
    return Case(spec, layout, cache, metadata, query, key, value)


def assert_close_to_reference(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{what}\n{m}")


def check_against_reference(spec: CaseSpec, backend: str, device: str | torch.device = "cpu") -> None:
    """Write the new tokens and attend with ``backend`` and with the oracle; compare both results."""
    case = build_case(spec, device)
    ref_cache = case.cache.cpu().clone()   # clone() keeps the strides of the layout's order
    reference.write_kv(case.key.cpu(), case.value.cpu(), ref_cache, case.layout, case.metadata.slot_mapping.cpu())
    kvmulti.write_kv(case.key, case.value, case.cache, case.layout, case.metadata.slot_mapping, backend=backend)
    assert torch.equal(case.cache.cpu(), ref_cache.cpu()), f"{backend} write_kv differs from the oracle for {spec}"
    sinks = None if case.sinks is None else case.sinks.cpu()
    alibi = None if case.alibi_slopes is None else case.alibi_slopes.cpu()
    expected = reference.paged_attention(case.query.cpu(), case.cache.cpu(), case.layout,
                                         _to_cpu(case.metadata), sliding_window=spec.sliding_window,
                                         softcap=spec.softcap, sinks=sinks, alibi_slopes=alibi)
    actual = kvmulti.paged_attention(case.query, case.cache, case.layout, case.metadata,
                                     sliding_window=spec.sliding_window, softcap=spec.softcap, backend=backend,
                                     sinks=case.sinks, alibi_slopes=case.alibi_slopes)
    assert actual.dtype == spec.dtype and actual.shape == expected.shape
    assert_close_to_reference(actual, expected, spec.dtype, f"{backend} attention differs from the oracle for {spec}")


def check_fp8_against_reference(spec: CaseSpec, backend, cache_dtype: torch.dtype,
                                device: str | torch.device = "cpu") -> None:
    """``check_against_reference`` over an fp8 ``cache_dtype`` cache (random fp8 context, per-head
    scales) with query/key/value of ``spec.dtype``: the write's bytes must equal the oracle's and
    the attention must match the oracle's within ``spec.dtype``'s tolerance."""
    case = build_case(spec, device)
    layout = dataclasses.replace(case.layout, dtype=cache_dtype)
    cache = layout.allocate(device)
    cache.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(spec.seed)).to(cache_dtype))
    k_scale = torch.linspace(0.05, 0.3, spec.num_kv_heads)
    v_scale = k_scale * 2
    ref_cache = cache.cpu().clone()
    reference.write_kv(case.key.cpu(), case.value.cpu(), ref_cache, layout, case.metadata.slot_mapping.cpu(),
                       k_scale, v_scale)
    scales = dict(k_scale=k_scale.to(device), v_scale=v_scale.to(device))
    kvmulti.write_kv(case.key, case.value, cache, layout, case.metadata.slot_mapping, backend=backend, **scales)
    assert torch.equal(cache.cpu().view(torch.uint8), ref_cache.view(torch.uint8)), \
        f"{backend} fp8 write_kv differs from the oracle for {spec}"
    sinks = None if case.sinks is None else case.sinks.cpu()
    alibi = None if case.alibi_slopes is None else case.alibi_slopes.cpu()
    expected = reference.paged_attention(case.query.cpu(), ref_cache, layout, _to_cpu(case.metadata),
                                         sliding_window=spec.sliding_window, softcap=spec.softcap,
                                         k_scale=k_scale, v_scale=v_scale, sinks=sinks, alibi_slopes=alibi)
    actual = kvmulti.paged_attention(case.query, cache, layout, case.metadata, sliding_window=spec.sliding_window,
                                     softcap=spec.softcap, backend=backend, sinks=case.sinks,
                                     alibi_slopes=case.alibi_slopes, **scales)
    assert actual.dtype == spec.dtype and actual.shape == expected.shape
    assert_close_to_reference(actual, expected, spec.dtype, f"{backend} fp8 attention differs from the oracle for {spec}")


def check_cross_layer(spec: CaseSpec, physical: str, backend: str, cache_dtype: torch.dtype | None = None,
                      num_layers: int = 3) -> None:
    """``check_against_reference`` on layer 1 of a ``num_layers`` cross-layer allocation of order
    ``physical`` (random data in every layer): the write must equal the oracle's byte for byte and
    leave the other layers untouched; the attention must match the oracle's over the same view.
    ``cache_dtype`` (fp8) stores with k_scale 0.5, v_scale 1.5."""
    case = build_case(spec)
    layout = dataclasses.replace(case.layout, dtype=cache_dtype or spec.dtype, order=token_order(physical),
                                 cross_layer_order=physical, num_layers=num_layers)
    allocation = layout.allocate()
    allocation.copy_(torch.randn(allocation.shape, generator=torch.Generator().manual_seed(spec.seed)).to(layout.dtype))
    scales = dict(k_scale=0.5, v_scale=1.5) if cache_dtype else {}
    want = allocation.clone()
    reference.write_kv(case.key, case.value, layout.layer(want, 1), layout, case.metadata.slot_mapping,
                       scales.get("k_scale"), scales.get("v_scale"))
    cache = layout.layer(allocation, 1)
    kvmulti.write_kv(case.key, case.value, cache, layout, case.metadata.slot_mapping, backend=backend, **scales)
    assert torch.equal(allocation.view(torch.uint8), want.view(torch.uint8)), \
        f"{backend} {physical}: the write differs from the oracle's or touched another layer ({spec})"
    expected = reference.paged_attention(case.query, layout.layer(want, 1), layout, case.metadata,
                                         sliding_window=spec.sliding_window, softcap=spec.softcap, **scales)
    actual = kvmulti.paged_attention(case.query, cache, layout, case.metadata, sliding_window=spec.sliding_window,
                                     softcap=spec.softcap, backend=backend, **scales)
    assert_close_to_reference(actual, expected, spec.dtype, f"{backend} {physical} attention ({spec})")
    assert torch.equal(allocation.view(torch.uint8), want.view(torch.uint8)), f"{backend} {physical}: a read wrote"


def _to_cpu(md: kvmulti.CommonAttentionMetadata) -> kvmulti.CommonAttentionMetadata:
    if md.device.type == "cpu":
        return md
    return kvmulti.CommonAttentionMetadata(md.query_start_loc.cpu(), md.seq_lens.cpu(), md.block_table.cpu(),
                                           md.slot_mapping.cpu(), md.num_reqs, md.num_actual_tokens,
                                           md.max_query_len, md.max_seq_len, md.causal)


def registered_backends() -> list[str]:
    """Every registered backend this venv's suites run on CPU tensors (each test skips with the
    backend's reasons where it cannot run, or fails in CI): the registry's, less :data:`OWN_VENV`."""
    from kvmulti.backends.registry import backend_names
    return [name for name in backend_names() if name not in OWN_VENV]


def record_triton_launches(monkeypatch) -> list:
    """Every attention ``Launch`` the TRITON backend builds from now on (the launches it runs: a
    step builds each form's launches once, kvmulti/backends/triton/prepared.py)."""
    from kvmulti.backends.triton import launch
    launches, build = [], launch.attention_launches

    def recording(*args, **kwargs):
        plan, built = build(*args, **kwargs)
        launches.extend(built)
        return plan, built
    monkeypatch.setattr(launch, "attention_launches", recording)
    return launches
