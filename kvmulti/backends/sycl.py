"""Registry entry for the SYCL backend, which is not built yet: it reports that reason."""

from .base import UnavailableBackend


class SyclBackend(UnavailableBackend):
    name = "SYCL"
    platforms = ("xpu",)
    reason = "SYCL kernels are not built yet"
