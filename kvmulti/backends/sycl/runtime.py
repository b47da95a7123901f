"""The SYCL runtime as the SYCL backend uses it: the g++-built host shim (``sycl/shim.cpp``, a C ABI
over the runtime from PyPI, called through ctypes), devices, sessions (a queue + the kernel bundles
compiled for it by the oneAPI kernel_compiler), USM memory and the staging of plain CPU tensors.
The sources, the runtime's location and the shim's build are in build.py.

Environment: the runtime's OpenCL loader is pointed at ``<runtime>/lib/libintelocl.so``
(``OCL_ICD_FILENAMES``, only when the user has not set it) before the runtime loads;
``ONEAPI_DEVICE_SELECTOR`` is never set. Compiled kernels live in SYCL's persistent cache
(``SYCL_CACHE_PERSISTENT=1``, ``SYCL_CACHE_DIR`` defaulting to ``<kvmulti cache>/sycl/kernels``).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import native_build, settings
from .build import (SHIM_ABI, SHIM_FLAGS, SyclBuildError, SyclError, build_shim, cache_root,  # noqa: F401
                    compiler, configure_environment, find_runtime, kernel_source, runtime_candidates,
                    runtime_version, shim_command, shim_path, source_dir)

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: kvm_paged_prefill: the attention kernel for tiles of more than MR rows (kernels.cpp: the rows-on-lanes
#: matrix body where the build has it); the *_terms kernels: the same two with ALiBi / non-causal compiled
#: in, present only in bundles built with -DKVM_TERMS=1
KERNEL_NAMES = ("kvm_paged_attention", "kvm_split_reduce", "kvm_write_kv", "kvm_paged_prefill",
                "kvm_paged_attention_terms", "kvm_paged_prefill_terms")
K_ATTN, K_REDUCE, K_WRITE, K_PREFILL, K_ATTN_TERMS, K_PREFILL_TERMS = range(6)
PLAIN_KERNEL_NAMES = KERNEL_NAMES[:K_ATTN_TERMS]

ARG_PTR, ARG_I32, ARG_I64, ARG_F32, ARG_LOCAL_F32, ARG_LOCAL_I32, ARG_LOCAL_I64 = range(7)
USM_UNKNOWN, USM_HOST, USM_DEVICE, USM_SHARED = range(4)


# ------------------------------------------------------------------------------------ the runtime
@dataclass(frozen=True)
class DeviceInfo:
    index: int
    backend: str        # opencl | level_zero | ...
    type: str           # cpu | gpu | ...
    name: str
    driver: str
    compute_units: int
    max_work_group: int
    local_mem: int
    can_compile: bool
    fp16: bool
    usm_shared: bool
    usm_system: bool    # kernels may use plain host memory (torch CPU tensors) directly
    matrix_sg16: bool = False  # runs the sub-group-16 matrix built-ins (dpas; e.g. PVC, not DG2)

    def line(self) -> str:
        ok = "kernel compiler ok" if self.can_compile else "cannot compile SYCL source"
        mem = ", uses host memory directly" if self.usm_system else ""
        return f"[{self.index}] {self.backend}:{self.type} {self.name} (driver {self.driver}, {ok}{mem})"


def _device_info(index: int, f: list[str]) -> DeviceInfo:
    return DeviceInfo(index, f[0], f[1], f[2], f[3], int(f[4]), int(f[5]), int(f[6]), f[7] == "1", f[8] == "1",
                      f[9] == "1", f[10] == "1", len(f) > 11 and f[11] == "1")


def _parse_devices(text: str) -> list[DeviceInfo]:
    out = []
    for i, line in enumerate(l for l in text.splitlines() if l.strip()):
        f = line.split("\t")
        out.append(_device_info(i, f))
    return out


class _Shim:
    """ctypes bindings of shim.cpp."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        vp, sz, i32, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p
        sig = {
            "kvm_last_error": (cp, []),
            "kvm_list_devices": (i32, [cp, sz]),
            "kvm_session_create": (vp, [i32]),
            "kvm_session_from_queue": (vp, [vp]),
            "kvm_session_destroy": (None, [vp]),
            "kvm_session_key": (ctypes.c_uint64, [vp]),
            "kvm_session_describe": (i32, [vp, cp, sz]),
            "kvm_build": (vp, [vp, cp, ctypes.POINTER(cp), i32, ctypes.POINTER(cp), i32]),
            "kvm_bundle_destroy": (None, [vp]),
            "kvm_launch": (i32, [vp, vp, i32, sz, sz, i32, ctypes.POINTER(ctypes.c_int32),
                                 ctypes.POINTER(ctypes.c_int64), i32]),
            "kvm_wait": (i32, [vp]),
            "kvm_malloc": (vp, [vp, sz, i32]),
            "kvm_free": (i32, [vp, vp]),
            "kvm_pointer_type": (i32, [vp, vp]),
            "kvm_memcpy": (i32, [vp, vp, vp, sz]),
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib

    def error(self) -> str:
        return (self.lib.kvm_last_error() or b"").decode(errors="replace")

    def check(self, rc, what: str):
        if rc is None or (isinstance(rc, int) and rc < 0):
            raise SyclError(f"{what}: {self.error()}")
        return rc

    def text(self, fn, *args) -> str:
        n = 4096
        while True:
            buf = ctypes.create_string_buffer(n)
            need = self.check(fn(*args, buf, n), fn.__name__)
            if need < n:
                return buf.value.decode(errors="replace")
            n = need + 1


class Runtime:
    """The loaded shim plus what it found: devices, the default session, sessions on torch queues."""

    def __init__(self, root: Path):
        self.root = root
        configure_environment(root)
        self.shim = _Shim(build_shim(root))
        self.devices = _parse_devices(self.shim.text(self.shim.lib.kvm_list_devices))
        self._default: Session | None = None
        self._queues: dict[int, Session] = {}
        self._lock = threading.RLock()
        #: kernel bundles per (context/device key, source hash, options): shared by sessions on
        #: different queues of one context and device
        self.bundles: dict[tuple, int] = {}
        self.build_lock = threading.Lock()

    def default_device_index(self) -> int:
        """``KVMULTI_SYCL_DEVICE`` resolved to an index (-1: GPUs first, then CPUs)."""
        want = (settings.get("KVMULTI_SYCL_DEVICE") or "").lower()
        if not want:
            return -1
        if want.lstrip("-").isdigit():
            return int(want)
        backend, _, dtype = want.rpartition(":") if ":" in want else ("", "", want)
        for d in self.devices:
            if d.type == dtype and backend in ("", d.backend):
                return d.index
        raise SyclError(f"KVMULTI_SYCL_DEVICE={want!r} matches no SYCL device; devices: "
                        + "; ".join(d.line() for d in self.devices))

    def default_session(self) -> "Session":
        with self._lock:
            if self._default is None:
                idx = self.default_device_index()
                handle = self.shim.lib.kvm_session_create(idx)
                self.shim.check(handle, "creating a SYCL queue")
                self._default = Session(self, handle)
            return self._default

    def queue_session(self, queue_ptr: int) -> "Session":
        """A session on an existing ``sycl::queue*`` (torch's XPU stream queue)."""
        with self._lock:
            sess = self._queues.get(queue_ptr)
            if sess is None:
                handle = self.shim.lib.kvm_session_from_queue(queue_ptr)
                self.shim.check(handle, "wrapping torch's SYCL queue")
                sess = self._queues[queue_ptr] = Session(self, handle)
            return sess


class Session:
    """One SYCL queue (device + context) and the kernel bundles built for it."""

    def __init__(self, runtime: Runtime, handle: int):
        self.runtime, self.shim, self.handle = runtime, runtime.shim, handle
        f = self.shim.text(self.shim.lib.kvm_session_describe, handle).split("\t")
        index = next((d.index for d in runtime.devices if (d.backend, d.type, d.name) == (f[0], f[1], f[2])), -1)
        self.device = _device_info(index, f)
        self.key = int(self.shim.lib.kvm_session_key(handle))

    # -- kernels -----------------------------------------------------------------------------
    def build(self, source: str, options: list[str], names: tuple[str, ...] = PLAIN_KERNEL_NAMES) -> int:
        """Compile ``source`` with ``options`` for this device (cached per session); a bundle handle.

        Processes building the same bundle for the same device take turns (a file lock per bundle
        in the kvmulti cache): the first compiles, the others then load it from SYCL's persistent
        cache instead of compiling it again beside it."""
        key = (self.key, hashlib.sha256(source.encode()).hexdigest(), tuple(options), tuple(names))
        bundles = self.runtime.bundles
        with self.runtime.build_lock:
            if key in bundles:
                return bundles[key]
            bundle_id = hashlib.sha256(repr((self.device.name, *key[1:])).encode()).hexdigest()[:16]
            with native_build.build_lock(cache_root() / "bundle-locks" / bundle_id):
                return self._compile(key, source, options, names)

    def _compile(self, key: tuple, source: str, options: list[str], names: tuple[str, ...]) -> int:
        t0 = time.perf_counter()
        opts = (ctypes.c_char_p * max(1, len(options)))(*[o.encode() for o in options])
        nms = (ctypes.c_char_p * len(names))(*[n.encode() for n in names])
        handle = self.shim.lib.kvm_build(self.handle, source.encode(), opts, len(options), nms, len(names))
        if not handle:
            msg = self.shim.error()
            raise SyclBuildError(f"compiling SYCL kernels for {self.device.name} ({' '.join(options)}) "
                                 f"failed:\n{msg}", log=msg)
        elapsed = time.perf_counter() - t0
        if elapsed > 1.5:
            print(f"kvmulti: compiled SYCL kernels ({' '.join(options)}) for {self.device.name} in "
                  f"{elapsed:.1f} s; kept in the persistent cache {os.environ.get('SYCL_CACHE_DIR', '')}",
                  file=sys.stderr, flush=True)
        self.runtime.bundles[key] = handle
        return handle

    def launch(self, bundle: int, kernel: int, global_size: int, local_size: int, args: list[tuple[int, object]],
               wait: bool) -> None:
        kinds = (ctypes.c_int32 * len(args))()
        values = (ctypes.c_int64 * len(args))()
        for i, (kind, value) in enumerate(args):
            kinds[i] = kind
            if kind == ARG_F32:
                values[i] = struct.unpack("<I", struct.pack("<f", float(value)))[0]
            else:
                values[i] = int(value)
        rc = self.shim.lib.kvm_launch(self.handle, bundle, kernel, global_size, local_size, len(args), kinds, values,
                                      int(wait))
        self.shim.check(rc, f"launching {KERNEL_NAMES[kernel]} on {self.device.name}")

    # -- memory ------------------------------------------------------------------------------
    def malloc_shared(self, nbytes: int) -> int:
        ptr = self.shim.lib.kvm_malloc(self.handle, nbytes, 0)
        return self.shim.check(ptr, f"allocating {nbytes} bytes of USM shared memory")

    def free(self, ptr: int) -> None:
        self.shim.check(self.shim.lib.kvm_free(self.handle, ptr), "freeing USM memory")

    def pointer_type(self, ptr: int) -> int:
        return self.shim.check(self.shim.lib.kvm_pointer_type(self.handle, ptr), "querying a USM pointer")

    def is_usm(self, t: torch.Tensor) -> bool:
        return t.numel() == 0 or self.pointer_type(t.data_ptr()) != USM_UNKNOWN


_RUNTIME: Runtime | None = None
_RUNTIME_REASONS: list[str] | None = None
_RUNTIME_LOCK = threading.Lock()
_EXITING = False


@atexit.register
def _mark_exiting() -> None:
    global _EXITING
    _EXITING = True


def exiting() -> bool:
    """True once the interpreter is shutting down (USM finalizers must not call the runtime then)."""
    return _EXITING


def runtime_reasons() -> list[str]:
    """Why the SYCL runtime cannot be used here (empty: it loaded, listed its devices). Cached."""
    global _RUNTIME, _RUNTIME_REASONS
    with _RUNTIME_LOCK:
        if _RUNTIME_REASONS is None:
            root, reasons = find_runtime()
            if root is not None:
                try:
                    _RUNTIME = Runtime(root)
                except (SyclError, OSError) as e:
                    reasons = [f"SYCL runtime at {root} unusable: {e}"]
                else:
                    if not any(d.can_compile for d in _RUNTIME.devices):
                        reasons = ["no SYCL device can compile SYCL source here (devices: "
                                   + ("; ".join(d.line() for d in _RUNTIME.devices) or "none")
                                   + "); a CPU-only host needs intel-opencl-rt"]
            _RUNTIME_REASONS = reasons
        return list(_RUNTIME_REASONS)


def get_runtime() -> Runtime:
    reasons = runtime_reasons()
    if reasons:
        raise SyclError("; ".join(reasons))
    assert _RUNTIME is not None
    return _RUNTIME


def default_session() -> Session:
    return get_runtime().default_session()


def xpu_session(device: torch.device) -> Session:
    """The session on torch's current XPU queue for ``device``."""
    stream = torch.xpu.current_stream(device)
    queue = getattr(stream, "sycl_queue", None)
    if not queue:
        raise SyclError("this torch build does not expose torch.xpu.Stream.sycl_queue; the SYCL backend needs it "
                        "to run on torch's XPU queue")
    return get_runtime().queue_session(int(queue))


def list_devices() -> list[DeviceInfo]:
    """The SYCL devices the runtime sees (empty when it is unavailable)."""
    return [] if runtime_reasons() else list(get_runtime().devices)


