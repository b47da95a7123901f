"""The device check (scripts/device_check.sh) stays runnable between GPU runs: its dry run on this
CPU host wires every step (the HIP sources compile with nvcc for sm_90 and bind through the
launcher's ABI, the cuda-marked tests collect, the report writers work on a fake result), and its
parsers read pytest's and compute-sanitizer's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools import device_check  # noqa: E402


def test_dry_run_wires_every_step(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), str(tmp_path), "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert result["dry_run"] is True
    names = [s["name"] for s in result["steps"]]
    assert names[:len(device_check.STEPS)] == [s.name for s in device_check.STEPS]
    assert all(s["status"] == "passed" for s in result["steps"]), result["steps"]
    assert "hip build" in names[1] and "ABI bound" in result["steps"][1]["summary"]
    assert (tmp_path / "device_check.md").read_text().startswith("# kvmulti device check")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device_check.json", "device_check.log", "device_check.md"]


def test_pytest_counts_from_the_final_line_or_the_progress_lines():
    final = "....\n===== 40 passed, 2 failed, 3 skipped, 1 error in 81.20s (0:01:21) =====\n"
    assert device_check.pytest_counts(final) == {"passed": 40, "failed": 2, "skipped": 3, "error": 1}
    stopped = ("[gw0] [  2%] PASSED tests/test_triton_gpu.py::test_gpu_corners[a-cuda]\n"
               "[gw1] [  4%] FAILED tests/test_triton_gpu.py::test_gpu_corners[b-cuda]\n"
               "tests/test_triton_gpu.py::test_gpu_corners[c-cuda] PASSED                 [  6%]\n")
    assert device_check.pytest_counts(stopped) == {"passed": 2, "failed": 1}


def test_sanitizer_summary_and_junit_failures(tmp_path):
    assert device_check.sanitizer_errors("========= ERROR SUMMARY: 2 errors\n") == 2
    assert device_check.sanitizer_errors("killed before the summary") is None
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="t" name="a"/>'
                     '<testcase classname="t" name="b"><failure message="boom">x</failure></testcase>'
                     '</testsuite></testsuites>')
    assert device_check.junit_failures(junit) == [{"test": "t::b", "message": "boom"}]


def test_cuda_marked_modules_are_found():
    files = device_check.cuda_test_files()
    assert "tests/test_triton_gpu.py" in files and "tests/test_ci.py" not in files
