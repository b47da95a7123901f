"""The CPU backend: native C++ kernel (sources in ``cpu/``) with a vectorised torch fallback."""

from .backend import CPUBackend, CPUPlan

__all__ = ["CPUBackend", "CPUPlan"]


def register() -> None:
    """Add CPU to kvmulti's registry: tried on CPU tensors, unnamed."""
    from ..registry import register_backend
    register_backend("CPU", CPUBackend, platforms=("cpu",), priority=10)
