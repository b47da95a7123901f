"""SYCL backend: the SYCL C++ kernels in ``sycl/kernels.cpp`` (shipped as ``kvmulti.sycl_src``),
compiled at RUN TIME for the device that runs them (no SYCL compiler needed: the runtime from PyPI
and g++ for the host shim; see :mod:`.runtime`).

Memory: on an XPU host torch XPU tensors are USM device pointers and the kernels run on torch's
current XPU queue (nothing is copied). Torch CPU tensors: a cache from
``layout.allocate("cpu", allocator=usm_allocator)`` is used in place by any SYCL device; plain CPU
tensors are used in place by a device that reports ``aspect::usm_system_allocations`` (Intel's
OpenCL CPU device does) and otherwise staged through USM (``KVMULTI_SYCL_STAGE`` overrides).

Dispatch: SYCL is first in the ``xpu`` priority list. On a CPU-only host it is usable when the
runtime and a device that can compile SYCL source are present, but runs only when named.

Split-KV (the shared ``partition_size`` contract): with -1 a step splits when the longest visible
key span of a tile exceeds ``SPLIT_MIN_SPAN`` and there are fewer than ``SPLIT_WG_PER_CU``
work-groups per compute unit, in partitions of ``settings.DEFAULT_PARTITION_SIZE`` keys.

Attention sinks, ALiBi and non-causal attention (``metadata.causal`` False: every row sees its
request's ``seq_len`` keys) are kernel arguments; sinks join once, where a row is normalised (the
single pass, or the split-KV reduction). A step's tiles of at most ``MR`` rows (decode) run
``kvm_paged_attention``, larger ones (prefill, verification) ``kvm_paged_prefill`` (the plan sorts
them; one launch per kind present). Calls with ALiBi or non-causal metadata launch the ``*_terms``
kernels (those terms compiled into the key loop; a bundle of its own, built on the first such call).
A sliding window with non-causal attention is refused.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ... import settings
from ...layout import KVCacheLayout
from ...metadata import CommonAttentionMetadata, first_visible_position
from ..base import ALL_DTYPES, FP8_DTYPES, Backend, StepMetadata
from .runtime import (ARG_F32, ARG_I32, ARG_I64, ARG_LOCAL_F32, ARG_PTR, K_ATTN,
                      K_ATTN_TERMS, K_PREFILL, K_PREFILL_TERMS, K_REDUCE, K_WRITE, KERNEL_NAMES, PLAIN_KERNEL_NAMES,
                      Session, SyclError, default_session, find_runtime,
                      get_runtime, kernel_source, runtime_reasons, runtime_version, xpu_session)
from . import kernel_config
from .kernel_config import (FP8_CACHE_CODES, MMA_OFF, MR, REDUCE_WG, ROWS, WRITE_WG, choose_wg, kernel_options,
                            lm_floats, prefill_lm_floats, vector_bytes)
from .usm import Staging, usm_allocator, usm_empty

#: Split-KV heuristic (partition_size=-1): split when the longest visible key span of a tile exceeds
#: SPLIT_MIN_SPAN and there are fewer than SPLIT_WG_PER_CU work-groups per compute unit.
SPLIT_MIN_SPAN = 1024
SPLIT_WG_PER_CU = 4


@dataclass
class Plan:
    """Launch plan of one step (computed from the host metadata: no device sync)."""

    tiles: torch.Tensor     # int32 [num_tiles, 2]: (request, first flattened row); narrow tiles first
    num_tiles: int
    max_span: int           # longest visible key range of any tile
    num_parts: int          # 1: no split
    part_size: int          # 0: the single-pass kernel runs
    num_narrow: int = 0     # tiles [0, num_narrow) have at most MR rows (kvm_paged_attention); the rest
                            # more (kvm_paged_prefill)


@dataclass
class SyclStep:
    """What every layer of a step reuses: the plan, the metadata as the kernels read it (int32,
    contiguous, on the kernels' device) and the split path's fp32 workspace."""

    plan: Plan
    tiles: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    part_acc: torch.Tensor | None = None
    part_ml: torch.Tensor | None = None


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
    if num_tiles == 0:
        return Plan(torch.zeros(0, 2, dtype=torch.int32), 0, 0, 1, 0)
    nrows = torch.clamp(rows[req] - f0, max=ROWS)
    order = torch.argsort((nrows > MR).to(torch.int8), stable=True)   # narrow tiles first
    req, f0, nrows = req[order], f0[order], nrows[order]
    num_narrow = int((nrows <= MR).sum())
    tiles = torch.stack([req, f0], 1).to(torch.int32).contiguous()
    ctx = (seq - qlen)[req]
    p_first = ctx + f0 // group
    # the tile's keys end after its last row's position, or at seq_len without the causal mask
    k_end = ctx + (f0 + nrows - 1) // group + 1 if metadata.causal else seq[req]
    lo = first_visible_position(p_first, sliding_window)
    k_max = metadata.block_table.shape[1] * block_size    # the kernels stop at the table's width
    max_span = int((k_end.clamp(max=k_max) - lo.clamp(max=k_max)).clamp(min=0).max())
    if partition_size > 0:
        part = partition_size
    elif partition_size < 0 and max_span > SPLIT_MIN_SPAN and num_tiles * num_kv_heads < SPLIT_WG_PER_CU * compute_units:
        part = settings.DEFAULT_PARTITION_SIZE
    else:
        return Plan(tiles, num_tiles, max_span, 1, 0, num_narrow)
    return Plan(tiles, num_tiles, max_span, max(1, -(-max_span // part)), part, num_narrow)


def check_cache_alignment(kv_cache: torch.Tensor, layout: KVCacheLayout, query_dtype: torch.dtype | None = None) -> None:
    """The attention kernels read K/V rows with vector loads of :func:`vector_bytes`; a cache view
    whose base is not aligned to that is refused (SyclError) rather than read misaligned.
    ``query_dtype``: the activations' dtype of an fp8 cache (None: the cache's dtype)."""
    fp8 = layout.dtype in FP8_CACHE_CODES
    need = vector_bytes(query_dtype if fp8 else layout.dtype, layout.head_size, layout.value_size,
                        layout.dtype if fp8 else None)
    if kv_cache.data_ptr() % need:
        raise SyclError(f"the KV cache's base address {kv_cache.data_ptr():#x} is not aligned to {need} bytes "
                        "(the SYCL kernels load K/V rows as vectors)")


# ------------------------------------------------------------------------------------ the backend
class SyclBackend(Backend):
    """Paged attention through run-time compiled SYCL kernels (see the module docstring)."""

    name = "SYCL"
    platforms = ("xpu",)
    dtypes = ALL_DTYPES + FP8_DTYPES    # fp8 caches, OCP and FNUZ: kernels.cpp built with KVM_CACHE
    supports_sinks = True         # joined where a row is normalised (kernels.cpp: merge / kvm_split_reduce)
    supports_alibi = True         # added where scores are formed, after scale and softcap
    supports_non_causal = True    # every row sees its request's seq_len keys (encoder-only attention)
    supports_non_causal_window = False

    def __init__(self, partition_size: int | None = None, stage_cpu_tensors: bool | None = None):
        super().__init__(partition_size)
        #: None: stage plain CPU tensors through USM only on devices that cannot use host memory
        #: (no usm_system_allocations); True/False forces it (KVMULTI_SYCL_STAGE=1/0).
        self.stage_cpu_tensors = settings.get("KVMULTI_SYCL_STAGE") if stage_cpu_tensors is None else stage_cpu_tensors
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

    @staticmethod
    def _matrix(session: Session, act: torch.dtype) -> bool:
        """Whether ``session``'s device runs the matrix body for activations of ``act``."""
        return kernel_config.matrix_mode(act, session.device.matrix_sg16, session.device.type == "gpu") != MMA_OFF

    def bundle(self, session: Session, layout: KVCacheLayout, activation_dtype: torch.dtype | None = None,
               terms: bool = False) -> int:
        """The kernels for ``layout``'s dtype and head sizes on ``session``'s device (built on first use);
        an fp8 cache needs the ``activation_dtype`` of its queries / keys / values (one bundle each).
        ``terms``: the bundle that also holds kvm_paged_attention_terms (built on the first call with
        ALiBi or non-causal metadata)."""
        fp8 = layout.dtype in FP8_CACHE_CODES
        if fp8 and activation_dtype is None:
            raise SyclError("an fp8 cache's kernels need the activation dtype (query / key / value)")
        act = activation_dtype if fp8 else layout.dtype
        key = (session.key, act, layout.dtype, layout.head_size, layout.value_size, terms)
        handle = self._bundles.get(key)
        if handle is None:
            wg = choose_wg(layout.value_size, session.device.local_mem, self._matrix(session, act))
            opts = kernel_options(act, layout.head_size, layout.value_size, wg, layout.dtype if fp8 else None, terms,
                                  session.device.matrix_sg16, session.device.type == "gpu")
            names = KERNEL_NAMES if terms else PLAIN_KERNEL_NAMES
            handle = self._bundles[key] = session.build(kernel_source(), opts, names)
        return handle

    def _staging(self, session: Session, kv_cache: torch.Tensor) -> Staging:
        stage = self.stage_cpu_tensors
        staging = Staging(session, stage=not session.device.usm_system if stage is None else stage)
        if staging.stage and not self._warned_staging and not session.is_usm(kv_cache):
            self._warned_staging = True
            warnings.warn("SYCL backend: the KV cache is a plain CPU tensor, so every call copies it through USM "
                          "memory; allocate it with layout.allocate('cpu', "
                          "allocator=kvmulti.backends.sycl.usm_allocator) to use it in place", stacklevel=3)
        return staging

    # -- ops ---------------------------------------------------------------------------------
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                 slot_mapping: torch.Tensor,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        if layout.is_latent:
            raise SyclError("the SYCL backend does not support latent caches (head_size_v=0)")
        num_tokens = min(key.shape[0], value.shape[0], slot_mapping.shape[0])   # rows the kernel may read
        total = num_tokens * layout.num_kv_heads * layout.entry_size
        if total == 0:
            return
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value.to(key.dtype) if value.stride(-1) == 1 else value.to(key.dtype).contiguous()
        slot_mapping = slot_mapping.to(torch.int64).contiguous()
        session = self.session_for(kv_cache.device)
        bundle = self.bundle(session, layout, key.dtype)
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
                    (ARG_I32, layout.num_kv_heads), (ARG_I32, layout.block_size)] + _scale_args(ptr, k_scale, v_scale)
            glob = -(-total // WRITE_WG) * WRITE_WG
            session.launch(bundle, K_WRITE, glob, WRITE_WG, args, wait=not on_xpu)
            ok = True
        finally:
            if staging is not None:
                staging.finish(ok)

    def plan(self, common: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
             sliding_window: int | None) -> SyclStep:
        device = common.device
        session = self.session_for(device)
        hkv = layout.num_kv_heads
        plan = plan_attention(common, num_query_heads // hkv, hkv, sliding_window, self.partition_size,
                              session.device.compute_units, layout.block_size)
        if common.block_table.shape[-1] * layout.block_size >= 1 << 30:
            raise SyclError("block table too wide: the SYCL kernels address key positions with 32-bit ints")
        block_table = common.block_table
        if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
            block_table = block_table.to(torch.int32).contiguous()
        if device.type == "xpu":
            step = SyclStep(plan, plan.tiles.to(device, non_blocking=True), common.query_start_loc.to(torch.int32),
                            common.seq_lens.to(torch.int32), block_table)
        else:
            step = SyclStep(plan, plan.tiles, common.query_start_loc_cpu, common.seq_lens_cpu, block_table.cpu())
        if plan.part_size:
            rows = max(common.num_actual_tokens, 0) * num_query_heads
            alloc = ((lambda n: torch.empty(n, dtype=torch.float32, device=device)) if device.type == "xpu" else
                     (lambda n: usm_empty(n, torch.float32, session)))
            step.part_acc = alloc(rows * plan.num_parts * layout.value_size)
            step.part_ml = alloc(rows * plan.num_parts * 2)
        return step

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, step: StepMetadata, scale: float,
                        softcap: float | None, out: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> None:
        """See :meth:`Backend.paged_attention`; ``sinks`` / ``alibi_slopes``: fp32 [Hq] contiguous on
        the cache's device, or None. ``step.common.causal`` False: non-causal (no window)."""
        layout, sstep = step.layout, step.plan
        plan = sstep.plan
        if layout.is_latent:
            raise SyclError("the SYCL backend does not support latent caches (head_size_v=0)")
        if plan.num_tiles == 0:
            return
        device = kv_cache.device
        on_xpu = device.type == "xpu"
        session = self.session_for(device)
        # ALiBi or non-causal: the kernel with those terms in its key loop (the plain one has none)
        with_terms = alibi_slopes is not None or not step.common.causal
        bundle = self.bundle(session, layout, query.dtype, with_terms)
        hkv = layout.num_kv_heads
        group = query.shape[1] // hkv
        query = query if query.stride(-1) == 1 else query.contiguous()
        target = out if out.stride(-1) == 1 else torch.zeros_like(out, memory_format=torch.contiguous_format)
        # rows the kernels may touch: the query's and out's, and the split workspace's
        num_tokens = min(query.shape[0], target.shape[0])
        if plan.part_size:
            num_tokens = min(num_tokens, max(step.common.num_actual_tokens, 0))
        check_cache_alignment(kv_cache, layout, query.dtype)
        block_table = sstep.block_table
        s = layout.strides(kv_cache)
        staging = None if on_xpu else self._staging(session, kv_cache)
        ok = False
        try:
            ptr = (lambda t, written=False: t.data_ptr() if t.numel() else 0) if on_xpu else staging.ptr
            matrix = self._matrix(session, query.dtype)
            wg = choose_wg(layout.value_size, session.device.local_mem, matrix)
            # the local scratch of each attention kernel (the narrow ones' is smaller in matrix bundles)
            local = {K_ATTN: lm_floats(layout.value_size, wg, matrix, narrow=True),
                     K_PREFILL: prefill_lm_floats(layout.head_size, layout.value_size, wg, matrix),
                     K_PREFILL_TERMS: lm_floats(layout.value_size, wg, matrix)}
            local[K_ATTN_TERMS] = local[K_ATTN]
            head_args = [(ARG_PTR, ptr(query)), (ARG_I64, query.stride(0)), (ARG_I64, query.stride(1)),
                         (ARG_I64, num_tokens), (ARG_PTR, ptr(kv_cache)), (ARG_I64, s.block), (ARG_I64, s.token),
                         (ARG_I64, s.head), (ARG_I64, layout.num_blocks),
                         (ARG_PTR, ptr(block_table)), (ARG_I64, block_table.stride(0)),
                         (ARG_I64, block_table.shape[0]), (ARG_I64, block_table.shape[1]),
                         (ARG_PTR, ptr(sstep.seq_lens)), (ARG_PTR, ptr(sstep.query_start_loc))]
            head = [(ARG_I32, hkv), (ARG_I32, group), (ARG_I32, layout.block_size), (ARG_F32, scale),
                    (ARG_I32, step.sliding_window or 0), (ARG_F32, softcap or 0.0)] + _scale_args(ptr, k_scale, v_scale)
            sinks_arg = (ARG_PTR, 0 if sinks is None else ptr(sinks))
            terms = [(ARG_PTR, 0 if alibi_slopes is None else ptr(alibi_slopes)),
                     (ARG_I32, int(bool(step.common.causal)))]
            out_args = [(ARG_PTR, ptr(target, True)), (ARG_I64, target.stride(0)), (ARG_I64, target.stride(1))]
            if not plan.part_size:
                rest = out_args + [(ARG_PTR, 0), (ARG_PTR, 0), (ARG_I32, 1), (ARG_I32, 0)] + head + [sinks_arg] + terms
                parts = 1
            else:
                workspace = [(ARG_PTR, sstep.part_acc.data_ptr()), (ARG_PTR, sstep.part_ml.data_ptr())]
                rest = [(ARG_PTR, 0), (ARG_I64, 0), (ARG_I64, 0)] + workspace + \
                    [(ARG_I32, plan.num_parts), (ARG_I32, plan.part_size)] + head + [(ARG_PTR, 0)] + terms
                parts = plan.num_parts
            # narrow tiles (at most MR rows: decode) on kvm_paged_attention, the others on kvm_paged_prefill
            kernels = ((K_ATTN_TERMS, K_PREFILL_TERMS) if with_terms else (K_ATTN, K_PREFILL))
            ranges = ((0, plan.num_narrow), (plan.num_narrow, plan.num_tiles))
            launches = [(k, a, b) for k, (a, b) in zip(kernels, ranges) if b > a]
            for i, (kernel, a, b) in enumerate(launches):
                last = i == len(launches) - 1 and not plan.part_size
                session.launch(bundle, kernel, (b - a) * hkv * parts * wg, wg,
                               head_args + [(ARG_PTR, ptr(sstep.tiles[a:b]))] + rest + [(ARG_LOCAL_F32, local[kernel])],
                               wait=last and not on_xpu)
            if plan.part_size:
                # the sinks join once, in the reduction
                reduce = workspace + out_args + [(ARG_I32, query.shape[1]), (ARG_I32, plan.num_parts), sinks_arg]
                # only the batch's own rows: padded rows have no partials and stay as they are
                reduce_rows = num_tokens * query.shape[1]
                if reduce_rows:
                    session.launch(bundle, K_REDUCE, reduce_rows * REDUCE_WG, REDUCE_WG, reduce, wait=not on_xpu)
                elif not on_xpu:
                    session.shim.check(session.shim.lib.kvm_wait(session.handle), "waiting for the SYCL queue")
            ok = True
        finally:
            if staging is not None:
                staging.finish(ok)
        if target is not out:
            out.copy_(target)


def _scale_args(ptr, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> list[tuple[int, object]]:
    """The kernels' k_scale / v_scale pointer arguments (fp32 [Hkv] for an fp8 cache; null otherwise)."""
    return [(ARG_PTR, 0 if k_scale is None else ptr(k_scale)), (ARG_PTR, 0 if v_scale is None else ptr(v_scale))]
