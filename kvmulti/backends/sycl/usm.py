"""USM memory as torch CPU tensors: device-shared allocations that SYCL kernels use in place, the
cache allocator for ``KVCacheLayout.allocate``, and the staging of plain CPU tensors for devices
that cannot read host memory."""

from __future__ import annotations

import ctypes
import warnings

import torch

from . import runtime
from .runtime import Session, SyclError, default_session


def _wrap(ptr: int, nbytes: int, dtype: torch.dtype, owner_free=None) -> torch.Tensor:
    """A 1-D torch CPU tensor viewing ``nbytes`` at ``ptr``; ``owner_free(ptr)`` runs when the last
    tensor viewing the memory is gone (None: the caller frees)."""
    base = ctypes.c_uint8 * nbytes
    if owner_free is None:
        buf = base.from_address(ptr)
    else:
        def _release(self, _ptr=ptr, _free=owner_free):
            if not runtime.exiting():
                try:
                    _free(_ptr)
                except Exception:  # noqa: BLE001 - never raise from a finalizer
                    pass
        buf = type("UsmSharedBuffer", (base,), {"__del__": _release}).from_address(ptr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype)


def usm_empty(numel: int, dtype: torch.dtype, session: Session | None = None) -> torch.Tensor:
    """A 1-D torch CPU tensor of ``numel`` elements in USM shared memory (zero-copy, freed with the
    tensor). Kernels on the session's device read and write it directly."""
    session = session or default_session()
    nbytes = max(1, numel) * dtype.itemsize
    ptr = session.malloc_shared(nbytes)
    return _wrap(ptr, nbytes, dtype, session.free)[:numel]


def usm_allocator(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``KVCacheLayout.allocate(device, allocator=usm_allocator)``: a cache the SYCL device uses in place.

    CPU device: USM shared memory of the default SYCL device, as a zero-copy torch CPU tensor.
    XPU device: a torch XPU tensor (torch's XPU allocator already hands out USM device memory).
    """
    device = torch.device(device)
    if device.type == "xpu":
        return torch.empty(numel, dtype=dtype, device=device)
    if device.type != "cpu":
        raise ValueError(f"usm_allocator serves cpu and xpu devices, not {device}")
    return usm_empty(numel, dtype)


class Staging:
    """Pointers the device can use for torch CPU tensors: USM tensors as they are; plain CPU tensors
    as they are when ``stage`` is False (a device with usm_system_allocations, such as Intel's
    OpenCL CPU device, reads host memory directly), else through a USM shared copy with the same
    strides (copied back on finish when written)."""

    def __init__(self, session: Session, stage: bool = True):
        self.session = session
        self.stage = stage
        self.allocs: list[int] = []
        self.writeback: list[tuple[torch.Tensor, torch.Tensor]] = []

    def ptr(self, t: torch.Tensor | None, written: bool = False) -> int:
        if t is None or t.numel() == 0:
            return 0
        if not self.stage or self.session.is_usm(t):
            return t.data_ptr()
        if any(s < 0 for s in t.stride()):
            raise SyclError("negative strides are not supported")
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        nbytes = span * t.element_size()
        ptr = self.session.malloc_shared(nbytes)
        self.allocs.append(ptr)
        staged = _wrap(ptr, nbytes, t.dtype).as_strided(t.shape, t.stride())
        staged.copy_(t)
        if written:
            self.writeback.append((t, staged))
        return ptr

    def finish(self, ok: bool = True) -> None:
        try:
            if ok:
                for t, staged in self.writeback:
                    t.copy_(staged)
        finally:
            for p in self.allocs:
                self.session.free(p)
            self.allocs.clear()
            self.writeback.clear()
