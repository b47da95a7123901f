"""What a test needs from the host: without it the test is a skip here, and a failure in CI
(``CI`` = 1 / true / yes), where everything the suite needs is installed."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip the test with ``reason``; under CI, fail it."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


def require_native_cpu_kernel() -> None:
    """The native CPU kernel is built here (else :func:`unavailable`, naming why not)."""
    from kvmulti.backends.cpu import native
    module, reason = native.status()
    if module is None:
        unavailable(f"the native CPU kernel is not built here: {reason}")
