"""The Triton releases the Triton compile evidence covers (``kvmulti/backends/triton/tiles.py``'s
``GATED_TRITON``): the newest, the one the venv installs (the ``triton`` extra), and :data:`PINNED`,
the one torch's CUDA wheels pin for the torch the project installs (torch 2.13.0 requires
``triton==3.7.1``), which ``scripts/setup.sh --test`` installs beside it with
``pip install --target`` into :func:`pinned_dir`. A compile worker with that directory first on its
PYTHONPATH imports, plans for and compiles with the pinned release
(``triton_cross_compile.compile_in_subprocesses(triton_dir=...)``).

The gate compiles a subset with the pinned release (:func:`gate_spec_names`): the batches whose
launches differ between the two releases (the version-aware choices of tiles.py) and the serving
model's batches; the exhaustive tier compiles every batch with both.
"""

from __future__ import annotations

import functools
from pathlib import Path

from devtools import triton_cross_compile as xc

#: The Triton torch 2.13.0's CUDA wheels pin (``Requires-Dist: triton==3.7.1``); scripts/setup.sh
#: installs the same release (tests/test_triton_versions.py checks that they agree).
PINNED = "3.7.1"

ROOT = Path(__file__).resolve().parents[1]


def pinned_dir() -> Path:
    """Where ``scripts/setup.sh --test`` installs :data:`PINNED` (``pip install --target``)."""
    return ROOT / ".triton" / PINNED


def pinned_version() -> tuple[int, int]:
    """(major, minor) of :data:`PINNED`."""
    from kvmulti.backends.triton import tiles
    return tiles.parse_triton_version(PINNED)


def missing_reason() -> str | None:
    """None when :func:`pinned_dir` holds Triton :data:`PINNED`, else what is missing."""
    dist = pinned_dir() / f"triton-{PINNED}.dist-info"
    if not (pinned_dir() / "triton" / "__init__.py").is_file() or not dist.is_dir():
        return (f"Triton {PINNED} (the release torch 2.13's CUDA wheels pin) is not installed in {pinned_dir()}: "
                f"run scripts/setup.sh --test")
    return None


def _plan_key(launch) -> tuple:
    """What a launch's compiled code depends on besides tensor pointers: kernel, warps, stages and
    every non-tensor argument."""
    import torch
    scalars = tuple(sorted((k, v) for k, v in launch.args.items() if not isinstance(v, torch.Tensor)))
    return launch.kernel, launch.num_warps, launch.num_stages, scalars


@functools.lru_cache(maxsize=None)
def differing_spec_names(target_name: str, versions: tuple[tuple[int, int], tuple[int, int]]) -> list[str]:
    """Names of the :func:`triton_cross_compile.batch_specs` of ``target_name`` whose launches the
    planner makes differently for the two Triton ``versions`` (planning only, nothing compiles)."""
    target = xc.TARGETS[target_name]
    out = []
    for spec in xc.batch_specs(target_name):
        keys = [[_plan_key(ln) for _, ln in xc.launches(spec, target.family, target.planner_arch, v)]
                for v in versions]
        if keys[0] != keys[1]:
            out.append(spec.name)
    return out


def gate_spec_names(target_name: str) -> list[str]:
    """The batches the gate compiles with :data:`PINNED` on ``target_name``: those whose launches
    differ from the newest release's (:func:`differing_spec_names`) and the serving model's
    (:func:`triton_cross_compile.model_specs`)."""
    from kvmulti.backends.triton import tiles
    names = differing_spec_names(target_name, (pinned_version(), tiles.GATED_TRITON[-1]))
    names += [s.name for s in xc.model_specs(xc.TARGETS[target_name]) if s.name not in names]
    return names
