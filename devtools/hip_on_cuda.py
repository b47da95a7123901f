"""The HIP kernels on an NVIDIA GPU: ``hip/launcher.hip`` built with nvcc through ``hip/compat``
(:func:`kvmulti.backends.hip.build.build_nvidia_library`) and called through the same C ABI and
ctypes binding as the ROCm library, with CUDA tensors' ``data_ptr()``s and torch's current CUDA
stream. On NVIDIA the kernels take their non-MFMA path (wave 32, the FMA engine).

For the device check only: the dispatcher never picks this backend; pass the object as
``backend=`` to ``kvmulti.write_kv`` / ``prepare_step`` / ``paged_attention``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kvmulti.backends.hip.backend import HipBackend
from kvmulti.backends.hip.build import build_nvidia_library, cuda_arch
from kvmulti.backends.hip.library import load_library


class NvidiaHipBackend(HipBackend):
    """:class:`HipBackend` serving CUDA tensors from an nvcc-built library (``library``: its path;
    default: built for the current device's arch)."""

    platforms = ("cuda",)

    def __init__(self, library: Path | None = None, partition_size: int | None = None):
        super().__init__(partition_size)
        self.library_path = Path(library) if library is not None else build_nvidia_library(cuda_arch())
        self._lib = load_library(str(self.library_path))

    def unavailable_reasons(self) -> list[str]:
        return []

    def platform_reasons(self, platform: str) -> list[str]:
        return [] if platform == "cuda" else [f"the nvcc build of the HIP kernels runs on cuda, not {platform}"]

    def describe(self) -> str:
        return f"HIP kernels built with nvcc ({self.library_path.name})"

    def _library(self, device: torch.device) -> tuple[ctypes.CDLL, int, int | None]:
        if device.type != "cuda" or torch.version.hip:
            raise RuntimeError(f"the nvcc build of the HIP kernels cannot run tensors on {device}")
        return self._lib, 0, torch.cuda.current_stream(device).cuda_stream
