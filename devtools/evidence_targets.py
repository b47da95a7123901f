"""Which real GPU targets the compile evidence covers.

Every family's evidence tool (``devtools/hip_compile_check.py``, ``devtools/triton_cross_compile.py``,
``benchmarks/gpu_report.py`` over both) compiles for all of its targets unless
``KVMULTI_EVIDENCE_TARGETS`` names some (comma-separated, across families: ``sm_90,gfx942,gfx940``):
then each family compiles those of its targets that are named. The test suite's gate sets it to one
target per vendor family (``tests/tiers.py``); the exhaustive tier leaves it unset.
"""

from __future__ import annotations

from kvmulti import settings


def named() -> frozenset[str] | None:
    """The targets ``KVMULTI_EVIDENCE_TARGETS`` names; None when it is unset (every target)."""
    value = settings.get("KVMULTI_EVIDENCE_TARGETS")
    if not value:
        return None
    return frozenset(t.strip() for t in value.split(",") if t.strip())


def selected(targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Those of a family's ``targets`` the evidence covers, in their order."""
    names = named()
    return tuple(targets) if names is None else tuple(t for t in targets if t in names)
