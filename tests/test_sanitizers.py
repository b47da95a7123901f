"""The native paths under AddressSanitizer + UndefinedBehaviorSanitizer.

One test runs a selection of the suite in a subprocess with ``KVMULTI_SANITIZE=1`` (the CPU kernel,
the HIP CPU-harness library and the SYCL host shim are rebuilt with ``-fsanitize=address,undefined``
into their own cache) and ``libasan`` preloaded into Python. Any sanitizer report aborts that
process, so the test fails on the first out-of-bounds access, use-after-free or undefined behaviour.

What it covers (``SELECTION``): the CPU kernel against the oracle (valid batches, partitions, the
bf16 direct path, its bounds tests), the fuzzing of valid and corrupted metadata on the backends
that run here, and the HIP harness backend tests (bad inputs and corrupted metadata handed to the
backend directly). Hypothesis examples are fewer there (the ``sanitizer`` profile).

Not covered: the SYCL host shim. It is BUILT with the sanitizers under ``KVMULTI_SANITIZE=1``, but the
SYCL runtime cannot be loaded into an ASan process: its loader dlopens libraries with RTLD_DEEPBIND,
which the ASan runtime refuses (google/sanitizers issue 611) and aborts. The run therefore points
``KVMULTI_SYCL_ROOT`` at an empty folder, so SYCL reports itself unavailable there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from availability import unavailable
from kvmulti.backends.cpu import native as cpu_native

REPO = Path(__file__).resolve().parents[1]

#: pytest node selections run under the sanitizers.
SELECTION = (
    "tests/test_fuzz_metadata.py",
    "tests/test_cpu_native.py",
    "tests/test_validation.py",
    "tests/test_hip_backend.py",
)


def sanitizer_runtime() -> str | None:
    """Path of gcc's libasan.so (None when the compiler has none)."""
    try:
        path = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return path if path and os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.exhaustive
def test_native_paths_under_asan_and_ubsan(tmp_path):
    runtime = sanitizer_runtime()
    if runtime is None:
        unavailable("no libasan.so next to gcc (CI needs it for the sanitizer run)")
    env = dict(os.environ)
    # the CPU kernel's variants this host cannot run are not built (they could not run under the sanitizers)
    env["KVMULTI_CPU_EXTRA_CFLAGS"] = cpu_native.host_only_extra_cflags(env.get("KVMULTI_CPU_EXTRA_CFLAGS", ""))
    env.update(KVMULTI_SANITIZE="1", LD_PRELOAD=runtime,
               KVMULTI_CACHE_DIR=os.environ.get("KVMULTI_SANITIZE_CACHE_DIR", str(Path.home() / ".cache" /
                                                                                   "kvmulti-sanitize")),
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=0:"
                            "handle_segv=1:allocator_may_return_null=1",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
               KVMULTI_HYPOTHESIS_PROFILE="sanitizer", KVMULTI_SYCL_ROOT=str(tmp_path / "no-sycl-under-asan"))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
                          *SELECTION],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    tail = (run.stdout[-6000:] + "\n" + run.stderr[-6000:])
    assert run.returncode == 0, tail
    assert "ERROR: AddressSanitizer" not in run.stderr and "runtime error:" not in run.stderr, tail
    assert " passed" in run.stdout, tail
