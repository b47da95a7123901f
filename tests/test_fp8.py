"""The fp8 contract (kvmulti/fp8.py): the quantisation rule and the scale arguments."""

import pytest
import torch

import kvmulti
from kvmulti import fp8, reference
from kvmulti.layout import KVCacheLayout


@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES)
def test_quantize_saturates_rounds_to_even_and_keeps_nan(dtype):
    top = fp8.max_finite(dtype)
    x = torch.tensor([[[top * 4, -top * 4, float("inf"), float("-inf"), float("nan"), 17.0, 19.0, 0.0]]])
    q = fp8.quantize(x, torch.tensor([1.0]), dtype).float()[0, 0]
    assert q[:4].tolist() == [top, -top, top, -top]
    assert torch.isnan(q[4])
    # 17 and 19 lie halfway between neighbours in every format (step 2 in e4m3, 4 in e5m2 above 16)
    assert q[5:7].tolist() == [16.0, 20.0] and q[7] == 0


@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES)
def test_quantize_divides_by_each_heads_scale(dtype):
    x = torch.full((3, 2, 4), 3.0)
    q = fp8.quantize(x, torch.tensor([2.0, 0.5]), dtype).float()
    assert torch.equal(q[:, 0], torch.full((3, 4), 1.5)) and torch.equal(q[:, 1], torch.full((3, 4), 6.0))


def test_scale_arguments_normalise_and_are_checked():
    e4m3, cpu = torch.float8_e4m3fn, torch.device("cpu")
    assert torch.equal(fp8.scale_tensor(None, "k_scale", e4m3, 3, cpu), torch.ones(3))
    assert torch.equal(fp8.scale_tensor(0.5, "k_scale", e4m3, 3, cpu), torch.full((3,), 0.5))
    assert torch.equal(fp8.scale_tensor(torch.tensor(2.0), "k_scale", e4m3, 3, cpu), torch.full((3,), 2.0))
    per_head = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(fp8.scale_tensor(per_head, "k_scale", e4m3, 3, cpu), per_head)
    assert fp8.scale_tensor(None, "k_scale", torch.float16, 3, cpu) is None
    bad = [(0.0, ValueError), (float("nan"), ValueError), (-1.0, ValueError), (True, TypeError),
           (torch.tensor([1.0, 2.0]), ValueError), (torch.tensor([1.0, 0.0, 1.0]), ValueError),
           (torch.tensor(1.0, dtype=torch.float64), TypeError)]
    for scale, error in bad:
        with pytest.raises(error, match="k_scale"):
            fp8.scale_tensor(scale, "k_scale", e4m3, 3, cpu)
    with pytest.raises(ValueError, match="fp8 caches only"):
        fp8.scale_tensor(1.0, "v_scale", torch.bfloat16, 3, cpu)


def test_ops_refuse_scales_for_a_non_fp8_cache_before_writing():
    layout = KVCacheLayout(2, 16, 2, 64, dtype=torch.float32)
    cache = layout.allocate("cpu").zero_()
    key = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="k_scale applies to fp8 caches only"):
        kvmulti.write_kv(key, key, cache, layout, torch.arange(3), k_scale=2.0)
    assert not cache.any()


@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES)
def test_oracle_reads_back_what_it_wrote_within_the_formats_precision(dtype):
    torch.manual_seed(0)
    layout = KVCacheLayout(4, 16, 2, 64, dtype=dtype, order="HND")
    cache = layout.allocate("cpu")
    key, value = torch.randn(20, 2, 64), torch.randn(20, 2, 64)
    k_scale, v_scale = torch.tensor([0.05, 0.02]), 0.03
    md = kvmulti.CommonAttentionMetadata.from_lens([20], [20], torch.tensor([[0, 1]]), 16)
    reference.write_kv(key, value, cache, layout, md.slot_mapping, k_scale, v_scale)
    keys = fp8.dequantize(layout.keys(cache).reshape(-1, 2, 64)[:20], k_scale)
    assert torch.allclose(keys, key, rtol=0.13, atol=0.05 * 2 ** -6)
    query = torch.randn(20, 4, 64, dtype=torch.bfloat16)
    out = reference.paged_attention(query, cache, layout, md, k_scale=k_scale, v_scale=v_scale)
    exact = torch.float32
    plain = KVCacheLayout(4, 16, 2, 64, dtype=exact, order="HND")
    plain_cache = plain.allocate("cpu")
    reference.write_kv(key, value, plain_cache, plain, md.slot_mapping)
    want = reference.paged_attention(query.float(), plain_cache, plain, md)
    tolerance = 0.15 if "e4m3" in str(dtype) else 0.4    # 3 vs 2 mantissa bits
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), want, atol=tolerance)
