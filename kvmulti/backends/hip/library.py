"""The C ABI of ``hip/launcher.hip`` through ctypes: the CPU-harness library, the ROCm one, and any
other GPU build of it (the nvcc one of the device check)."""

from __future__ import annotations

import ctypes
import threading

import torch

from .build import HipBuildError, build_cpu_library, build_rocm_library, prebuilt_rocm_library

ABI_VERSION = 7
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: cache_dtype codes: a query-dtype cache as DTYPE_CODES, fp8 caches 3 (e4m3fn), 4 (e5m2), 5 (e4m3fnuz)
#: and 6 (e5m2fnuz)
CACHE_DTYPE_CODES = {**DTYPE_CODES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4, torch.float8_e4m3fnuz: 5,
                     torch.float8_e5m2fnuz: 6}

_I, _LL, _F, _P = ctypes.c_int, ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p


def _bind(lib: ctypes.CDLL, harness: bool) -> ctypes.CDLL:
    lib.kvmulti_hip_abi_version.restype = _I
    if lib.kvmulti_hip_abi_version() != ABI_VERSION:
        raise HipBuildError(f"{lib._name}: ABI version {lib.kvmulti_hip_abi_version()} != {ABI_VERSION}; rebuild it")
    lib.kvmulti_hip_plan.argtypes = [_I, _I, _I, _I, _I, ctypes.POINTER(_I), ctypes.POINTER(_I)]
    lib.kvmulti_hip_plan.restype = _I
    lib.kvmulti_hip_workspace_floats.argtypes = [_I, _I, _I, _I]
    lib.kvmulti_hip_workspace_floats.restype = _LL
    lib.kvmulti_hip_wave_size.argtypes = [_I]
    lib.kvmulti_hip_wave_size.restype = _I
    lib.kvmulti_hip_head_sizes.argtypes = [ctypes.POINTER(_I), _I]
    lib.kvmulti_hip_head_sizes.restype = _I
    lib.kvmulti_hip_paged_attention.argtypes = ([_I, _I, _P, _P, _I, _I, _P, _P, _P, _P, _P, _P] + [_LL] * 8 + [_I] * 6
                                                + [_F, _F, _I, _I, _P, _I, _I, _I, _I, _I, _I, _P, _P, _I, _P])
    lib.kvmulti_hip_paged_attention.restype = _I
    lib.kvmulti_hip_write_kv.argtypes = [_I, _I, _P, _P, _P, _P, _P, _P] + [_LL] * 9 + [_I] * 6 + [_P]
    lib.kvmulti_hip_write_kv.restype = _I
    lib.kvmulti_hip_error_string.argtypes = [_I]
    lib.kvmulti_hip_error_string.restype = ctypes.c_char_p
    if harness:
        lib.kvcpu_set_warp_size.argtypes = [_I]
        lib.kvcpu_set_warp_size.restype = _I
        lib.kvcpu_last_error.restype = ctypes.c_char_p
        lib.kvcpu_clear_error.restype = None
        lib.kvcpu_static_shared_bytes.restype = _LL
    return lib


_cpu_lib: ctypes.CDLL | None = None
_rocm_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def load_cpu_library() -> ctypes.CDLL:
    global _cpu_lib
    with _lib_lock:
        if _cpu_lib is None:
            _cpu_lib = _bind(ctypes.CDLL(str(build_cpu_library())), harness=True)
        return _cpu_lib


def load_rocm_library() -> ctypes.CDLL:
    global _rocm_lib
    with _lib_lock:
        if _rocm_lib is None:
            path = prebuilt_rocm_library() or build_rocm_library()
            _rocm_lib = _bind(ctypes.CDLL(str(path)), harness=False)
        return _rocm_lib


def load_library(path: str) -> ctypes.CDLL:
    """A GPU build of launcher.hip at ``path`` (not the CPU harness), bound and ABI-checked; each call
    loads it (ctypes shares one handle per path)."""
    return _bind(ctypes.CDLL(str(path)), harness=False)


def check(lib: ctypes.CDLL, err: int, what: str, harness: bool) -> None:
    """Raise RuntimeError with the library's message (and the harness's detail) for ``err`` != 0."""
    if err == 0:
        return
    msg = lib.kvmulti_hip_error_string(err).decode()
    if harness:
        detail = lib.kvcpu_last_error().decode()
        lib.kvcpu_clear_error()
        if detail:
            msg += f": {detail}"
    raise RuntimeError(f"kvmulti HIP {what} failed: {msg}")
