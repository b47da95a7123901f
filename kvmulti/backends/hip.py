"""Registry entry for the HIP backend, which is not built yet: it reports that reason."""

from .base import UnavailableBackend


class HipBackend(UnavailableBackend):
    name = "HIP"
    platforms = ("rocm",)
    reason = "HIP kernels are not built yet"
