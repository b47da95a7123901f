"""Registry entry for the Triton backend, which is not built yet: it reports that reason."""

from .base import UnavailableBackend


class TritonBackend(UnavailableBackend):
    name = "TRITON"
    platforms = ("cuda", "rocm", "xpu",)
    reason = "TRITON kernels are not built yet"
