"""HIP backend: the HIP C++ kernels in ``hip/`` (shipped as ``kvmulti.hip_src``).

Two ways to run the same kernel sources, through the same C ABI (``hip/launcher.hip``):

* **ROCm host** (platform ``rocm``): ``libkvmulti_hip.so`` built with the host's ``hipcc`` for the
  ``PYTORCH_ROCM_ARCH`` targets (default: the archs of the host's own GPUs), called through ctypes
  with torch tensors' ``data_ptr()``s and torch's current HIP stream. Built on first use into
  ``~/.cache/kvmulti/hip_rocm/<hash>/`` (``KVMULTI_CACHE_DIR`` moves the cache), or ahead of time with
  ``python -m kvmulti.backends.hip build-rocm`` (what an install with ``KVMULTI_BUILD_HIP=1`` runs).
  A prebuilt library can be named with ``KVMULTI_HIP_LIBRARY``.
* **CPU host** (platform ``cpu``): kvmulti's own HIP-on-CPU harness (``hip/cpu_harness``) compiles
  the unmodified kernels with g++ (``CXX``/``KVMULTI_HIP_CPU_CXX`` override) into
  ``~/.cache/kvmulti/hip_cpu/<hash>/`` and runs every GPU thread as a fiber. It is an emulator for
  verification: the dispatcher never picks it (the ``cpu`` priority list is just ``CPU``); it runs
  only when named (``KVMULTI_ATTENTION_BACKEND=HIP`` or ``backend="HIP"``) and warns once.

Split-KV heuristic (``kvmulti_hip_plan`` in launcher.hip): with ``partition_size=-1`` (default) the
key range of each (token, head) is split into partitions of 512 keys, combined by a reduce kernel,
when the longest visible span exceeds 1024 keys and the un-split grid has fewer than 4 working blocks
per compute unit (a block computes up to 8 (token, head) rows sharing one KV head); 0
never splits; a positive value always splits with that partition size (tests, tuning). Set it per
instance (``HipBackend(partition_size=...)``) or with ``KVMULTI_HIP_PARTITION_SIZE``.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from .. import native_build
from ..layout import KVCacheLayout
from ..metadata import CommonAttentionMetadata
from .base import AttentionConfig, Backend

#: Head sizes with compiled kernel instantiations (hip/launcher.hip dispatch_head_size).
HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 128, 256)
ABI_VERSION = 3
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

#: Sources that make up the libraries (hashed into the cache key).
KERNEL_SOURCES = ("launcher.hip", "kvmulti_attention.hip", "kvmulti_common.h")
HARNESS_SOURCES = ("cpu_harness/kvcpu.h", "cpu_harness/kvcpu.ld", "cpu_harness/include/hip/hip_runtime.h",
                   "cpu_harness/include/hip/hip_fp16.h", "cpu_harness/include/hip/hip_bfloat16.h",
                   "cpu_harness/include/hip/hip_runtime_api.h")
CPU_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-fdata-sections",
             "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas")


class HipBuildError(RuntimeError):
    """The HIP library could not be built; the message holds the command and compiler output."""


# ------------------------------------------------------------------------------------ sources
def source_dir() -> Path:
    """Directory holding the HIP sources: ``KVMULTI_HIP_SRC``, the installed ``kvmulti.hip_src``, else ``<repo>/hip``."""
    return native_build.source_dir("kvmulti.hip_src", "hip", "KVMULTI_HIP_SRC", "launcher.hip")


def cache_root() -> Path:
    return native_build.cache_root()


def _hash(paths: list[Path], extra: list[str]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    for e in extra:
        h.update(e.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _compiler_version(exe: str) -> str:
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _locked_build(out: Path, cmd: list[str], what: str, env: dict | None = None) -> None:
    """Run ``cmd`` (which writes ``{tmp}``) under a lock, then move the result to ``out`` atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [tmp if c == "{tmp}" else c for c in cmd]
        print(f"kvmulti: building {what} (one time) into {out.parent} ...", file=sys.stderr, flush=True)
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        except OSError as e:
            os.unlink(tmp)
            raise HipBuildError(f"cannot run {cmd[0]}: {e}") from e
        if res.returncode != 0:
            os.unlink(tmp)
            raise HipBuildError(f"building {what} failed ({' '.join(cmd)}):\n{res.stdout}{res.stderr}")
        os.replace(tmp, out)
        print(f"kvmulti: built {out}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ CPU harness
def cpu_compiler() -> str | None:
    name = os.environ.get("KVMULTI_HIP_CPU_CXX") or os.environ.get("CXX") or "g++"
    return shutil.which(name)


def cpu_harness_reasons() -> list[str]:
    """Why the CPU harness library cannot be built here (empty: it can)."""
    reasons = []
    src = source_dir()
    missing = [s for s in KERNEL_SOURCES + HARNESS_SOURCES if not (src / s).is_file()]
    if missing:
        reasons.append(f"HIP sources missing under {src}: {', '.join(missing)}")
    if cpu_compiler() is None:
        name = os.environ.get("KVMULTI_HIP_CPU_CXX") or os.environ.get("CXX") or "g++"
        reasons.append(f"C++ compiler {name!r} not found: the HIP CPU harness needs g++ "
                       "(apt-get install g++, or set CXX / KVMULTI_HIP_CPU_CXX)")
    return reasons


def harness_library_path(main: Path, deps: list[Path], libname: str, extra_flags: tuple[str, ...] = ()) -> Path:
    src = source_dir()
    cxx = cpu_compiler() or "g++"
    key = _hash([main, *deps, *[src / s for s in HARNESS_SOURCES]],
                [cxx, _compiler_version(cxx), *CPU_FLAGS, *extra_flags])
    return cache_root() / "hip_cpu" / key / libname


def build_harness_library(main: Path, deps: list[Path], libname: str, what: str,
                          extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the HIP source ``main`` (+ headers ``deps``, hashed) with g++ against kvmulti's
    HIP-on-CPU harness into a cached shared library (once per hash of sources, flags, compiler)."""
    reasons = cpu_harness_reasons()
    if reasons:
        raise HipBuildError("cannot build the HIP CPU harness: " + "; ".join(reasons))
    src = source_dir()
    out = harness_library_path(main, deps, libname, extra_flags)
    if not out.exists():
        cmd = [cpu_compiler(), *CPU_FLAGS, *extra_flags, "-x", "c++", "-I", str(src / "cpu_harness" / "include"),
               str(main), "-o", "{tmp}", f"-Wl,-T,{src / 'cpu_harness' / 'kvcpu.ld'}"]
        _locked_build(out, cmd, what)
    return out


def cpu_library_path() -> Path:
    src = source_dir()
    return harness_library_path(src / KERNEL_SOURCES[0], [src / s for s in KERNEL_SOURCES[1:]],
                                "libkvmulti_hip_cpu.so")


def build_cpu_library() -> Path:
    """Build (once; cached) the kvmulti HIP kernels against the CPU harness."""
    src = source_dir()
    return build_harness_library(src / KERNEL_SOURCES[0], [src / s for s in KERNEL_SOURCES[1:]],
                                 "libkvmulti_hip_cpu.so", "the HIP kernels for the CPU harness (g++)")


# ------------------------------------------------------------------------------------ ROCm
def hipcc_path() -> str | None:
    rocm = os.environ.get("ROCM_PATH") or os.environ.get("ROCM_HOME")
    if rocm and (Path(rocm) / "bin" / "hipcc").exists():
        return str(Path(rocm) / "bin" / "hipcc")
    return shutil.which("hipcc")


def device_arch(index: int | None = None) -> str:
    """gfx name of a ROCm device ('gfx90a:sramecc+:xnack-' -> 'gfx90a')."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return str(getattr(props, "gcnArchName", "")).split(":")[0]


def rocm_target_archs() -> list[str]:
    """``PYTORCH_ROCM_ARCH`` (';' or ',' or space separated), else the archs of this host's GPUs."""
    env = os.environ.get("PYTORCH_ROCM_ARCH", "").replace(",", ";").replace(" ", ";")
    archs = [a.strip() for a in env.split(";") if a.strip()]
    if not archs and torch.version.hip and torch.cuda.is_available():
        archs = sorted({device_arch(i) for i in range(torch.cuda.device_count())} - {""})
    if not archs and torch.version.hip:
        archs = _build_rocm_module().host_archs()
    return archs


def rocm_library_path(archs: list[str]) -> Path:
    src = source_dir()
    hipcc = hipcc_path() or "hipcc"
    key = _hash([src / s for s in (*KERNEL_SOURCES, "build_rocm.py")], [hipcc, _compiler_version(hipcc), *archs])
    return cache_root() / "hip_rocm" / key / "libkvmulti_hip.so"


def prebuilt_rocm_library() -> Path | None:
    """A library named by KVMULTI_HIP_LIBRARY, or one built at install time next to the sources."""
    env = os.environ.get("KVMULTI_HIP_LIBRARY")
    if env:
        return Path(env)
    p = source_dir() / "_build" / "libkvmulti_hip.so"
    return p if p.exists() else None


def library_archs(lib: Path) -> list[str] | None:
    meta = lib.with_suffix(".json")
    if meta.exists():
        return json.loads(meta.read_text()).get("archs")
    return None


def _build_rocm_module():
    """hip/build_rocm.py (standalone: also the install-time builder), loaded from the sources."""
    path = source_dir() / "build_rocm.py"
    spec = importlib.util.spec_from_file_location("kvmulti_hip_build_rocm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_rocm_library(archs: list[str] | None = None, out: Path | None = None) -> Path:
    """Build the ROCm library with hipcc for ``archs`` (default: rocm_target_archs()), cached."""
    hipcc = hipcc_path()
    if hipcc is None:
        raise HipBuildError("hipcc not found (install ROCm's hipcc or set ROCM_PATH): cannot build the HIP kernels")
    archs = archs or rocm_target_archs()
    if not archs:
        raise HipBuildError("no target archs: set PYTORCH_ROCM_ARCH (e.g. 'gfx90a;gfx942') or run on a ROCm host "
                            "with visible GPUs")
    src = source_dir()
    out = out or rocm_library_path(archs)
    if not out.exists():
        cmd = _build_rocm_module().command(hipcc, archs, Path("{tmp}"), src / "launcher.hip")
        _locked_build(out, cmd, f"the HIP kernels with hipcc for {', '.join(archs)}",
                      env=dict(os.environ, HIP_PLATFORM="amd"))
    out.with_suffix(".json").write_text(json.dumps({"archs": archs}))
    return out


# ------------------------------------------------------------------------------------ ctypes
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
    lib.kvmulti_hip_paged_attention.argtypes = ([_I, _I, _I, _P, _P, _P, _P, _P, _P] + [_LL] * 8 + [_I] * 6
                                                + [_F, _F, _I, _I, _P, _I, _I, _I, _I, _P])
    lib.kvmulti_hip_paged_attention.restype = _I
    lib.kvmulti_hip_write_kv.argtypes = [_I, _P, _P, _P, _P] + [_LL] * 9 + [_I] * 6 + [_P]
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


# ------------------------------------------------------------------------------------ backend
class HipBackend(Backend):
    name = "HIP"
    platforms = ("rocm",)
    head_sizes = HEAD_SIZES
    min_block_size = 1
    supports_sliding_window = True
    supports_softcap = True
    supports_latent = False
    supports_non_causal = False

    def __init__(self, partition_size: int | None = None, cpu_wave: int | None = None):
        """``partition_size``: split-KV control (see module doc; default ``KVMULTI_HIP_PARTITION_SIZE``
        or -1 = heuristic). ``cpu_wave``: wave size the CPU harness emulates (32 = RDNA/NVIDIA-like,
        64 = CDNA; default ``KVMULTI_HIP_CPU_WAVE`` or 64). ROCm always uses the device's wave size."""
        env_ps = os.environ.get("KVMULTI_HIP_PARTITION_SIZE", "").strip()
        self.partition_size = int(env_ps) if partition_size is None and env_ps else (
            -1 if partition_size is None else int(partition_size))
        wave = cpu_wave if cpu_wave is not None else int(os.environ.get("KVMULTI_HIP_CPU_WAVE", "64") or 64)
        if wave not in (32, 64):
            raise ValueError(f"cpu_wave must be 32 or 64, got {wave}")
        self.cpu_wave = wave
        self._warned = False
        self.last_num_partitions = 0  # of the last paged_attention call (tests check the split-KV path)
        self._rocm_reasons: list[str] | None = None
        self._cpu_reasons: list[str] | None = None

    # -- availability -------------------------------------------------------------------------
    def rocm_reasons(self) -> list[str]:
        """Why the ROCm library cannot serve this host's GPUs (cached)."""
        if self._rocm_reasons is None:
            reasons = []
            if not torch.version.hip:
                reasons.append("torch is not a ROCm build (torch.version.hip is None)")
            elif not torch.cuda.is_available():
                reasons.append("no ROCm GPU visible to torch")
            else:
                lib = prebuilt_rocm_library()
                if lib is not None and not lib.exists():
                    reasons.append(f"KVMULTI_HIP_LIBRARY={lib} does not exist")
                    built = None
                elif lib is not None:
                    built = library_archs(lib)
                else:
                    if hipcc_path() is None:
                        reasons.append("hipcc not found (install ROCm's hipcc or set ROCM_PATH) and no prebuilt "
                                       "library (KVMULTI_HIP_LIBRARY)")
                    built = rocm_target_archs()
                arch = device_arch()
                if built is not None and arch not in built:
                    reasons.append(f"device arch {arch} is not among the built archs {built} "
                                   "(set PYTORCH_ROCM_ARCH to include it)")
            self._rocm_reasons = reasons
        return self._rocm_reasons

    def cpu_reasons(self) -> list[str]:
        """Why the CPU harness cannot run here (cached): empty when it is built or buildable."""
        if self._cpu_reasons is None:
            self._cpu_reasons = [] if cpu_library_path().exists() else cpu_harness_reasons()
        return self._cpu_reasons

    def unavailable_reasons(self) -> list[str]:
        rocm, cpu = self.rocm_reasons(), self.cpu_reasons()
        if not rocm or not cpu:
            return []
        return [f"ROCm: {r}" for r in rocm] + [f"CPU harness: {r}" for r in cpu]

    def platform_reasons(self, platform: str) -> list[str]:
        if platform == "rocm":
            return self.rocm_reasons()
        if platform == "cpu":
            # The CPU harness (emulator) serves CPU tensors, only when HIP is named explicitly: the
            # cpu priority list does not contain HIP.
            return self.cpu_reasons()
        return [f"HIP runs on rocm (and on cpu through its CPU harness, when named), not {platform}"]

    def describe(self) -> str:
        if torch.version.hip:
            archs = rocm_target_archs()
            return f"rocm (hipcc, archs {', '.join(archs) if archs else 'unknown'})"
        built = cpu_library_path().exists() if not cpu_harness_reasons() else False
        return "CPU harness (emulator)" + ("" if built else ", built with g++ on first use")

    def capability_reasons(self, config: AttentionConfig) -> list[str]:
        reasons = super().capability_reasons(config)
        if config.head_size_v not in (0, config.head_size):
            reasons.append(f"head_size_v {config.head_size_v} != head_size {config.head_size} not supported")
        return reasons

    # -- execution ----------------------------------------------------------------------------
    def _library(self, device: torch.device) -> tuple[ctypes.CDLL, int, int | None]:
        """(library, wave argument, stream) for tensors on ``device``."""
        if device.type == "cpu":
            lib = load_cpu_library()
            if not self._warned:
                warnings.warn("kvmulti HIP backend on a CPU tensor: running the HIP kernels on the CPU harness "
                              "(emulator) -- for verification, not performance", RuntimeWarning, stacklevel=3)
                self._warned = True
            _check(lib, lib.kvcpu_set_warp_size(self.cpu_wave), "kvcpu_set_warp_size", True)
            return lib, self.cpu_wave, None
        if device.type == "cuda" and torch.version.hip:
            lib = load_rocm_library()
            return lib, 0, torch.cuda.current_stream(device).cuda_stream
        raise RuntimeError(f"HIP backend cannot run tensors on {device}")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                 layout: KVCacheLayout, slot_mapping: torch.Tensor) -> None:
        if key.shape[0] == 0:
            return
        lib, _, stream = self._library(kv_cache.device)
        s = layout.strides(kv_cache)
        slots = slot_mapping.to(torch.int64).contiguous()
        hv = layout.value_size if value is not None else 0
        v = value if value is not None else key
        with _device_guard(kv_cache.device):
            err = lib.kvmulti_hip_write_kv(
                DTYPE_CODES[kv_cache.dtype], key.data_ptr(), v.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(),
                key.stride(0), key.stride(1), key.stride(2), v.stride(0), v.stride(1), v.stride(2),
                s.block, s.token, s.head, min(key.shape[0], v.shape[0], slots.numel()), layout.num_kv_heads,
                layout.head_size, hv, layout.block_size, min(layout.num_blocks, kv_cache.shape[0]), stream)
        _check(lib, err, "write_kv", kv_cache.device.type == "cpu")

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                        metadata: CommonAttentionMetadata, scale: float, sliding_window: int | None,
                        softcap: float | None, out: torch.Tensor, partition_size: int | None = None) -> None:
        num_tokens = metadata.num_actual_tokens
        if num_tokens == 0:
            return
        lib, wave, stream = self._library(kv_cache.device)
        s = layout.strides(kv_cache)
        if query.stride(2) != 1:
            query = query.contiguous()
        dst = out if out.stride(2) == 1 else torch.empty_like(out)
        qsl = metadata.query_start_loc.to(torch.int32).contiguous()
        seq_lens = metadata.seq_lens.to(torch.int32).contiguous()
        table = metadata.block_table.to(torch.int32)
        if table.stride(1) != 1:
            table = table.contiguous()
        hq = query.shape[1]
        max_span = metadata.max_seq_len if not sliding_window else min(metadata.max_seq_len, sliding_window)
        request = self.partition_size if partition_size is None else int(partition_size)
        ps, npart = _I(0), _I(1)
        _check(lib, lib.kvmulti_hip_plan(num_tokens, hq, layout.num_kv_heads, max_span, request, ctypes.byref(ps),
                                         ctypes.byref(npart)), "plan", kv_cache.device.type == "cpu")
        ws_floats = lib.kvmulti_hip_workspace_floats(num_tokens, hq, layout.head_size, npart.value)
        workspace = torch.empty(max(ws_floats, 1), dtype=torch.float32, device=query.device)
        with _device_guard(kv_cache.device):
            err = lib.kvmulti_hip_paged_attention(
                DTYPE_CODES[query.dtype], layout.head_size, wave, dst.data_ptr(), query.data_ptr(),
                kv_cache.data_ptr(), qsl.data_ptr(), seq_lens.data_ptr(), table.data_ptr(),
                query.stride(0), query.stride(1), dst.stride(0), dst.stride(1), s.block, s.token, s.head,
                table.stride(0), min(metadata.num_reqs, qsl.numel() - 1, seq_lens.numel()), num_tokens, hq,
                layout.num_kv_heads, layout.block_size, int(sliding_window or 0), float(scale), float(softcap or 0.0),
                ps.value, npart.value, workspace.data_ptr() if npart.value > 1 else None,
                min(query.shape[0], dst.shape[0]), table.shape[0], table.shape[1],
                min(layout.num_blocks, kv_cache.shape[0]), stream)
        _check(lib, err, "paged_attention", kv_cache.device.type == "cpu")
        if dst is not out:
            out.copy_(dst)
        self.last_num_partitions = npart.value


class _NullGuard:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _device_guard(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else _NullGuard()


def _check(lib: ctypes.CDLL, err: int, what: str, harness: bool) -> None:
    if err == 0:
        return
    msg = lib.kvmulti_hip_error_string(err).decode()
    if harness:
        detail = lib.kvcpu_last_error().decode()
        lib.kvcpu_clear_error()
        if detail:
            msg += f": {detail}"
    raise RuntimeError(f"kvmulti HIP {what} failed: {msg}")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvmulti.backends.hip build-rocm [--arch gfx90a ...] [--out DIR] | build-cpu``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvmulti.backends.hip")
    sub = parser.add_subparsers(dest="cmd", required=True)
    rocm = sub.add_parser("build-rocm", help="build libkvmulti_hip.so with hipcc (KVMULTI_BUILD_HIP=1 installs)")
    rocm.add_argument("--arch", action="append", help="offload arch (repeatable); default PYTORCH_ROCM_ARCH or "
                                                      "this host's GPUs")
    rocm.add_argument("--out", help="output directory (default: the cache)")
    sub.add_parser("build-cpu", help="build the CPU-harness library")
    args = parser.parse_args(argv)
    if args.cmd == "build-rocm":
        out = Path(args.out) / "libkvmulti_hip.so" if args.out else None
        print(build_rocm_library(args.arch, out))
    else:
        print(build_cpu_library())
    return 0


if __name__ == "__main__":
    sys.exit(main())
