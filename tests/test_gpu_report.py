"""benchmarks/gpu_report.py runs here (no GPU); the thresholds of issue 18 are asserted on it:
a matrix instruction in every fp16/bf16 attention kernel, decode occupancy >= 2 work-groups per CU
on gfx942 and >= 2 CTAs per SM on sm_90, no spills in the sm_90 serving specialisations, and a
paper-model estimate for every device. Thresholds NOT met yet are strict xfails with the reason
(they fail the suite the day they start to hold, so the marker gets removed): spills elsewhere
(AMD SGPR spills, sm_80/sm_90 fp32 and wide mixed tiles), the pipelined sm_90 decode loop, gfx942
prefill SGPR spills. The report itself prints every threshold failure and exits 1 while any remains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_report  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_report") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=3600)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    data["stdout"] = done.stdout
    data["returncode"] = done.returncode
    return data


def _triton(report: dict) -> list[dict]:
    section = report["sections"]["triton"]
    assert "rows" in section, section
    return section["rows"]


def test_report_prints_every_target_and_its_threshold_failures(report):
    assert report["returncode"] == (1 if report["threshold_failures"] else 0)
    for failure in report["threshold_failures"]:
        assert failure in report["stdout"]
    rows = _triton(report)
    assert {r["target"] for r in rows} == {"sm_80", "sm_90", "gfx90a", "gfx942"}
    for target in ("sm_80", "sm_90", "gfx90a", "gfx942"):
        assert f"{target} " in report["stdout"]


def test_no_spills_in_sm90_serving_specialisations(report):
    serving = [r for r in _triton(report) if r["target"] == "sm_90" and r["spec"].startswith("model_")]
    assert serving and not [r["name"] for r in serving if r["spills"]]


@pytest.mark.xfail(strict=True, reason="open: AMD SGPR spills (to VGPR lanes) in most gfx90a/gfx942 attention "
                   "specialisations, sm_80/sm_90 spills in fp32 and head-80/64 mixed tiles (README, GPU evidence)")
def test_no_spills_anywhere(report):
    spilled = [(r["target"], r["name"], r["spills"]) for r in _triton(report) if r.get("spills")]
    assert not spilled, spilled


def test_matrix_instructions_where_the_dtype_allows(report):
    for r in _triton(report):
        if r["kernel"] == "unified_attention" and "fp32" not in r["spec"]:
            assert r["matrix_instructions"] > 0, (r["target"], r["name"])


@pytest.mark.parametrize("target", ["gfx942", "sm_90"])
def test_decode_occupancy_at_least_two_per_unit(report, target):
    decode = [r for r in _triton(report) if r["target"] == target and r["kernel"] == "unified_attention"
              and r["spec"].startswith("model_decode")]
    assert decode
    assert all(r["occupancy"] >= 2 for r in decode), [(r["name"], r["occupancy"]) for r in decode]


@pytest.mark.xfail(strict=True, reason="open on this branch: with the window/softcap as constexprs the sm_90 "
                   "pipeliner emits cp.async.wait_group 0 only; gpu-evidence-wip has the runtime-window variant "
                   "with wait_group 2 (README)")
def test_sm90_decode_loads_the_next_tile_during_the_dots(report):
    decode = [r for r in _triton(report) if r["target"] == "sm_90" and r["kernel"] == "unified_attention"
              and r["spec"].startswith("model_decode")]
    assert decode and all(max(r["wait_groups"]) >= 1 for r in decode), [r["wait_groups"] for r in decode]


def _gfx942_prefill(report: dict) -> list[dict]:
    return [r for r in _triton(report) if r["target"] == "gfx942" and r["kernel"] == "unified_attention"
            and r["spec"].startswith("model_prefill")]


def test_gfx942_large_cache_variant_is_reported_without_buffer_loads(report):
    prefill = _gfx942_prefill(report)
    large = next(r for r in prefill if r["spec"].endswith("_large_cache"))
    small = next(r for r in prefill if not r["spec"].endswith("_large_cache"))
    assert small["buffer_loads"] > large["buffer_loads"]     # > 2 GiB: Triton's AMD backend drops buffer loads


@pytest.mark.xfail(strict=True, reason="open: gfx942 prefill still spills 12-21 SGPRs (to VGPR lanes) after the "
                   "32-key unpipelined tiles; before: 23-30 (README)")
def test_gfx942_prefill_has_no_sgpr_spills_in_either_cache_variant(report):
    prefill = _gfx942_prefill(report)
    assert len(prefill) == 2 and all(r["sgpr_spills"] == 0 for r in prefill), prefill


def test_paper_model_estimates_every_device(report):
    model = report["paper_model"]
    for device in ("H100 SXM", "MI300X", "MI250X (one GCD)"):
        for case in ("decode", "prefill"):
            entry = next(m for m in model if m["device"] == device and m.get("case") == case)
            assert 0 < entry["fraction_of_floor"] <= 1, entry
            assert entry["estimate_us"] >= entry["floor_us"] > 0


def test_sections_plug_in_by_name_and_absent_ones_are_not_faked():
    assert set(gpu_report.SECTIONS) >= {"triton", "hip", "sycl"}
    func, source = gpu_report._section_function("sycl")
    if func is None:
        assert "have not published report rows" in source


def test_tile_period_is_littles_law():
    # no overlap: latency then math; one tile in flight during the dots hides half the latency
    assert gpu_report.tile_period(1e-7, 6e-7, 0) == pytest.approx(7e-7)
    assert gpu_report.tile_period(1e-7, 6e-7, 1) == pytest.approx(3.5e-7)
    assert gpu_report.tile_period(1e-6, 6e-7, 3) == pytest.approx(1e-6)     # math-bound
