"""The roofline model against the one GPU that measured kvmulti's kernels (an NVIDIA H200): its H200
rows (devtools/roofline_calibration.py) are within 30 % of docs/data/device_check.json's benchmark rows,
and the shared-memory wavefront count it uses follows the bank rules. Needs nvcc (the HIP rows) and
Triton's NVIDIA backend (the Triton rows); skips without them outside CI."""

from __future__ import annotations

import os

import pytest

from devtools import roofline as R
from devtools import roofline_calibration as C

#: rows the model reproduces within the tolerance
REPRODUCED = [("HIP", "decode 32x4096"), ("HIP", "prefill 8x2048"), ("HIP", "prefill 1x8192"),
              ("TRITON", "decode 32x4096")]
#: rows it does not (yet): the Triton prefill loop's wave stream from the SASS plus its wgmma at the
#: measured matmul rate comes out 1.5x faster than the H200 ran it; what the model misses is not established
NOT_REPRODUCED = {("TRITON", "prefill 8x2048"): "model -33 %: Triton prefill not reproduced",
                  ("TRITON", "prefill 1x8192"): "model -32 %: Triton prefill not reproduced"}


def _need(tool_ok: bool, what: str) -> None:
    if not tool_ok:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{what} missing (CI=true: this check must run)")
        pytest.skip(f"{what} missing")


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str], dict]:
    from devtools import hip_compile_check as cc
    from devtools import roofline_sass as S
    pytest.importorskip("triton")
    _need(cc.nvcc() is not None, "nvcc")
    _need(S.cuobjdump() is not None, "cuobjdump")
    return {(r["impl"], r["shape"]): r for r in C.calibration_rows()}


def test_measured_ceilings_are_the_h200_targets():
    ceilings = C.measured_ceilings()
    assert ceilings["copy"] == pytest.approx(R.H200_COPY_BYTES_PER_S, rel=2e-3)
    assert ceilings["matmul"] == pytest.approx(R.H200_MATMUL_FLOPS, rel=2e-3)
    assert R.H200.bandwidth == pytest.approx(R.H200_COPY_BYTES_PER_S)
    assert R.H200.matrix_peak * R.H200.matrix_rate["wgmma"] == pytest.approx(R.H200_MATMUL_FLOPS)
    assert R.H200.measured and R.H200.l2_source and R.H200.sources and R.H200.latency_source


def test_shared_wavefronts_follow_the_bank_rules():
    lanes = range(32)
    assert R.shared_wavefronts([4 * i for i in lanes], 4) == 1                  # one word per bank
    assert R.shared_wavefronts([0] * 32, 4) == 1                                # broadcast
    assert R.shared_wavefronts([128 * i for i in lanes], 4) == 32               # all in bank 0
    assert R.shared_wavefronts([2 * i for i in lanes], 2) == 1                  # pairs share a word
    assert R.shared_wavefronts([8 * i for i in lanes], 8) == 2                  # half-warp phases
    assert R.shared_wavefronts([16 * i for i in lanes], 16) == 4                # quarter-warp phases
    # the FMA engine's K read: 8 keys 256 bytes apart, 4 lanes each
    assert R.shared_wavefronts([0x1000 + 256 * (i % 8) for i in lanes], 2) == 8
    assert R.shared_wavefronts([None] * 32, 4) == 0
    assert R.shared_wavefronts([4 * i for i in range(64)], 4, banks=64) == 1    # 64-bank LDS, wave64
    assert R.shared_wavefronts([4 * i for i in range(64)], 4, banks=32) == 2


def test_fma_engine_tile_wavefronts(rows):
    """About 2,500 wavefronts per wave and 4 KiB tile, the QK reads' 8-way conflicts nearly all of them."""
    from devtools import roofline_hip_fma as F
    fma = F.read_sass(*F.compile_sass())
    waves = F.tile_wavefronts(fma)
    assert fma.qk_loads.count(2) == 4 and fma.qk_loads.count(16) == 1
    assert waves["qk"] == 2 * 32 * (4 * 8 + 4)
    assert 2300 < sum(waves.values()) < 2700
    assert F.resident_blocks(fma) == 3


@pytest.mark.parametrize("impl,shape", REPRODUCED)
def test_h200_row_within_30_percent_of_the_measurement(rows, impl, shape):
    r = rows[(impl, shape)]
    assert abs(r["error"]) <= C.TOLERANCE, C.format_rows([r])


@pytest.mark.parametrize("impl,shape", sorted(NOT_REPRODUCED))
def test_h200_rows_not_reproduced_yet(rows, impl, shape, request):
    request.applymarker(pytest.mark.xfail(strict=True, reason=NOT_REPRODUCED[(impl, shape)]))
    assert abs(rows[(impl, shape)]["error"]) <= C.TOLERANCE, C.format_rows([rows[(impl, shape)]])


def test_hip_rows_are_bound_by_shared_memory(rows):
    for shape in ("decode 32x4096", "prefill 8x2048"):
        assert rows[("HIP", shape)]["bound"] == "shared", rows[("HIP", shape)]
