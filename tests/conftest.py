"""Vendor markers (cuda / rocm / xpu) and the session line that says which vendor suites ran.

``KVMULTI_REQUIRE_VENDOR=cuda|rocm|xpu`` (set by that vendor's CI job) turns "this host has no such
device" into an ERROR of every test marked for that vendor instead of a skip, and fails the session
when none of them passed: a vendor job cannot go green by skipping. Without it, a vendor's tests
skip with the reason on hosts that lack its device.

Tools ``scripts/setup.sh --test`` installs into the venv (nvcc from PyPI) are found through PATH:
the directory of the interpreter running the tests is put on it.
"""

from __future__ import annotations

import os
import sys

import torch

# Triton kernels run under the interpreter on hosts without a GPU; it must be set before
# anything imports triton (importing kvmulti's custom ops does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # devtools
_VENV_BIN = os.path.dirname(sys.executable)
if _VENV_BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")

import tiers  # noqa: E402

# The gate compiles the GPU evidence for one target per vendor family; the exhaustive tier for all.
if not tiers.full():
    os.environ.setdefault("KVMULTI_EVIDENCE_TARGETS", ",".join(tiers.GATE_EVIDENCE_TARGETS))

settings.register_profile("kvmulti", deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.data_too_large])
# Under the sanitizers (tests/test_sanitizers.py) every native call is several times slower.
settings.register_profile("sanitizer", parent=settings.get_profile("kvmulti"), max_examples=4)
settings.load_profile(os.environ.get("KVMULTI_HYPOTHESIS_PROFILE") or "kvmulti")

VENDORS = ("cuda", "rocm", "xpu")
ENV_REQUIRE_VENDOR = "KVMULTI_REQUIRE_VENDOR"


def required_vendor() -> str | None:
    """The vendor whose tests must run here (KVMULTI_REQUIRE_VENDOR), or None."""
    value = os.environ.get(ENV_REQUIRE_VENDOR, "").strip().lower()
    if value and value not in VENDORS:
        raise pytest.UsageError(f"{ENV_REQUIRE_VENDOR}={value!r}: expected one of {', '.join(VENDORS)}")
    return value or None


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls run far faster on one thread on a shared, loaded 2-core box; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def vendor_available(vendor: str) -> str | None:
    """None if this host can run ``vendor``'s tests, else the reason it cannot."""
    if vendor == "cuda":
        ok = torch.cuda.is_available() and not torch.version.hip
        return None if ok else "no NVIDIA GPU (torch.cuda unavailable or a ROCm build)"
    if vendor == "rocm":
        ok = torch.cuda.is_available() and bool(torch.version.hip)
        return None if ok else "no AMD GPU with a ROCm build of torch"
    ok = hasattr(torch, "xpu") and torch.xpu.is_available()
    return None if ok else "no Intel GPU (torch.xpu unavailable)"


_ran: dict[str, int] = {v: 0 for v in VENDORS}

# Under pytest-xdist (`-n auto --dist loadgroup`, the README's test command) tests are spread over
# workers one by one, except these modules: their module- or session-scoped fixtures are costly
# (engine runs, model checkpoints, a wheel, cross-compiles with a second Triton), so each module
# runs whole on one worker and pays for them once. The compile-evidence modules share one worker:
# they read the same cross-compiles and device passes (Triton's cache, <kvmulti cache>/hip_check,
# sycl/gpu_evidence), which two workers would otherwise compute side by side.
COMPILE_EVIDENCE = frozenset({
    "test_gpu_report", "test_triton_compile", "test_hip_compile", "test_hip_byte_permutes", "test_roofline",
    "test_sycl_gpu_evidence",
})
ONE_WORKER_MODULES = frozenset({
    "test_model_runner", "test_models", "test_plugins", "test_spec_decode", "test_vllm_engine",
    "test_vllm_plugin", "test_vllm_kv_connector", "test_wheel", "test_triton_versions",
})


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    required = required_vendor()
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module in COMPILE_EVIDENCE:
            item.add_marker(pytest.mark.xdist_group("compile_evidence"))
            item.add_marker(pytest.mark.evidence)
        elif module in ONE_WORKER_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
        for vendor in VENDORS:
            if vendor in item.keywords and vendor != required:
                reason = vendor_available(vendor)
                if reason:
                    item.add_marker(pytest.mark.skip(reason=f"{vendor} suite: {reason}"))


def pytest_runtest_setup(item):
    required = required_vendor()
    if required and required in item.keywords:
        reason = vendor_available(required)
        if reason:   # an exception in setup: the test is reported as an ERROR, not skipped
            raise RuntimeError(f"{ENV_REQUIRE_VENDOR}={required} but {reason}")


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        for vendor in VENDORS:
            if vendor in report.keywords:
                _ran[vendor] += 1


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):   # an xdist worker: the controller sees every report
        return
    required = required_vendor()
    if required and _ran[required] == 0 and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if hasattr(terminalreporter.config, "workerinput"):
        return
    parts = [f"{v}: {_ran[v]} passed" if _ran[v] else f"{v}: not run ({vendor_available(v) or 'none selected'})"
             for v in VENDORS]
    terminalreporter.write_line("kvmulti vendor suites -- cpu: ran; " + "; ".join(parts))
    required = required_vendor()
    if required and _ran[required] == 0:
        terminalreporter.write_line(f"FAILED: {ENV_REQUIRE_VENDOR}={required} and no {required} test passed",
                                    red=True)
