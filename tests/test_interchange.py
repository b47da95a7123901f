"""The KV interchange format (docs/interchange.md): round trips across orders, block sizes and
dtypes of a multi-group cache, every fp8 code through OCP <-> FNUZ against a reference quantiser,
the byte layout, bad buffers / destinations leaving the destination untouched, and every (source,
destination) pair of backends: a cache one writes moves to the other's order and block size bit for
bit and reads the same there."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from kvmulti import fp8
from kvmulti.interchange import MAGIC, VERSION, InterchangeError, export_blocks, import_blocks
from kvmulti.kv_cache import AttentionSpec, KVCacheConfig
from kvmulti.layout import KVCacheLayout

from fp8_codes import reference_code

DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz)
#: layer -> (num_kv_heads, head_size, head_size_v): two groups, the second with its own V size
LAYERS = {"a": (2, 8, 8), "b": (2, 8, 8), "c": (1, 16, 4)}
NUM_TOKENS = 45


def _layouts(block_size: int, order: str, dtype: torch.dtype, num_blocks: int = 8) -> dict[str, KVCacheLayout]:
    return {name: KVCacheLayout(num_blocks, block_size, h, d, dv, dtype=dtype, order=order)
            for name, (h, d, dv) in LAYERS.items()}


def _random_caches(layouts: dict[str, KVCacheLayout], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random contents in every slot; fp8 caches get random codes other than NaN."""
    g = torch.Generator().manual_seed(seed)
    caches = {}
    for name, lay in layouts.items():
        cache = lay.allocate()
        if fp8.is_fp8(lay.dtype):
            codes = torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8)
            codes[codes.view(lay.dtype).float().isnan()] = 0x01
            cache.view(torch.uint8).copy_(codes)
        else:
            cache.copy_(torch.randn(cache.shape, generator=g) * 3)
        caches[name] = cache
    return caches


def _tokens(cache: torch.Tensor, layout: KVCacheLayout, block_ids: list[int], start: int, end: int) -> torch.Tensor:
    """Rows [end - start, H, E] of tokens start..end-1, as raw bytes (uint8 views for fp8)."""
    pos = torch.arange(start, end)
    raw = cache.view(torch.uint8) if fp8.is_fp8(cache.dtype) else cache
    return raw[torch.tensor(block_ids)[pos // layout.block_size], pos % layout.block_size]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().view(torch.int16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src_order,dst_order", [("NHD", "NHD"), ("NHD", "HND"), ("HND", "NHD"), ("HND", "HND")])
@pytest.mark.parametrize("src_bs,dst_bs", [(16, 16), (16, 32), (32, 16), (32, 32)])
def test_round_trip_is_bit_exact(dtype, src_order, dst_order, src_bs, dst_bs):
    src, dst = _layouts(src_bs, src_order, dtype), _layouts(dst_bs, dst_order, dtype, num_blocks=9)
    caches = _random_caches(src)
    src_ids = [5, 0, 7, 2][: -(-NUM_TOKENS // src_bs)]
    dst_ids = [8, 3, 1, 6][: -(-NUM_TOKENS // dst_bs)]
    scales = {"k_scale": {"a": 0.5, "b": torch.tensor([0.25, 2.0]), "c": None}, "v_scale": 3.0} \
        if fp8.is_fp8(dtype) else {}
    data = export_blocks(caches, src, src_ids, NUM_TOKENS, **scales)
    out = {name: lay.allocate() for name, lay in dst.items()}
    untouched = {name: t.clone() for name, t in out.items()}
    result = import_blocks(data, out, dst, dst_ids)
    assert result.num_tokens == NUM_TOKENS
    for name in LAYERS:
        got = _tokens(out[name], dst[name], dst_ids, 0, NUM_TOKENS)
        want = _tokens(caches[name], src[name], src_ids, 0, NUM_TOKENS)
        assert torch.equal(_bits(got), _bits(want)), name
        pos = torch.arange(NUM_TOKENS)
        written = torch.zeros(dst[name].num_blocks, dst_bs, dtype=torch.bool)
        written[torch.tensor(dst_ids)[pos // dst_bs], pos % dst_bs] = True
        assert torch.equal(_bits(out[name])[~written], _bits(untouched[name])[~written]), "a slot outside the range"
    if fp8.is_fp8(dtype):          # the buffer's scales are the destination's
        k, v = result.scales["b"]
        assert k.tolist() == [0.25, 2.0] and v.tolist() == [3.0, 3.0]


@pytest.mark.parametrize("src_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=str)
def test_dtype_conversions_follow_the_write_and_read_rules(src_dtype, dst_dtype):
    """Across dtypes, a destination holds what writing the source's values would store: fp8 reads
    as float(code) * scale, fp8 stores fp8(value / scale) (different scales at the two ends)."""
    src, dst = _layouts(16, "HND", src_dtype), _layouts(32, "NHD", dst_dtype)
    caches = _random_caches(src, seed=1)
    src_scale = {"k_scale": 0.5, "v_scale": 2.0} if fp8.is_fp8(src_dtype) else {}
    dst_scale = {"k_scale": 0.75, "v_scale": 0.125} if fp8.is_fp8(dst_dtype) else {}
    data = export_blocks(caches, src, [1, 2, 3], NUM_TOKENS, **src_scale)
    out = {name: lay.allocate() for name, lay in dst.items()}
    import_blocks(data, out, dst, [4, 6], **dst_scale)
    for name, lay in dst.items():
        rows = _tokens(caches[name], src[name], [1, 2, 3], 0, NUM_TOKENS).view(src_dtype)
        got = _tokens(out[name], lay, [4, 6], 0, NUM_TOKENS)
        for part, which in ((slice(0, lay.head_size), "k_scale"), (slice(lay.head_size, None), "v_scale")):
            value = rows[..., part].float() * src_scale.get(which, 1.0)        # what the source reads
            if fp8.is_fp8(dst_dtype):
                scale = torch.full((lay.num_kv_heads,), dst_scale[which])
                want = fp8.quantize(value, scale, dst_dtype).view(torch.uint8)  # what write_kv stores
            else:
                want = value.to(dst_dtype)
            assert torch.equal(_bits(got[..., part]), _bits(want)), name


PAIRS = [(torch.float8_e4m3fn, torch.float8_e4m3fnuz), (torch.float8_e4m3fnuz, torch.float8_e4m3fn),
         (torch.float8_e5m2, torch.float8_e5m2fnuz), (torch.float8_e5m2fnuz, torch.float8_e5m2),
         (torch.float8_e4m3fn, torch.float8_e5m2fnuz), (torch.float8_e5m2fnuz, torch.float8_e4m3fnuz)]


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS, ids=str)
def test_every_fp8_code_converts_by_the_reference_quantiser(src_dtype, dst_dtype):
    """All 256 codes through the buffer at equal scales: exact wherever the destination holds the
    value, else saturated or rounded to nearest even; NaN to NaN."""
    lay_src = KVCacheLayout(1, 16, 1, 8, dtype=src_dtype)
    lay_dst = KVCacheLayout(2, 32, 1, 8, dtype=dst_dtype, order="HND")
    cache = lay_src.allocate()
    cache.view(torch.uint8).copy_(torch.arange(256, dtype=torch.uint8).view(cache.shape))
    out = lay_dst.allocate()
    import_blocks(export_blocks(cache, lay_src, [0], 16, k_scale=0.5, v_scale=0.5), out, lay_dst, [1])
    got = out.view(torch.uint8)[1, :16].reshape(-1)
    values = torch.arange(256, dtype=torch.uint8).view(src_dtype).float()     # torch's own decode
    dst_values = got.view(dst_dtype).float()
    for code, v in enumerate(values.tolist()):
        want = reference_code(v, dst_dtype)
        if want is None:
            assert dst_values[code].isnan(), f"code {code:#04x} (NaN) -> {int(got[code]):#04x}"
        else:
            assert int(got[code]) == want, f"code {code:#04x} ({v}) -> {int(got[code]):#04x}, want {want:#04x}"
        represented = v == v and abs(v) <= torch.finfo(dst_dtype).max and v in dst_values.tolist() + [0.0]
        if represented:
            assert dst_values[code].item() == v, f"code {code:#04x}: {v} is representable, got {dst_values[code]}"
    if fp8.is_fnuz(dst_dtype):                       # one NaN code, and no negative zero
        assert set(got[values.isnan()].tolist()) == {0x80}
        assert fp8.is_fnuz(src_dtype) or int(got[0x80]) == 0


def test_ocp_to_fnuz_with_the_doubled_scale_keeps_the_codes():
    """e4m3fn read with scale s and e4m3fnuz read with 2 s hold the same value in the same code
    (vLLM's ROCm convention): every finite code survives, 448 included; -0 -> 0, NaN -> 0x80."""
    lay_src = KVCacheLayout(1, 16, 1, 8, dtype=torch.float8_e4m3fn)
    lay_dst = KVCacheLayout(1, 16, 1, 8, dtype=torch.float8_e4m3fnuz)
    cache = lay_src.allocate()
    codes = torch.arange(256, dtype=torch.uint8)
    cache.view(torch.uint8).copy_(codes.view(cache.shape))
    out = lay_dst.allocate()
    import_blocks(export_blocks(cache, lay_src, [0], 16, k_scale=0.25, v_scale=0.25), out, lay_dst, [0],
                  k_scale=0.5, v_scale=0.5)
    got = out.view(torch.uint8).reshape(-1)
    want = codes.clone()
    want[0x80] = 0x00
    want[[0x7F, 0xFF]] = 0x80
    assert torch.equal(got, want)


def test_config_groups_and_a_sliding_window_range():
    """A KVCacheConfig's layers (two groups; the sliding one has given its first blocks back):
    the buffer starts at the first held block, the destination's earlier slots stay as they were."""
    specs = {"full": AttentionSpec(16, 2, 8, dtype=torch.bfloat16),
             "slide": AttentionSpec(16, 2, 8, dtype=torch.bfloat16, sliding_window=8)}
    config = KVCacheConfig.build(specs, num_blocks=6)
    caches = config.allocate_caches()
    for t in caches.values():
        t.copy_(torch.randn(t.shape))
    ids = {"full": [0, 1, 2], "slide": [-1, -1, 4]}
    data = export_blocks(caches, config.layer_layouts(), ids, 40)
    dst = KVCacheConfig.build({n: AttentionSpec(32, 2, 8, dtype=torch.bfloat16) for n in specs}, num_blocks=3)
    out = dst.allocate_caches()
    result = import_blocks(data, out, dst.layer_layouts(), {"full": [2, 0], "slide": [1, 2]})
    assert result.start_tokens == {"full": 0, "slide": 32}
    src_lay, dst_lay = config.layer_layouts(), dst.layer_layouts()
    dst_ids = {"full": [2, 0], "slide": [1, 2]}
    for name, start in result.start_tokens.items():
        assert torch.equal(_tokens(out[name], dst_lay[name], dst_ids[name], start, 40),
                           _tokens(caches[name], src_lay[name], ids[name], start, 40))
    assert not out["slide"][1].any() and not out["slide"][2, 8:].any()      # tokens 0..31 never arrived


def test_the_header_is_laid_out_as_documented():
    lay = KVCacheLayout(4, 16, 2, 8, dtype=torch.float8_e4m3fnuz, order="HND")
    cache = lay.allocate()
    data = export_blocks(cache, lay, [3, 1], 20, k_scale=torch.tensor([0.5, 1.5]), v_scale=2.0)
    magic, version, flags, groups, total = struct.unpack_from("<8sHHIQ", data, 0)
    assert (magic, version, flags, groups, total) == (MAGIC, VERSION, 0, 1, len(data))
    assert struct.unpack_from("<8I2Q", data, 24) == (6, 2, 8, 8, 16, 1, 1, 0, 0, 20)
    (name_len,) = struct.unpack_from("<H", data, 72)
    assert name_len == 0
    assert struct.unpack_from("<4f", data, 74) == (0.5, 1.5, 2.0, 2.0)
    assert len(data) == 74 + 16 + 20 * 2 * 16 + 4
    assert struct.unpack_from("<I", data, len(data) - 4)[0] == zlib.crc32(data[:-4])


def _corrupt_cases(data: bytes) -> dict[str, tuple[bytes, str]]:
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    version = bytearray(data)
    version[8:10] = struct.pack("<H", VERSION + 1)
    magic = bytearray(data)
    magic[0] ^= 0xFF
    return {"truncated payload": (data[:-7], "truncated"), "truncated header": (data[:10], "truncated"),
            "empty": (b"", "truncated"), "flipped byte": (bytes(flipped), "checksum"),
            "wrong version": (bytes(version), "version"), "wrong magic": (bytes(magic), "magic"),
            "trailing bytes": (data + b"\0", "over-long")}


def test_bad_buffers_raise_and_leave_the_destination_untouched():
    src = _layouts(16, "NHD", torch.float8_e4m3fnuz)
    data = export_blocks(_random_caches(src), src, [0, 1, 2], NUM_TOKENS)
    dst = _layouts(32, "HND", torch.float8_e4m3fn)
    out = _random_caches(dst, seed=3)
    before = {name: t.clone() for name, t in out.items()}
    for case, (bad, message) in _corrupt_cases(data).items():
        with pytest.raises(InterchangeError, match=message):
            import_blocks(bad, out, dst, [0, 1])
        for name in out:
            assert torch.equal(_bits(out[name]), _bits(before[name])), f"{case}: layer {name} changed"


def test_a_destination_that_cannot_hold_the_buffer_is_refused_before_any_write():
    src = _layouts(16, "NHD", torch.bfloat16)
    data = export_blocks(_random_caches(src), src, [0, 1, 2], NUM_TOKENS)
    good = _layouts(16, "NHD", torch.bfloat16)
    narrow = {**good, "c": KVCacheLayout(8, 16, 1, 8, 4, dtype=torch.bfloat16)}      # another head_size
    wrong_dtype = {**good, "c": KVCacheLayout(8, 16, 1, 16, 4, dtype=torch.float64)}
    out = _random_caches(good, seed=4)
    before = {name: t.clone() for name, t in out.items()}
    cases = {
        "head sizes": (dict(out, c=narrow["c"].allocate()), narrow, [0, 1, 2], "head_size"),
        "dtype without a code": (dict(out, c=wrong_dtype["c"].allocate()), wrong_dtype, [0, 1, 2], "float64"),
        "cache of another dtype": (dict(out, c=out["c"].float()), good, [0, 1, 2], "dtype"),
        "too few blocks": (out, good, [0, 1], "need 3"),
        "block out of range": (out, good, [0, 1, 8], "not blocks"),
        "a block twice": (out, good, [0, 1, 1], "repeats"),
        "missing layer": ({"a": out["a"], "b": out["b"]}, good, [0, 1, 2], "every layer"),
        "scale for a non-fp8 cache": (out, good, [0, 1, 2], "fp8 caches only"),
    }
    for case, (caches, layouts, ids, message) in cases.items():
        kwargs = {"k_scale": 0.5} if case.startswith("scale") else {}
        with pytest.raises(InterchangeError, match=message):
            import_blocks(data, caches, layouts, ids, **kwargs)
        for name in out:
            assert torch.equal(out[name], before[name]), f"{case}: layer {name} changed"


# ------------------------------------------------------------------------------ between backends
#: backends with CPU executors here; each writes and reads every interchange dtype
BACKENDS = ("CPU", "TRITON", "HIP", "SYCL")
#: two KV-cache groups of layers every backend serves (HIP: head sizes 64 .. 256, K = V)
GROUP_LAYERS = {"g0.a": 2, "g0.b": 2, "g1.a": 1}
#: (source order, block size) -> (destination order, block size): each order and block size on both sides
MOVES = ((("NHD", 16), ("HND", 32)), (("HND", 32), ("NHD", 16)), (("NHD", 32), ("NHD", 32)), (("HND", 16), ("HND", 16)))


@pytest.mark.parametrize("dst_backend", BACKENDS)
@pytest.mark.parametrize("src_backend", BACKENDS)
def test_a_cache_written_by_one_backend_moves_to_another_and_reads_the_same(src_backend, dst_backend):
    """Per dtype and move: the source backend writes a two-group cache (write_kv, per-head scales for
    fp8), the buffer lands in the destination's order and block size bit for bit, and the destination
    backend's attention over it equals the oracle's over the source."""
    import kvmulti
    from kvmulti import reference
    from test_fp8_kernels import backend_or_skip
    src_b, dst_b = backend_or_skip(src_backend), backend_or_skip(dst_backend)
    tokens, head = 37, 64
    g = torch.Generator().manual_seed(7)
    for dtype in DTYPES:
        for (so, sbs), (do, dbs) in MOVES:
            src = {n: KVCacheLayout(-(-tokens // sbs) + 2, sbs, h, head, dtype=dtype, order=so)
                   for n, h in GROUP_LAYERS.items()}
            dst = {n: KVCacheLayout(-(-tokens // dbs) + 3, dbs, h, head, dtype=dtype, order=do)
                   for n, h in GROUP_LAYERS.items()}
            src_ids = list(range(src["g0.a"].num_blocks - 1, src["g0.a"].num_blocks - 1 - (-(-tokens // sbs)), -1))
            dst_ids = list(range(1, 1 + -(-tokens // dbs)))
            scales = {n: (torch.tensor([0.5, 2.0][:h]), torch.tensor([0.25, 1.5][:h])) if fp8.is_fp8(dtype)
                      else (None, None) for n, h in GROUP_LAYERS.items()}
            caches, slots = {}, torch.tensor([src_ids[t // sbs] * sbs + t % sbs for t in range(tokens)])
            for n, h in GROUP_LAYERS.items():
                caches[n] = src[n].allocate().zero_()
                key, value = (torch.randn(tokens, h, head, generator=g) * 2).to(torch.bfloat16), \
                    (torch.randn(tokens, h, head, generator=g) * 2).to(torch.bfloat16)
                kvmulti.write_kv(key, value, caches[n], src[n], slots, backend=src_b, k_scale=scales[n][0],
                                 v_scale=scales[n][1])
            data = export_blocks(caches, src, src_ids, tokens, k_scale={n: s[0] for n, s in scales.items()},
                                 v_scale={n: s[1] for n, s in scales.items()})
            out = {n: lay.allocate().zero_() for n, lay in dst.items()}
            result = import_blocks(data, out, dst, dst_ids)
            for n in GROUP_LAYERS:
                got, want = _tokens(out[n], dst[n], dst_ids, 0, tokens), _tokens(caches[n], src[n], src_ids, 0, tokens)
                assert torch.equal(_bits(got), _bits(want)), (dtype, so, sbs, do, dbs, n)
            if (so, sbs) != MOVES[0][0]:
                continue        # attention once per dtype: the bytes are already the source's
            for n, h in GROUP_LAYERS.items():
                if n == "g0.b":
                    continue    # one layer of each group
                k_scale, v_scale = result.scales[n] if fp8.is_fp8(dtype) else (None, None)
                table = lambda ids: torch.tensor([ids], dtype=torch.int32)  # noqa: E731
                md_src = kvmulti.CommonAttentionMetadata.from_lens([5], [tokens], table(src_ids), sbs)
                md_dst = kvmulti.CommonAttentionMetadata.from_lens([5], [tokens], table(dst_ids), dbs)
                query = torch.randn(5, 2 * h, head, generator=g).to(torch.bfloat16)
                want = reference.paged_attention(query, caches[n], src[n], md_src, k_scale=scales[n][0],
                                                 v_scale=scales[n][1]).float()
                got = kvmulti.paged_attention(query, out[n], dst[n], md_dst, backend=dst_b, k_scale=k_scale,
                                              v_scale=v_scale).float()
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2,
                                           msg=lambda m: f"{src_backend} -> {dst_backend} {dtype} {n}: {m}")
