"""The CPU backend: native C++ kernel (sources in ``cpu/``) with a vectorised torch fallback."""

from .backend import CPUBackend, CPUPlan

__all__ = ["CPUBackend", "CPUPlan"]
