"""HIP backend: the HIP C++ kernels in ``hip/`` through one C ABI (``hip/launcher.hip``), run two ways:

* **ROCm host** (platform ``rocm``): ``libkvmulti_hip.so`` built with the host's hipcc
  (:mod:`.build`), called through ctypes (:mod:`.library`) with tensors' ``data_ptr()``s on torch's
  current HIP stream.
* **CPU host** (platform ``cpu``): kvmulti's HIP-on-CPU harness runs the unmodified kernels, every
  GPU thread a fiber. An emulator for verification: the dispatcher never picks it; it runs only
  when named and warns once.

Split-KV (the shared ``partition_size`` contract): the per-step hook calls ``kvmulti_hip_plan``
(launcher.hip), which with -1 splits each key range into partitions of 512 keys when the longest
visible span exceeds 1024 keys and the un-split grid has fewer than 4 working blocks per compute
unit; the partial results are merged by a reduce kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import warnings
from dataclasses import dataclass

import torch

from ... import settings
from ...layout import KVCacheLayout
from ...metadata import CommonAttentionMetadata, max_visible_span
from ..base import ALL_DTYPES, FP8_DTYPES, AttentionConfig, Backend, StepMetadata
from . import build
from .library import CACHE_DTYPE_CODES, DTYPE_CODES, check, load_cpu_library, load_rocm_library

#: Head sizes with compiled kernel instantiations (hip/launcher.hip dispatch_head_size).
HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 128, 256)


@dataclass(frozen=True)
class HipPlan:
    """What every layer of a step reuses: int32 metadata copies, the split and its workspace."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    partition_size: int
    num_partitions: int
    workspace: torch.Tensor | None     # fp32, only when num_partitions > 1


class HipBackend(Backend):
    name = "HIP"
    platforms = ("rocm",)
    dtypes = ALL_DTYPES + FP8_DTYPES    # fp8 caches, OCP and FNUZ: hip/kvmulti_common.h's fp8 codecs
    head_sizes = HEAD_SIZES
    supports_sinks = True        # joined where a row is normalised, or by the split-KV reduce kernel
    supports_alibi = True        # added where scores are formed (both engines, both kernels)
    supports_non_causal = True   # every row sees its request's seq_len keys
    supports_non_causal_window = False   # its kernels mask one side only

    def __init__(self, partition_size: int | None = None, cpu_wave: int | None = None,
                 prefill_min_query: int = -1):
        """``cpu_wave``: wave size the CPU harness emulates (32 = RDNA/NVIDIA-like, 64 = CDNA;
        default ``KVMULTI_HIP_CPU_WAVE``). ROCm always uses the device's wave size.
        ``prefill_min_query``: a step whose longest query has at least this many tokens runs the prefill
        kernel (-1: the launcher's default, 64; 0: never; 1: every step)."""
        super().__init__(partition_size)
        self.prefill_min_query = int(prefill_min_query)
        wave = int(settings.get("KVMULTI_HIP_CPU_WAVE")) if cpu_wave is None else int(cpu_wave)
        if wave not in (32, 64):
            raise ValueError(f"cpu_wave must be 32 or 64, got {wave}")
        self.cpu_wave = wave
        self._warned = False
        self._rocm_reasons: list[str] | None = None
        self._cpu_reasons: list[str] | None = None
        if torch.version.hip and not self.rocm_reasons():
            try:                 # load (or build) the ROCm library now, never inside an attention call
                load_rocm_library()
            except Exception as error:
                self._rocm_reasons = [f"the ROCm library failed to build or load: {type(error).__name__}: {error}"]

    # -- availability -------------------------------------------------------------------------
    def rocm_reasons(self) -> list[str]:
        """Why the ROCm library cannot serve this host's GPUs (cached)."""
        if self._rocm_reasons is None:
            self._rocm_reasons = _rocm_reasons()
        return self._rocm_reasons

    def cpu_reasons(self) -> list[str]:
        """Why the CPU harness cannot run here (cached): empty when it is built or buildable."""
        if self._cpu_reasons is None:
            self._cpu_reasons = [] if build.cpu_library_path().exists() else build.cpu_harness_reasons()
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
            return self.cpu_reasons()    # the emulator serves CPU tensors only when HIP is named
        return [f"HIP runs on rocm (and on cpu through its CPU harness, when named), not {platform}"]

    def describe(self) -> str:
        if torch.version.hip:
            archs = build.rocm_target_archs()
            return f"rocm (hipcc, archs {', '.join(archs) if archs else 'unknown'})"
        built = build.cpu_library_path().exists() if not build.cpu_harness_reasons() else False
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
                              "(emulator) -- for verification, not performance", RuntimeWarning, stacklevel=4)
                self._warned = True
            check(lib, lib.kvcpu_set_warp_size(self.cpu_wave), "kvcpu_set_warp_size", True)
            return lib, self.cpu_wave, None
        if device.type == "cuda" and torch.version.hip:
            return load_rocm_library(), 0, torch.cuda.current_stream(device).cuda_stream
        raise RuntimeError(f"HIP backend cannot run tensors on {device}")

    def plan(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
             sliding_window: int | None) -> HipPlan:
        device = common.device
        qsl = common.query_start_loc.to(torch.int32).contiguous()
        seq_lens = common.seq_lens.to(torch.int32).contiguous()
        table = common.block_table.to(torch.int32)
        if table.stride(1) != 1:
            table = table.contiguous()
        num_tokens = common.num_actual_tokens
        if num_tokens == 0:
            return HipPlan(qsl, seq_lens, table, 0, 1, None)
        lib, _, _ = self._library(device)
        # keys past the table's width are never read (the kernels stop there); a non-causal row sees
        # all seq_len keys
        span = max_visible_span(common.max_seq_len, sliding_window) if common.causal else common.max_seq_len
        max_span = min(span, table.shape[1] * layout.block_size)
        ps, npart = ctypes.c_int(0), ctypes.c_int(1)
        check(lib, lib.kvmulti_hip_plan(num_tokens, num_query_heads, layout.num_kv_heads,
                                        max_span, self.partition_size,
                                        ctypes.byref(ps), ctypes.byref(npart)), "plan", device.type == "cpu")
        workspace = None
        if npart.value > 1:
            floats = lib.kvmulti_hip_workspace_floats(num_tokens, num_query_heads, layout.head_size, npart.value)
            workspace = torch.empty(max(floats, 1), dtype=torch.float32, device=device)
        return HipPlan(qsl, seq_lens, table, ps.value, npart.value, workspace)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                 layout: KVCacheLayout, slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        if key.shape[0] == 0:
            return
        lib, _, stream = self._library(kv_cache.device)
        s = layout.strides(kv_cache)
        slots = slot_mapping.to(torch.int64).contiguous()
        hv = layout.value_size if value is not None else 0
        v = value.to(key.dtype) if value is not None else key
        with _device_guard(kv_cache.device):
            err = lib.kvmulti_hip_write_kv(
                DTYPE_CODES[key.dtype], CACHE_DTYPE_CODES[kv_cache.dtype], _ptr(k_scale), _ptr(v_scale),
                key.data_ptr(), v.data_ptr(), kv_cache.data_ptr(), slots.data_ptr(),
                key.stride(0), key.stride(1), key.stride(2), v.stride(0), v.stride(1), v.stride(2),
                s.block, s.token, s.head, min(key.shape[0], v.shape[0], slots.numel()), layout.num_kv_heads,
                layout.head_size, hv, layout.block_size, min(layout.num_blocks, kv_cache.shape[0]), stream)
        check(lib, err, "write_kv", kv_cache.device.type == "cpu")

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, step: StepMetadata, scale: float,
                        softcap: float | None, out: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> None:
        layout, common, plan = step.layout, step.common, step.plan
        num_tokens = common.num_actual_tokens
        if num_tokens == 0:
            return
        lib, wave, stream = self._library(kv_cache.device)
        s = layout.strides(kv_cache)
        if query.stride(2) != 1:
            query = query.contiguous()
        dst = out if out.stride(2) == 1 else torch.empty_like(out)
        with _device_guard(kv_cache.device):
            err = lib.kvmulti_hip_paged_attention(
                DTYPE_CODES[query.dtype], CACHE_DTYPE_CODES[kv_cache.dtype], _ptr(k_scale), _ptr(v_scale),
                layout.head_size, wave, dst.data_ptr(), query.data_ptr(),
                kv_cache.data_ptr(), plan.query_start_loc.data_ptr(), plan.seq_lens.data_ptr(),
                plan.block_table.data_ptr(), query.stride(0), query.stride(1), dst.stride(0), dst.stride(1),
                s.block, s.token, s.head, plan.block_table.stride(0),
                min(common.num_reqs, plan.query_start_loc.numel() - 1, plan.seq_lens.numel()), num_tokens,
                query.shape[1], layout.num_kv_heads, layout.block_size, int(step.sliding_window or 0), float(scale),
                float(softcap or 0.0), plan.partition_size, plan.num_partitions,
                plan.workspace.data_ptr() if plan.workspace is not None else None,
                min(query.shape[0], dst.shape[0]), plan.block_table.shape[0], plan.block_table.shape[1],
                min(layout.num_blocks, kv_cache.shape[0]), int(common.max_query_len), self.prefill_min_query,
                _ptr(sinks), _ptr(alibi_slopes), int(bool(common.causal)), stream)
        check(lib, err, "paged_attention", kv_cache.device.type == "cpu")
        if dst is not out:
            out.copy_(dst)


def _rocm_reasons() -> list[str]:
    if not torch.version.hip:
        return ["torch is not a ROCm build (torch.version.hip is None)"]
    if not torch.cuda.is_available():
        return ["no ROCm GPU visible to torch"]
    reasons = []
    lib = build.prebuilt_rocm_library()
    if lib is not None and not lib.exists():
        reasons.append(f"KVMULTI_HIP_LIBRARY={lib} does not exist")
        built = None
    elif lib is not None:
        built = build.library_archs(lib)
    else:
        if build.hipcc() is None:
            reasons.append("hipcc not found (install ROCm's hipcc or set ROCM_PATH) and no prebuilt "
                           "library (KVMULTI_HIP_LIBRARY)")
        built = build.rocm_target_archs()
    arch = build.device_arch()
    if built is not None and arch not in built:
        reasons.append(f"device arch {arch} is not among the built archs {built} "
                       "(set PYTORCH_ROCM_ARCH to include it)")
    return reasons


def _ptr(tensor: torch.Tensor | None) -> int | None:
    """The data pointer of an optional fp32 tensor: an fp8 cache's [num_kv_heads] scale, the [num_q_heads]
    sinks or ALiBi slopes (contiguous, on the cache's device); None when absent."""
    return None if tensor is None else tensor.data_ptr()


def _device_guard(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
