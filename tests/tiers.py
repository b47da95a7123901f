"""The suite's two tiers (docs/ci.md).

* The gate: the README's test command, which ``.ci/run`` calls (``-m "not ipex and not
  exhaustive"``). Every backend's oracle suites, every contract and bad-input suite, the vLLM
  engine at its smallest useful size, and the compile evidence for one target per vendor family
  (:data:`GATE_EVIDENCE_TARGETS`).
* The exhaustive tier: ``scripts/check_all.sh`` (``KVMULTI_CHECK_TIER=all``): the tests marked
  ``exhaustive``, the compile evidence for every target, and the property tests at their full
  example counts.
"""

from __future__ import annotations

from kvmulti import settings

#: The gate's compile-evidence targets (``KVMULTI_EVIDENCE_TARGETS``): HIP (clang-19) for a CDNA
#: (gfx942, MI300X) and an RDNA (gfx1100) target and, through hip/compat, for sm_90; Triton for sm_90
#: and gfx942; SYCL for PVC. The exhaustive tier adds HIP's gfx90a, gfx940, gfx1030 (hipcc), gfx1201
#: and sm_80 and Triton's sm_80 and gfx90a.
GATE_EVIDENCE_TARGETS = ("gfx942", "gfx1100", "sm_90", "pvc")


def full() -> bool:
    """True in the exhaustive tier (``KVMULTI_CHECK_TIER=all``)."""
    return settings.get("KVMULTI_CHECK_TIER") == "all"


def examples(count: int) -> int:
    """``max_examples`` of a property test whose full count is ``count``: all of them in the
    exhaustive tier, a quarter (at least 4) in the gate."""
    return count if full() else max(4, count // 4)
