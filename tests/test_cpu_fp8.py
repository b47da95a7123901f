"""The CPU backend's fp8 pieces: the in-register conversions of every ISA variant over all 256 codes,
the native quantiser against torch's at every rounding boundary, and the torch fallback path."""

import pytest
import torch

from kvmulti import fp8
from kvmulti.backends.cpu import native as cpu_native
from kvmulti.backends.cpu.backend import CPUBackend

from batches import CaseSpec
from test_fp8_backends import FORMATS, check_fp8


@pytest.fixture(scope="module")
def module():
    module, reason = cpu_native.status()
    if module is None:
        pytest.skip(f"native CPU kernel not available: {reason}")
    return module


def same_floats(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN matches any NaN."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_isa_widens_all_256_codes_exactly(module, fmt):
    codes = torch.arange(256, dtype=torch.uint8).repeat(3)[: 256 + 37].view(FORMATS[fmt])   # a ragged tail too
    for isa in module.available_isas():
        assert same_floats(module.fp8_to_f32(codes, isa), codes.float()), f"{isa} {fmt}"
    # the direct path's byte tables (variants with avx512vbmi), codes in every position of a 64-group
    shuffled = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=torch.Generator().manual_seed(1))]
    codes = torch.cat([codes.view(torch.uint8), shuffled, shuffled.roll(7)]).view(FORMATS[fmt])
    assert ("avx512bf16" in module.available_isas()) <= ("avx512bf16" in module.fp8_lut_isas())
    for isa in module.fp8_lut_isas():
        assert same_floats(module.fp8_to_f32(codes, isa, lut=True), codes.float()), f"{isa} {fmt} byte tables"


def boundary_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite code's value, the midpoints between neighbours and the floats either side of
    them, values past the saturation limit, ±inf, NaN, signed zeros, fp32 subnormals, random values."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[values.isfinite()].unique()
    mids = (values[:-1] + values[1:]) / 2
    inf = torch.tensor(float("inf"))
    specials = torch.tensor([float("nan"), float("-nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, -1e-40,
                             fp8.max_finite(dtype) * 1.06, 1e30, -1e30])
    rand = torch.randn(20000, generator=torch.Generator().manual_seed(0)) * fp8.max_finite(dtype) / 8
    return torch.cat([values, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), specials, rand])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3.0, 2.0 ** -10])
def test_native_quantiser_is_bit_identical_to_the_rule(module, fmt, scale):
    dtype = FORMATS[fmt]
    x = boundary_values(dtype) * scale         # x / scale lands on (or next to) the boundaries
    want = fp8.quantize(x[:, None], torch.tensor([scale]), dtype)[:, 0]
    got = module.quantize_fp8(x.contiguous(), scale, torch.empty(1, dtype=dtype))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_fallback_path_serves_fp8(fmt):
    fallback = CPUBackend(native_kernel=False)     # a backend object: the ops use it as it is
    for dtype, order, window, softcap, per_head in [(torch.bfloat16, "NHD", None, None, True),
                                                   (torch.float32, "HND", 9, 12.0, False)]:
        spec = CaseSpec(order=order, block_size=16, num_kv_heads=2, group=2, head_size=64, dtype=dtype,
                        query_lens=(1, 5), context_lens=(40, 7), sliding_window=window, softcap=softcap)
        check_fp8(spec, FORMATS[fmt], per_head, fallback)
