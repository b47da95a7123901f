"""A reference fp8 quantiser written from the formats' code tables, independent of torch's casts."""

from __future__ import annotations

import torch

from kvmulti import fp8


def reference_code(v: float, dtype: torch.dtype) -> int | None:
    """The code of ``dtype`` that stores ``v``: saturate beyond the largest finite value, else the
    nearest value, ties to the even code; a zero keeps its sign where the format has -0 (FNUZ: +0).
    None: NaN (the caller checks for the format's NaN)."""
    if v != v:
        return None
    values = torch.arange(128, dtype=torch.uint8).view(dtype).float().tolist()     # sign bit clear
    mag = min(abs(v), torch.finfo(dtype).max)
    _, _, code = min((abs(x - mag), code % 2, code) for code, x in enumerate(values)
                     if x == x and x != float("inf"))
    if v < 0 or (v == 0 and str(v).startswith("-")):
        code = code | 0x80 if code or not fp8.is_fnuz(dtype) else 0
    return code


def probe_values(dtype: torch.dtype) -> torch.Tensor:
    """fp32 values that pin a quantiser down: every finite value of the format, each midpoint
    between neighbours and the floats just either side of it, beyond-range values, ±inf, ±0, NaN."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = torch.sort(values[torch.isfinite(values)].unique()).values
    mids = (finite[1:] + finite[:-1]) / 2
    top = torch.finfo(dtype).max
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, top * 1.0625, -top * 4,
                            1e-30, -1e-30])
    up, down = torch.full_like(mids, float("inf")), torch.full_like(mids, -float("inf"))
    return torch.cat([finite, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), special])
