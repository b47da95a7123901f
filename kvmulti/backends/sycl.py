"""SYCL backend: the SYCL C++ kernels in ``sycl/kernels.cpp`` (shipped as ``kvmulti.sycl_src``),
compiled at RUN TIME for the device that runs them.

How it runs (no SYCL compiler needed, only the runtime from PyPI and g++):

* ``sycl/shim.cpp`` is a small C ABI over the SYCL runtime, built with plain g++ against the
  ``intel-sycl-rt`` headers/library on first use into ``~/.cache/kvmulti/sycl/shim-<hash>/``
  (``KVMULTI_CACHE_DIR`` moves the cache; ``KVMULTI_SYCL_CXX`` picks another compiler) and called
  through ctypes.
* The shim compiles ``sycl/kernels.cpp`` with the oneAPI kernel_compiler extension
  (``create_kernel_bundle_from_source(ctx, source_language::sycl, src)`` + ``build``), one bundle per
  (dtype, head sizes, tile sizes), for the device of the queue: an Intel GPU (Level Zero) on an XPU
  host, Intel's OpenCL CPU device (``intel-opencl-rt``) on a CPU-only host. Compiled kernels are kept
  in SYCL's persistent cache (``SYCL_CACHE_PERSISTENT=1``, ``SYCL_CACHE_DIR`` defaulting to
  ``~/.cache/kvmulti/sycl/kernels``): a cold compile takes seconds, a cache hit a fraction of one.
  A kernel compile error raises :class:`SyclBuildError` carrying the compiler's log.
* Memory: on an XPU host torch XPU tensors are USM device pointers; the kernels run on torch's
  current XPU queue with those pointers (nothing is copied). Torch CPU tensors: a cache allocated
  with ``layout.allocate("cpu", allocator=usm_allocator)`` is a zero-copy torch tensor in USM shared
  memory that any SYCL device uses in place. Plain torch CPU tensors are used in place by a device
  that reports ``aspect::usm_system_allocations`` (Intel's OpenCL CPU device does), and otherwise
  staged through a USM copy by the backend (copied back when written; a plain-CPU cache is then
  copied every call, with a one-time warning). ``KVMULTI_SYCL_STAGE=1`` forces staging, ``0`` never.

Environment: the backend points the OpenCL ICD loader at ``<runtime>/lib/libintelocl.so`` itself
(``OCL_ICD_FILENAMES``, only when the user has not set it) before the runtime loads, and never sets
``ONEAPI_DEVICE_SELECTOR``. ``KVMULTI_SYCL_ROOT`` names a runtime prefix (``include/sycl``,
``lib/libsycl.so``) when it is not the Python environment's own; ``KVMULTI_SYCL_DEVICE`` picks the
device for CPU tensors (an index into ``kvmulti info``'s list, or ``opencl:cpu`` / ``level_zero:gpu``
/ ``cpu`` / ``gpu``); ``KVMULTI_SYCL_PARTITION_SIZE`` controls split-KV (-1 auto, 0 never, N > 0
always with partitions of N keys).

Dispatch: SYCL is first in the ``xpu`` priority list. On a CPU-only host it is usable when the
runtime and a SYCL device that can compile SYCL source are present, but runs only when named
(``KVMULTI_ATTENTION_BACKEND=SYCL`` / ``backend="SYCL"``): the ``cpu`` priority list is just CPU.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import native_build
from ..layout import KVCacheLayout
from ..metadata import CommonAttentionMetadata
from .base import Backend

#: Bumped when the C ABI of shim.cpp changes (part of the shim's cache key).
SHIM_ABI = 3
SHIM_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++17", "-DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING", "-w")
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KERNEL_NAMES = ("kvm_paged_attention", "kvm_split_reduce", "kvm_write_kv")
K_ATTN, K_REDUCE, K_WRITE = range(3)
K_SPLIT = K_ATTN       # one attention kernel: split-KV when given partial buffers

#: Tile shape of the attention kernels (build options of kernels.cpp).
ROWS = 16          # (query token, query head) rows per work-group
WG = 128           # work-items per attention work-group (the largest of WG_CHOICES that fits)
WG_CHOICES = (128, 64, 32, 16)   # the merge scratch grows with the sub-groups per work-group
SG = 16            # sub-group size the attention kernels require (KVM_SG)
RB = 4             # tile rows held in registers per pass over the keys (KVM_RB)
REDUCE_WG = 64
WRITE_WG = 256
#: Split-KV heuristic (partition_size=-1): split when the longest visible key span of a tile exceeds
#: SPLIT_MIN_SPAN and there are fewer than SPLIT_WG_PER_CU work-groups per compute unit.
DEFAULT_PARTITION_SIZE = 512
SPLIT_MIN_SPAN = 1024
SPLIT_WG_PER_CU = 4

ARG_PTR, ARG_I32, ARG_I64, ARG_F32, ARG_LOCAL_F32, ARG_LOCAL_I32, ARG_LOCAL_I64 = range(7)
USM_UNKNOWN, USM_HOST, USM_DEVICE, USM_SHARED = range(4)


class SyclError(RuntimeError):
    """The SYCL runtime, the shim or a launch failed; the message says why."""


class SyclBuildError(SyclError):
    """Compiling SYCL kernel source failed; ``log`` holds the compiler's output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


# ------------------------------------------------------------------------------------ paths
def source_dir() -> Path:
    """Directory with shim.cpp / kernels.cpp: ``KVMULTI_SYCL_SRC``, the installed ``kvmulti.sycl_src``
    package, else ``<repo>/sycl``."""
    return native_build.source_dir("kvmulti.sycl_src", "sycl", "KVMULTI_SYCL_SRC", "kernels.cpp")


def cache_root() -> Path:
    return native_build.cache_root() / "sycl"


def kernel_source() -> str:
    """The text of sycl/kernels.cpp (read once per process)."""
    return _read_text(str(source_dir() / "kernels.cpp"))


@functools.lru_cache(maxsize=8)
def _read_text(path: str) -> str:
    return Path(path).read_text()


def runtime_candidates() -> list[Path]:
    out = []
    for c in (os.environ.get("KVMULTI_SYCL_ROOT"), sys.prefix, os.environ.get("CMPLR_ROOT")):
        if c and Path(c) not in out:
            out.append(Path(c))
    return out


def find_runtime() -> tuple[Path | None, list[str]]:
    """The prefix holding ``include/sycl/sycl.hpp`` and ``lib/libsycl.so`` (+ reasons if none)."""
    looked = []
    for root in runtime_candidates():
        if (root / "include" / "sycl" / "sycl.hpp").is_file() and (root / "lib" / "libsycl.so").exists():
            return root, []
        looked.append(str(root))
    return None, [f"SYCL runtime not found (looked for include/sycl/sycl.hpp and lib/libsycl.so in "
                  f"{', '.join(looked)}): pip install 'kvmulti[sycl]' (intel-sycl-rt, intel-opencl-rt) "
                  "or set KVMULTI_SYCL_ROOT"]


def runtime_version() -> str:
    try:
        from importlib.metadata import version
        return "intel-sycl-rt " + version("intel-sycl-rt")
    except Exception:  # noqa: BLE001 - a oneAPI install has no wheel metadata
        return "unknown version"


def configure_environment(root: Path) -> None:
    """Set what the runtime reads at load time, unless the user already set it.

    OCL_ICD_FILENAMES: the intel-opencl-rt wheel's .icd file holds a placeholder path, so the OpenCL
    loader is pointed at the CPU runtime directly. SYCL_CACHE_PERSISTENT / SYCL_CACHE_DIR: keep
    compiled kernels across processes. ONEAPI_DEVICE_SELECTOR is never touched.
    """
    ocl = root / "lib" / "libintelocl.so"
    if ocl.exists() and not os.environ.get("OCL_ICD_FILENAMES"):
        os.environ["OCL_ICD_FILENAMES"] = str(ocl)
    os.environ.setdefault("SYCL_CACHE_PERSISTENT", "1")
    if not os.environ.get("SYCL_CACHE_DIR"):
        os.environ["SYCL_CACHE_DIR"] = str(cache_root() / "kernels")


# ------------------------------------------------------------------------------------ shim build
def compiler() -> str | None:
    return shutil.which(os.environ.get("KVMULTI_SYCL_CXX") or "g++")


def shim_command(root: Path, out: str) -> list[str]:
    lib = root / "lib"
    return [compiler() or "g++", *SHIM_FLAGS, f"-I{root / 'include'}", str(source_dir() / "shim.cpp"),
            f"-L{lib}", "-lsycl", f"-Wl,-rpath,{lib}", "-o", out]


def shim_path(root: Path) -> Path:
    h = hashlib.sha256()
    h.update((source_dir() / "shim.cpp").read_bytes())
    for part in (str(SHIM_ABI), str(root), os.path.realpath(root / "lib" / "libsycl.so"), compiler() or "",
                 *SHIM_FLAGS):
        h.update(part.encode() + b"\0")
    return cache_root() / f"shim-{h.hexdigest()[:16]}" / "libkvmulti_sycl_shim.so"


def build_shim(root: Path) -> Path:
    """Build (once per hash of source, runtime and flags) the host shim; return its path."""
    out = shim_path(root)
    if out.exists():
        return out
    if compiler() is None:
        raise SyclError(f"C++ compiler {os.environ.get('KVMULTI_SYCL_CXX') or 'g++'!r} not found: the SYCL host shim "
                        "is built with g++ on first use (apt-get install g++, or set KVMULTI_SYCL_CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = shim_command(root, tmp)
        print(f"kvmulti: building the SYCL host shim with {cmd[0]} (one time, a few seconds) into {out.parent} ...",
              file=sys.stderr, flush=True)
        try:
            res = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            os.unlink(tmp)
            raise SyclError(f"cannot run {cmd[0]}: {e}") from e
        if res.returncode != 0:
            os.unlink(tmp)
            raise SyclError(f"building the SYCL host shim failed ({' '.join(cmd)}):\n{res.stdout}{res.stderr}")
        os.replace(tmp, out)
    return out


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

    def line(self) -> str:
        ok = "kernel compiler ok" if self.can_compile else "cannot compile SYCL source"
        mem = ", uses host memory directly" if self.usm_system else ""
        return f"[{self.index}] {self.backend}:{self.type} {self.name} (driver {self.driver}, {ok}{mem})"


def _device_info(index: int, f: list[str]) -> DeviceInfo:
    return DeviceInfo(index, f[0], f[1], f[2], f[3], int(f[4]), int(f[5]), int(f[6]), f[7] == "1", f[8] == "1",
                      f[9] == "1", f[10] == "1")


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
        want = os.environ.get("KVMULTI_SYCL_DEVICE", "").strip().lower()
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
    def build(self, source: str, options: list[str], names: tuple[str, ...] = KERNEL_NAMES) -> int:
        """Compile ``source`` with ``options`` for this device (cached per session); a bundle handle."""
        key = (self.key, hashlib.sha256(source.encode()).hexdigest(), tuple(options), tuple(names))
        bundles = self.runtime.bundles
        with self.runtime.build_lock:
            if key in bundles:
                return bundles[key]
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
            bundles[key] = handle
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


# ------------------------------------------------------------------------------------ USM tensors
def _wrap(ptr: int, nbytes: int, dtype: torch.dtype, owner_free=None) -> torch.Tensor:
    """A 1-D torch CPU tensor viewing ``nbytes`` at ``ptr``; ``owner_free(ptr)`` runs when the last
    tensor viewing the memory is gone (None: the caller frees)."""
    base = ctypes.c_uint8 * nbytes
    if owner_free is None:
        buf = base.from_address(ptr)
    else:
        def _release(self, _ptr=ptr, _free=owner_free):
            if not _EXITING:
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


class _Staging:
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


# ------------------------------------------------------------------------------------ planning
def lm_floats(head_size_v: int, wg: int) -> int:
    """Floats of the merge scratch of the attention kernels (LM_FLOATS in kernels.cpp)."""
    return (wg // SG) * min(RB, ROWS) * (head_size_v + 2)


def choose_wg(head_size_v: int, local_mem: int) -> int:
    """The largest attention work-group size whose merge scratch fits the device's local memory."""
    for wg in WG_CHOICES:
        if 4 * lm_floats(head_size_v, wg) <= local_mem - 1024:
            return wg
    raise SyclError(f"head size {head_size_v} needs more local memory than the device has ({local_mem} B)")


def vector_bytes(dtype: torch.dtype, head_size: int, head_size_v: int) -> int:
    """Bytes of one per-lane K/V vector load (VW * element size in kernels.cpp): the cache base
    pointer must be aligned to it."""
    size = dtype.itemsize
    v = 16 // size
    while v > 1 and (head_size % v or head_size_v % v):
        v //= 2
    return v * size


def kernel_options(dtype: torch.dtype, head_size: int, head_size_v: int, wg: int = WG) -> list[str]:
    return [f"-DKVM_DTYPE={DTYPE_CODES[dtype]}", f"-DKVM_HEAD_SIZE={head_size}", f"-DKVM_HEAD_SIZE_V={head_size_v}",
            f"-DKVM_ROWS={ROWS}", f"-DKVM_WG={wg}", f"-DKVM_SG={SG}", f"-DKVM_RB={RB}"]


@dataclass
class Plan:
    """Host-side launch plan of one attention call (all from CPU metadata: no device sync)."""

    tiles: torch.Tensor     # int32 [num_tiles, 2]: (request, first flattened row)
    num_tiles: int
    max_span: int           # longest visible key range of any tile
    num_parts: int          # 1: no split
    part_size: int


def plan_attention(metadata: CommonAttentionMetadata, group: int, num_kv_heads: int, sliding_window: int | None,
                   partition_size: int, compute_units: int, block_size: int = 1 << 30) -> Plan:
    num_reqs = min(metadata.query_start_loc_cpu.shape[0] - 1, metadata.seq_lens_cpu.shape[0],
                   metadata.block_table.shape[0])
    qsl = metadata.query_start_loc_cpu.long()[: num_reqs + 1]
    seq = metadata.seq_lens_cpu.long()[:num_reqs]
    qlen = (qsl[1:] - qsl[:-1]).clamp(min=0)          # invalid metadata: no rows, never a crash
    rows = qlen * group
    per_req = (rows + ROWS - 1) // ROWS
    num_tiles = int(per_req.sum())
    req = torch.repeat_interleave(torch.arange(len(seq)), per_req)
    starts = torch.cumsum(per_req, 0) - per_req
    f0 = (torch.arange(num_tiles) - starts[req]) * ROWS
    tiles = torch.stack([req, f0], 1).to(torch.int32).contiguous()
    if num_tiles == 0:
        return Plan(tiles, 0, 0, 1, 0)
    ctx = (seq - qlen)[req]
    nrows = torch.clamp(rows[req] - f0, max=ROWS)
    p_first = ctx + f0 // group
    p_last = ctx + (f0 + nrows - 1) // group
    lo = (p_first - sliding_window + 1).clamp(min=0) if sliding_window is not None else torch.zeros_like(p_first)
    k_max = metadata.block_table.shape[1] * block_size    # the kernels stop at the table's width
    max_span = int(((p_last + 1).clamp(max=k_max) - lo.clamp(max=k_max)).clamp(min=0).max())
    if partition_size > 0:
        part = partition_size
    elif partition_size < 0 and max_span > SPLIT_MIN_SPAN and num_tiles * num_kv_heads < SPLIT_WG_PER_CU * compute_units:
        part = DEFAULT_PARTITION_SIZE
    else:
        return Plan(tiles, num_tiles, max_span, 1, 0)
    return Plan(tiles, num_tiles, max_span, max(1, -(-max_span // part)), part)


def check_cache_alignment(kv_cache: torch.Tensor, layout: KVCacheLayout) -> None:
    """The attention kernels read K/V rows with vector loads of :func:`vector_bytes`; a cache view
    whose base is not aligned to that is refused (SyclError) rather than read misaligned."""
    need = vector_bytes(layout.dtype, layout.head_size, layout.value_size)
    if kv_cache.data_ptr() % need:
        raise SyclError(f"the KV cache's base address {kv_cache.data_ptr():#x} is not aligned to {need} bytes "
                        "(the SYCL kernels load K/V rows as vectors)")


# ------------------------------------------------------------------------------------ the backend
class SyclBackend(Backend):
    """Paged attention through run-time compiled SYCL kernels (see the module docstring)."""

    name = "SYCL"
    platforms = ("xpu",)

    def __init__(self, partition_size: int | None = None, stage_cpu_tensors: bool | None = None):
        env = os.environ.get("KVMULTI_SYCL_PARTITION_SIZE", "").strip()
        self.partition_size = partition_size if partition_size is not None else (int(env) if env else -1)
        #: None: stage plain CPU tensors through USM only on devices that cannot use host memory
        #: (no usm_system_allocations); True/False forces it (KVMULTI_SYCL_STAGE=1/0).
        env = os.environ.get("KVMULTI_SYCL_STAGE", "").strip()
        self.stage_cpu_tensors = stage_cpu_tensors if stage_cpu_tensors is not None else (
            None if not env else env not in ("0", "false", "no"))
        self._warned_staging = False
        self._bundles: dict[tuple, int] = {}

    # -- availability ------------------------------------------------------------------------
    def unavailable_reasons(self) -> list[str]:
        return runtime_reasons()

    def platform_reasons(self, platform: str) -> list[str]:
        if platform == "xpu":
            if not hasattr(torch, "xpu") or not hasattr(torch.xpu.Stream, "sycl_queue"):
                return ["this torch build exposes no torch.xpu.Stream.sycl_queue (the SYCL backend runs on "
                        "torch's XPU queue)"]
            return []
        if platform == "cpu":
            # CPU tensors run on the default SYCL device (the OpenCL CPU device on a CPU-only host);
            # only for verification: the cpu priority list never picks SYCL.
            if runtime_reasons():
                return ["no usable SYCL runtime/device for CPU tensors"]
            try:
                default_session()
            except SyclError as e:
                return [f"no SYCL device for CPU tensors: {e}"]
            return []
        return [f"SYCL runs on xpu (and, for verification, cpu through a SYCL CPU device), not {platform}"]

    def describe(self) -> str:
        root, reasons = find_runtime()
        if root is None:
            return "xpu; " + reasons[0]
        reasons = runtime_reasons()
        if reasons:
            return f"xpu; {'; '.join(reasons)}"
        rt = get_runtime()
        devices = "; ".join(d.line() for d in rt.devices) or "no SYCL devices"
        return f"xpu (cpu when named); {runtime_version()} at {root}; SYCL devices: {devices}"

    def cache_allocator(self, device: torch.device | str):
        """The allocator a KV cache for this backend on ``device`` should use (``layout.allocate(device,
        allocator=...)``): USM shared memory for CPU tensors, torch's own allocator (None) on XPU."""
        return usm_allocator if torch.device(device).type == "cpu" else None

    # -- sessions ----------------------------------------------------------------------------
    def session_for(self, device: torch.device) -> Session:
        return xpu_session(device) if device.type == "xpu" else default_session()

    def bundle(self, session: Session, layout: KVCacheLayout) -> int:
        """The kernels for ``layout``'s dtype and head sizes on ``session``'s device (built on first use)."""
        key = (session.key, layout.dtype, layout.head_size, layout.value_size)
        handle = self._bundles.get(key)
        if handle is None:
            wg = choose_wg(layout.value_size, session.device.local_mem)
            opts = kernel_options(layout.dtype, layout.head_size, layout.value_size, wg)
            handle = self._bundles[key] = session.build(kernel_source(), opts)
        return handle

    def _staging(self, session: Session, kv_cache: torch.Tensor) -> _Staging:
        stage = self.stage_cpu_tensors
        staging = _Staging(session, stage=not session.device.usm_system if stage is None else stage)
        if staging.stage and not self._warned_staging and not session.is_usm(kv_cache):
            self._warned_staging = True
            warnings.warn("SYCL backend: the KV cache is a plain CPU tensor, so every call copies it through USM "
                          "memory; allocate it with layout.allocate('cpu', "
                          "allocator=kvmulti.backends.sycl.usm_allocator) to use it in place", stacklevel=3)
        return staging

    # -- ops ---------------------------------------------------------------------------------
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                 slot_mapping: torch.Tensor) -> None:
        if layout.is_latent:
            raise SyclError("the SYCL backend does not support latent caches (head_size_v=0)")
        num_tokens = min(key.shape[0], value.shape[0], slot_mapping.shape[0])   # rows the kernel may read
        total = num_tokens * layout.num_kv_heads * layout.entry_size
        if total == 0:
            return
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        slot_mapping = slot_mapping.to(torch.int64).contiguous()
        session = self.session_for(kv_cache.device)
        bundle = self.bundle(session, layout)
        s = layout.strides(kv_cache)
        on_xpu = kv_cache.device.type == "xpu"
        staging = None if on_xpu else self._staging(session, kv_cache)
        ok = False
        try:
            ptr = (lambda t, written=False: t.data_ptr() if t.numel() else 0) if on_xpu else staging.ptr
            args = [(ARG_PTR, ptr(key)), (ARG_I64, key.stride(0)), (ARG_I64, key.stride(1)),
                    (ARG_PTR, ptr(value)), (ARG_I64, value.stride(0)), (ARG_I64, value.stride(1)),
                    (ARG_PTR, ptr(kv_cache, True)), (ARG_I64, s.block), (ARG_I64, s.token), (ARG_I64, s.head),
                    (ARG_I64, layout.num_blocks), (ARG_PTR, ptr(slot_mapping)), (ARG_I64, num_tokens),
                    (ARG_I32, layout.num_kv_heads), (ARG_I32, layout.block_size)]
            glob = -(-total // WRITE_WG) * WRITE_WG
            session.launch(bundle, K_WRITE, glob, WRITE_WG, args, wait=not on_xpu)
            ok = True
        finally:
            if staging is not None:
                staging.finish(ok)

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                        metadata: CommonAttentionMetadata, scale: float, sliding_window: int | None,
                        softcap: float | None, out: torch.Tensor) -> None:
        if layout.is_latent:
            raise SyclError("the SYCL backend does not support latent caches (head_size_v=0)")
        if metadata.num_actual_tokens == 0:
            return
        device = kv_cache.device
        on_xpu = device.type == "xpu"
        session = self.session_for(device)
        bundle = self.bundle(session, layout)
        hkv = layout.num_kv_heads
        group = query.shape[1] // hkv
        plan = plan_attention(metadata, group, hkv, sliding_window, self.partition_size, session.device.compute_units,
                              layout.block_size)
        if plan.num_tiles == 0:
            return
        query = query if query.stride(-1) == 1 else query.contiguous()
        target = out if out.stride(-1) == 1 else torch.zeros_like(out, memory_format=torch.contiguous_format)
        num_tokens = min(query.shape[0], target.shape[0])    # rows the kernels may touch
        check_cache_alignment(kv_cache, layout)
        if metadata.block_table.shape[-1] * layout.block_size >= 1 << 30:
            raise SyclError("block table too wide: the SYCL kernels address key positions with 32-bit ints")
        block_table = metadata.block_table
        if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
            block_table = block_table.to(torch.int32).contiguous()
        if on_xpu:
            seq_lens, qsl = metadata.seq_lens.to(torch.int32), metadata.query_start_loc.to(torch.int32)
            tiles = plan.tiles.to(device, non_blocking=True)
        else:
            seq_lens, qsl, tiles = metadata.seq_lens_cpu, metadata.query_start_loc_cpu, plan.tiles
            block_table = block_table.cpu()
        s = layout.strides(kv_cache)
        staging = None if on_xpu else self._staging(session, kv_cache)
        ok = False
        try:
            ptr = (lambda t, written=False: t.data_ptr() if t.numel() else 0) if on_xpu else staging.ptr
            wg = choose_wg(layout.value_size, session.device.local_mem)
            local = [(ARG_LOCAL_F32, lm_floats(layout.value_size, wg))]
            common = [(ARG_PTR, ptr(query)), (ARG_I64, query.stride(0)), (ARG_I64, query.stride(1)),
                      (ARG_I64, num_tokens), (ARG_PTR, ptr(kv_cache)), (ARG_I64, s.block), (ARG_I64, s.token),
                      (ARG_I64, s.head), (ARG_I64, layout.num_blocks),
                      (ARG_PTR, ptr(block_table)), (ARG_I64, block_table.stride(0)),
                      (ARG_I64, block_table.shape[0]), (ARG_I64, block_table.shape[1]),
                      (ARG_PTR, ptr(seq_lens)), (ARG_PTR, ptr(qsl)), (ARG_PTR, ptr(tiles))]
            tail = [(ARG_I32, hkv), (ARG_I32, group), (ARG_I32, layout.block_size), (ARG_F32, scale),
                    (ARG_I32, sliding_window or 0), (ARG_F32, softcap or 0.0)] + local
            out_ptr = ptr(target, True)
            out_args = [(ARG_PTR, out_ptr), (ARG_I64, target.stride(0)), (ARG_I64, target.stride(1))]
            groups = plan.num_tiles * hkv
            if plan.num_parts == 1 and self.partition_size <= 0:
                unsplit = [(ARG_PTR, 0), (ARG_PTR, 0), (ARG_I32, 1), (ARG_I32, 0)]
                session.launch(bundle, K_ATTN, groups * wg, wg, common + out_args + unsplit + tail, wait=not on_xpu)
            else:
                rows = num_tokens * query.shape[1]
                alloc = (lambda n: torch.empty(n, dtype=torch.float32, device=device)) if on_xpu else \
                    (lambda n: usm_empty(n, torch.float32, session))
                part_acc = alloc(rows * plan.num_parts * layout.value_size)
                part_ml = alloc(rows * plan.num_parts * 2)
                split = common + [(ARG_PTR, 0), (ARG_I64, 0), (ARG_I64, 0), (ARG_PTR, part_acc.data_ptr()),
                                  (ARG_PTR, part_ml.data_ptr()), (ARG_I32, plan.num_parts),
                                  (ARG_I32, plan.part_size)] + tail
                session.launch(bundle, K_SPLIT, groups * plan.num_parts * wg, wg, split, wait=False)
                reduce = [(ARG_PTR, part_acc.data_ptr()), (ARG_PTR, part_ml.data_ptr())] + out_args + \
                    [(ARG_I32, query.shape[1]), (ARG_I32, plan.num_parts)]
                # only the batch's own rows: padded rows have no partials and stay as they are
                reduce_rows = max(0, min(metadata.num_actual_tokens, num_tokens)) * query.shape[1]
                if reduce_rows:
                    session.launch(bundle, K_REDUCE, reduce_rows * REDUCE_WG, REDUCE_WG, reduce, wait=not on_xpu)
                elif not on_xpu:
                    session.shim.check(session.shim.lib.kvm_wait(session.handle), "waiting for the SYCL queue")
                if not on_xpu:
                    del part_acc, part_ml
            ok = True
        finally:
            if staging is not None:
                staging.finish(ok)
        if target is not out:
            out.copy_(target)


def list_devices() -> list[DeviceInfo]:
    """The SYCL devices the runtime sees (empty when it is unavailable)."""
    return [] if runtime_reasons() else list(get_runtime().devices)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvmulti.backends.sycl [info | build [--dtypes fp32,fp16,bf16] [--head-sizes 64,128]]``:
    show the runtime and devices, or build the shim and pre-compile kernels into the persistent cache."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m kvmulti.backends.sycl", description=main.__doc__)
    ap.add_argument("command", choices=("info", "build"), nargs="?", default="info")
    ap.add_argument("--dtypes", default="fp32,fp16,bf16")
    ap.add_argument("--head-sizes", default="64,128")
    args = ap.parse_args(argv)
    backend = SyclBackend()
    print(f"SYCL backend: {backend.describe()}")
    reasons = backend.unavailable_reasons()
    if reasons:
        print("unavailable: " + "; ".join(reasons))
        return 1
    session = default_session()
    print(f"default device: {session.device.line()}")
    if args.command == "build":
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        for dt in args.dtypes.split(","):
            for hs in args.head_sizes.split(","):
                t0 = time.perf_counter()
                backend.bundle(session, KVCacheLayout(1, 16, 1, int(hs), dtype=names[dt.strip()]))
                print(f"kernels {dt} head_size={hs}: {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
