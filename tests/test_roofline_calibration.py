"""The roofline model against the one GPU that measured kvmulti's kernels (an NVIDIA H200): its H200
rows (devtools/roofline_calibration.py) are within 30 % of docs/data/device_check.json's benchmark rows,
and the shared-memory wavefront count it uses follows the bank rules. Needs nvcc (the HIP rows) and
Triton's NVIDIA backend (the Triton rows); skips without them outside CI."""

from __future__ import annotations

import os

import pytest

from devtools import roofline as R
from devtools import roofline_calibration as C

#: rows the model reproduces within the tolerance ("TRITON now": today's prefill tiles against the
#: device bench's rows; "TRITON": the launches the device check ran)
REPRODUCED = [("HIP", "decode 32x4096"), ("HIP", "prefill 8x2048"), ("HIP", "prefill 1x8192"),
              ("TRITON", "decode 32x4096"), ("TRITON", "prefill 8x2048"), ("TRITON", "prefill 1x8192"),
              ("TRITON now", "prefill 8x2048"), ("TRITON now", "prefill 1x8192")]


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


def test_measured_fma_engine_tile_wavefronts():
    """The build the H200 ran: about 2,500 wavefronts per wave and 4 KiB tile, the QK reads' 8-way
    conflicts nearly all of them (its recorded figures)."""
    from devtools import roofline_hip_fma as F
    fma = F.MEASURED_KERNEL
    assert fma.tile_wavefronts["qk"] == 2 * 32 * (4 * 8 + 4)
    assert 2300 < sum(fma.tile_wavefronts.values()) < 2700 and fma.tile_bytes == 4096
    assert F.resident_blocks(fma) == 3


def test_current_fma_engine_reads_at_most_400_wavefronts_per_4kib():
    """The current FMA engine's sm_90 tile loop (nvcc through hip/compat, as the device check builds it):
    K / V in registers, only the query rows read from shared memory, conflict-free; the count is the
    SASS's shared accesses per trip (any access of another kind fails the read)."""
    from devtools import hip_compile_check as cc
    from devtools import roofline_hip_fma as F
    from devtools import roofline_sass as S
    _need(cc.nvcc() is not None, "nvcc")
    _need(S.cuobjdump() is not None, "cuobjdump")
    fma = F.current_sass()
    assert fma.tile_bytes == F.geometry().tile_bytes and fma.tile_keys == F.geometry().tile_keys
    assert 0 < fma.wavefronts_per_4kib <= F.MAX_WAVEFRONTS_PER_4KIB, F.format_current(fma)
    assert fma.shuffles > 0 and fma.tile_mix.get("lds", 0) * 4 == fma.tile_wavefronts["query"]


def test_fma_tile_prefill_loop_reads_k_and_v_once_per_key_and_chunk():
    """The prefill kernel's FMA tile engine on sm_90 (nvcc through hip/compat): per warp and 16-key tile, one
    LDS.128 of K and one of V per key and chunk (128), 8 STS.128 of the staging and nothing else shared; the
    reads take 4 wavefronts each (quarter-warps of 8 distinct 16-byte words), the stores 8 (2-way, 32-byte
    stride); about half of the FFMAs (QK) issue before the next tile's loads."""
    from devtools import hip_compile_check as cc
    from devtools import roofline_hip_prefill_fma as P
    from devtools import roofline_sass as S
    _need(cc.nvcc() is not None, "nvcc")
    _need(S.cuobjdump() is not None, "cuobjdump")
    tiles = P.current_sass()
    assert tiles.tile_wavefronts == {"reads": 128 * 4, "stores": 8 * 8}, P.format_current(tiles)
    assert tiles.ffma >= 2 * 16 * 4 * 4 * 4 and 0.4 < tiles.serial_share < 0.6, P.format_current(tiles)
    assert P.resident_blocks(tiles) >= 2


def _sass(*instructions: str) -> str:
    """cuobjdump-style SASS text of ``instructions`` at consecutive addresses, each with its control word."""
    lines = []
    for i, text in enumerate(instructions):
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;  /* 0x000000000000000000 */")
        lines.append("                                                                   /* 0x000fe20000000f00 */")
    return "\n".join(lines)


def test_fma_tile_prefill_read_rejects_a_shared_access_without_a_pattern():
    from devtools import roofline_hip_prefill_fma as P
    sass = _sass("STS.128 [R1], R4", "BAR.SYNC.DEFER_BLOCKING 0x0", "FFMA R1, R2, R3, R4", "LDS.128 R8, [R2]",
                 "LDG.E.128 R4, desc[UR4][R2.64]", "LDS R5, [R3]", "BRA 0x0")
    with pytest.raises(ValueError, match="without a known pattern"):
        P.read_sass(sass, "Used 100 registers, 1024 bytes smem")


def test_wavefront_count_rejects_a_shared_access_without_a_pattern():
    from devtools import roofline_hip_fma as F
    geo = F.geometry()
    loads = geo.passes * 2 * geo.pieces_per_lane
    sass = _sass("FFMA R1, R2, R3, R4", *["LDG.E.128 R4, desc[UR4][R2.64]"] * loads,
                 "SHFL.BFLY PT, R5, R6, 0x1, 0x1f", "STS [R1], R5", "BRA 0x0")
    with pytest.raises(ValueError, match="STS"):
        F.read_sass(sass, "Used 100 registers, 1024 bytes smem")


@pytest.mark.parametrize("impl,shape", REPRODUCED)
def test_h200_row_within_30_percent_of_the_measurement(rows, impl, shape):
    r = rows[(impl, shape)]
    assert abs(r["error"]) <= C.TOLERANCE, C.format_rows([r])


def test_triton_prefill_rows_run_the_device_checks_tiles(rows):
    """The device check's prefill rows are modelled with the tiles it ran (128 x 64 over 8 warps: two
    warpgroups at a barrier every key tile, their matrix work in lockstep), today's with 64 x 64."""
    for shape in ("prefill 8x2048", "prefill 1x8192"):
        assert "tile 128x64, 8 warps" in rows[("TRITON", shape)]["notes"], rows[("TRITON", shape)]
        assert "matrix work in lockstep" in rows[("TRITON", shape)]["notes"]
        assert "tile 64x64, 4 warps" in rows[("TRITON now", shape)]["notes"], rows[("TRITON now", shape)]
        assert "lockstep" not in rows[("TRITON now", shape)]["notes"]


def test_hip_rows_are_bound_by_shared_memory(rows):
    for shape in ("decode 32x4096", "prefill 8x2048"):
        assert rows[("HIP", shape)]["bound"] == "shared", rows[("HIP", shape)]
