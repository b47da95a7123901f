"""The public ops: ``kvmulti.write_kv`` and ``kvmulti.paged_attention``.

Two ways in:

* with a :class:`~kvmulti.CommonAttentionMetadata` (and optionally a backend name): the call
  validates its inputs (:mod:`kvmulti.validation`), picks a backend (named, else the environment,
  else platform priority), lets it prepare the step (:meth:`Backend.build_metadata`) and runs it;
* with a :class:`~kvmulti.backends.StepMetadata` from :func:`prepare_step` (what the model runner
  and engine integrations do once per step per KV-cache group): the metadata is already validated
  and the backend resolved, so a layer's call checks only its own tensors and launches the kernel.

Under ``torch.compile`` both go through ``torch.library`` custom ops (``kvmulti::write_kv``
mutates the cache, ``kvmulti::paged_attention`` returns a new tensor) with fake implementations,
so ``torch.compile(fullgraph=True)`` traces calls to them.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

import torch

from .backends.base import Backend, StepMetadata
from .backends.registry import get_backend, select_backend_for_layout
from .fp8 import is_fp8, scale_tensor
from .layout import KVCacheLayout
from .capture import CaptureBucket
from .metadata import CommonAttentionMetadata
from .custom_ops import layout_args, register_custom_ops
from .validation import (check_alibi_values_once, check_attention_args, check_capture, check_group_metadata,
                         check_lengths,
                         check_slot_values, check_slot_values_once, check_window, check_write,
                         prepared_attention_is_plain, prepared_attention_tensors_fit, prepared_write_is_plain,
                         prepared_write_tensors_fit)

K = TypeVar("K", bound=Hashable)
CAPTURE_NEEDS_OUT = "a step prepared for graph capture needs out= (a buffer of the bucket's rows made before capture)"


def resolve_backend(layout: KVCacheLayout, device: torch.device | str, *, sliding_window: int | None = None,
                    softcap: float | None = None, causal: bool = True, backend: str | Backend | None = None,
                    role: str = "target", sinks: bool = False, alibi: bool = False) -> Backend:
    """The backend object serving caches of ``layout`` on ``device`` with these features: the
    backend ``backend`` names, else the env override for ``role``, else platform priority. Raises
    BackendSelectionError listing every reason when none can serve. A backend OBJECT is returned as
    it is: it was resolved for this cache already (by the model runner or :func:`prepare_step`).
    ``sinks`` / ``alibi``: the layers pass attention sinks / ALiBi slopes (only backends serving
    them qualify)."""
    if isinstance(backend, Backend):
        return backend
    return get_backend(_backend_name(layout, device, sliding_window, softcap, causal, backend, role, sinks, alibi))


def _backend_name(layout: KVCacheLayout, device: torch.device | str, sliding_window: int | None,
                  softcap: float | None, causal: bool, backend: str | Backend | None, role: str,
                  sinks: bool = False, alibi: bool = False) -> str:
    """:func:`resolve_backend`'s choice as a name (a constant to torch.compile)."""
    if isinstance(backend, Backend):
        return backend.name
    return select_backend_for_layout(layout, torch.device(device), sliding_window is not None, bool(softcap),
                                     causal, role, backend, bool(sinks), bool(alibi))


def prepare_step(metadata: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int, *,
                 num_query_rows: int | None = None, sliding_window: int | None = None,
                 softcap: float | None = None, backend: str | Backend | None = None,
                 role: str = "target", device: torch.device | None = None,
                 check_values: bool = True, sinks: torch.Tensor | bool | None = None,
                 alibi_slopes: torch.Tensor | bool | None = None,
                 capture: CaptureBucket | None = None) -> StepMetadata:
    """The per-step hook: validate ``metadata`` for one KV-cache group (query of ``num_query_rows``
    rows, default ``num_actual_tokens``; tensors on ``device``, default the metadata's), resolve its
    backend and let it prepare what every layer of the group reuses this step. Pass the result to
    :func:`paged_attention` as ``metadata``. An engine with several groups calls
    :func:`prepare_steps` instead, which checks what the groups share once.

    ``check_values=False`` skips the checks of the block ids each request reads and of device
    tensors against their host copies (a device sync on accelerators): for metadata an engine's
    own block manager made (kvmulti's runner, vLLM's scheduler). Types, shapes and the host lengths
    are still checked, and the kernels never access memory outside their tensors whatever the
    values (tests/test_fuzz_metadata.py).

    ``sinks``: the group's layers pass attention sinks to :func:`paged_attention` (a layer's sinks
    tensor, or True; None / False: they do not). Only a backend serving sinks is chosen.
    ``alibi_slopes`` likewise: the layers pass ALiBi slopes (only a backend serving ALiBi).

    ``capture``: prepare the step for graph capture (a backend with ``supports_capture``): its
    launches are fixed for the bucket's maxima, so one captured layer call replays correctly after
    the metadata's device tensors are updated in place for another batch within the bucket (see
    docs/design.md, "Steps prepared for graph capture"). ``metadata`` then holds the bucket's
    ``max_num_seqs`` requests and the query ``num_query_rows`` = ``max_num_tokens`` rows (the
    default with a bucket)."""
    device = _metadata_device(metadata, device)
    rows = (metadata.num_actual_tokens if capture is None else capture.max_num_tokens) if num_query_rows is None \
        else num_query_rows
    _check_group_args(layout, num_query_heads, sliding_window)
    longest = check_lengths(metadata, rows, device)
    if capture is not None:
        check_capture(metadata, rows, capture)
    return _prepare_group(metadata, layout, num_query_heads, sliding_window, softcap, backend, role, device,
                          check_values, longest, sinks, alibi_slopes, capture)


def prepare_steps(metadata: Mapping[K, CommonAttentionMetadata], layouts: Mapping[K, KVCacheLayout],
                  num_query_heads: int, *, num_query_rows: int | None = None,
                  sliding_windows: Mapping[K, int | None] | None = None, softcap: float | None = None,
                  backends: Mapping[K, str | Backend | None] | None = None, role: str = "target",
                  device: torch.device | None = None, check_values: bool = True,
                  sinks: Mapping[K, torch.Tensor | bool | None] | None = None,
                  alibi_slopes: Mapping[K, torch.Tensor | bool | None] | None = None,
                  capture: CaptureBucket | None = None) -> dict[K, StepMetadata]:
    """:func:`prepare_step` for every KV-cache group of one step: ``metadata[g]`` over a cache of
    ``layouts[g]`` with window ``sliding_windows[g]`` (default None), backend ``backends[g]``
    (default: dispatch), ``sinks[g]`` and ``alibi_slopes[g]`` (default None), the other arguments as there. Returns
    ``{g: StepMetadata}``; ``capture``: every group's step prepared for graph capture in that bucket.

    The length checks (query_start_loc, seq_lens, their host copies and the scalar fields) run once
    for all groups whose metadata hold the very same length tensors and scalars, as an engine's
    groups do; each group's block table, values and backend are checked on their own. Raises
    KeyError when ``layouts`` lacks a group of ``metadata``."""
    windows, chosen, group_sinks, group_alibi = sliding_windows or {}, backends or {}, sinks or {}, alibi_slopes or {}
    steps: dict[K, StepMetadata] = {}
    checked: list[tuple[CommonAttentionMetadata, int]] = []        # (metadata checked, its longest seq_len)
    for group, md in metadata.items():
        layout, window = layouts[group], windows.get(group)
        dev = _metadata_device(md, device)
        rows = (md.num_actual_tokens if capture is None else capture.max_num_tokens) if num_query_rows is None \
            else num_query_rows
        _check_group_args(layout, num_query_heads, window)
        longest = next((n for seen, n in checked if _same_lengths(seen, md)), None)
        if longest is None:
            longest = check_lengths(md, rows, dev)
            checked.append((md, longest))
        if capture is not None:
            check_capture(md, rows, capture)
        steps[group] = _prepare_group(md, layout, num_query_heads, window, softcap, chosen.get(group), role, dev,
                                      check_values, longest, group_sinks.get(group), group_alibi.get(group), capture)
    return steps


def _metadata_device(metadata: CommonAttentionMetadata, device: torch.device | None) -> torch.device | None:
    """``device``, else the metadata's (that of its query_start_loc)."""
    if not isinstance(metadata, CommonAttentionMetadata):
        raise TypeError(f"metadata must be a kvmulti.CommonAttentionMetadata, got {type(metadata).__name__}")
    if device is None and isinstance(metadata.query_start_loc, torch.Tensor):
        return metadata.query_start_loc.device
    return device


def _check_group_args(layout: KVCacheLayout, num_query_heads: int, sliding_window: int | None) -> None:
    check_window(sliding_window)
    if isinstance(num_query_heads, bool) or not isinstance(num_query_heads, int) or num_query_heads < 1 \
            or num_query_heads % layout.num_kv_heads:
        raise ValueError(f"num_query_heads must be a positive multiple of num_kv_heads={layout.num_kv_heads}, "
                         f"got {num_query_heads!r}")


def _same_lengths(a: CommonAttentionMetadata, b: CommonAttentionMetadata) -> bool:
    """``b`` holds the very length tensors and scalars ``a`` held when its lengths were checked."""
    return (type(b) is CommonAttentionMetadata and a.query_start_loc is b.query_start_loc
            and a.seq_lens is b.seq_lens and a.query_start_loc_cpu is b.query_start_loc_cpu
            and a.seq_lens_cpu is b.seq_lens_cpu and a.num_reqs == b.num_reqs
            and a.num_actual_tokens == b.num_actual_tokens and a.max_query_len == b.max_query_len
            and a.max_seq_len == b.max_seq_len)


def _prepare_group(metadata: CommonAttentionMetadata, layout: KVCacheLayout, num_query_heads: int,
                   sliding_window: int | None, softcap: float | None, backend: str | Backend | None, role: str,
                   device: torch.device, check_values: bool, longest: int,
                   sinks: torch.Tensor | bool | None = None,
                   alibi_slopes: torch.Tensor | bool | None = None,
                   capture: CaptureBucket | None = None) -> StepMetadata:
    """One group's step after :func:`check_lengths` (and with ``capture`` :func:`check_capture`)
    passed (``longest``: its longest seq_len)."""
    check_group_metadata(metadata, layout, sliding_window, device, longest, check_values)
    has_sinks = sinks is not None and sinks is not False
    has_alibi = alibi_slopes is not None and alibi_slopes is not False
    chosen = resolve_backend(layout, device, sliding_window=sliding_window, softcap=softcap,
                             causal=metadata.causal, backend=backend, role=role, sinks=has_sinks, alibi=has_alibi)
    if has_sinks and isinstance(backend, Backend) and not backend.supports_sinks:
        raise ValueError(f"backend {backend.name} does not serve attention sinks")
    if has_alibi and isinstance(backend, Backend) and not backend.supports_alibi:
        raise ValueError(f"backend {backend.name}: ALiBi not supported")
    step = chosen.build_metadata(metadata, layout, num_query_heads, sliding_window, capture)
    step.sinks = has_sinks
    step.alibi = has_alibi
    return step


def write_kv(key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor, layout: KVCacheLayout,
             slot_mapping: torch.Tensor, backend: str | Backend | None = None, role: str = "target",
             k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
             step: StepMetadata | None = None) -> None:
    """Write key [T, Hkv, head_size] and value [T, Hkv, head_size_v] into ``kv_cache`` at
    ``slot_mapping`` [T] (int32/int64; slot = block * block_size + offset; -1 = skip).

    An fp8 cache (``layout.dtype`` in :data:`kvmulti.fp8.FP8_DTYPES`) stores ``fp8(key / k_scale)``
    and ``fp8(value / v_scale)`` (kvmulti/fp8.py: fp32 division, saturating, round to nearest even);
    key and value may then be fp32, fp16 or bf16. Scales: a float, an fp32 tensor of shape [] or
    [num_kv_heads], or None (1.0); giving one for a non-fp8 cache is an error.

    ``backend`` names one of HIP/SYCL/TRITON/CPU or is the backend object a step resolved; None
    dispatches (env var for ``role``, then platform priority). Raises TypeError/ValueError naming
    the bad argument; the cache is untouched then.

    ``step``: the prepared step (:func:`prepare_step`) this write belongs to, for a cache of its
    layout. Its backend serves the write (unless ``backend`` names one), and the slot VALUES are
    checked once per step per ``slot_mapping`` tensor instead of once per layer (the layers of a
    group share it); ``slot_mapping`` must then not change while the step is in use. An fp8 cache's
    scales then reach the step's calls as they are given (TRITON: launch arguments, no copy per
    call; see docs/design.md), checked by the same rules as without a step.
    """
    if type(step) is StepMetadata and backend is None and not torch.compiler.is_compiling() \
            and prepared_write_is_plain(key, value, kv_cache, layout, slot_mapping, step, k_scale, v_scale):
        # a prepared layer's write: only its own tensors checked, by the backend's step calls or here
        calls = step.calls
        scales = () if k_scale is None and v_scale is None else (k_scale, v_scale)    # an fp8 cache's only
        if calls is not None and calls.write(key, value, kv_cache, slot_mapping, *scales):
            return
        if prepared_write_tensors_fit(key, value, kv_cache, slot_mapping, step):
            k_scale, v_scale = _scales(k_scale, v_scale, layout, kv_cache.device)
            check_slot_values_once(step, slot_mapping, layout)
            _write_with(step.backend, key, value, kv_cache, layout, slot_mapping, k_scale, v_scale)
            return
    check_write(key, value, kv_cache, layout, slot_mapping)
    if step is not None:
        if not isinstance(step, StepMetadata):
            raise TypeError(f"step must be a StepMetadata from prepare_step, got {type(step).__name__}")
        if step.layout is not layout and step.layout != layout:
            raise ValueError("step was prepared for another layout")
        backend = step.backend if backend is None else backend
    k_scale, v_scale = _scales(k_scale, v_scale, layout, kv_cache.device)
    if value is None:
        value = key.new_empty((key.shape[0], layout.num_kv_heads, 0))
    if torch.compiler.is_compiling():
        name = _backend_name(layout, kv_cache.device, None, None, True, backend, role)
        torch.ops.kvmulti.write_kv(key, value, kv_cache, slot_mapping, *layout_args(layout), name, k_scale, v_scale)
    else:
        _write(key, value, kv_cache, layout, slot_mapping, resolve_backend(layout, kv_cache.device, backend=backend,
                                                                           role=role), k_scale, v_scale, step)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                    metadata: CommonAttentionMetadata | StepMetadata, scale: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None,
                    backend: str | Backend | None = None, role: str = "target",
                    out: torch.Tensor | None = None, k_scale: float | torch.Tensor | None = None,
                    v_scale: float | torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention for a mixed batch (prefill, chunked prefill, decode, verification).

    query [T, Hq, head_size] (cache dtype; fp32/fp16/bf16 for an fp8 cache) -> out
    [T, Hq, head_size_v], the query's dtype; rows past ``num_actual_tokens`` are zero. An fp8
    cache is read as ``float(k) * k_scale`` / ``float(v) * v_scale`` (scales as in :func:`write_kv`,
    also with a step). ``scale`` defaults to head_size ** -0.5; ``sliding_window`` W keeps keys
    with q_pos - k_pos < W; ``softcap`` c > 0 applies c * tanh(score / c) after scaling (0 or None:
    off). ``out``: a caller's buffer of that shape to fill (and return) instead of a new
    tensor. ``metadata`` from :func:`prepare_step` skips validation, selection and planning; its
    window and backend are the ones it was prepared with (with ``sinks``, a step prepared with
    ``sinks``). ``sinks`` fp32 [Hq] on the cache's device: head h's logit joins the softmax
    denominator of each of its rows and contributes no value (gpt-oss); only backends serving
    sinks take them. ``alibi_slopes`` fp32 [Hq] on the cache's device: head h's score of the query at
    position q against the key at position k gains ``alibi_slopes[h] * (k - q)`` after scale and
    softcap (with a step, one prepared with ``alibi_slopes``); only backends serving ALiBi take them.
    """
    if type(metadata) is StepMetadata and not torch.compiler.is_compiling() \
            and prepared_attention_is_plain(query, kv_cache, layout, metadata, out, scale, sliding_window, softcap,
                                            backend, sinks, alibi_slopes, k_scale, v_scale):
        # a prepared layer's call: only its own tensors checked, by the backend's step calls or here
        calls, scale = metadata.calls, layout.default_scale if scale is None else scale
        if out is None and metadata.capture is not None:
            raise ValueError(CAPTURE_NEEDS_OUT)
        if calls is not None and (sinks is None or metadata.sinks) and (alibi_slopes is None or metadata.alibi):
            target = out if out is not None or query.dim() != 3 else \
                query.new_zeros(query.shape[0], metadata.num_query_heads, layout.value_size)
            scales = () if k_scale is None and v_scale is None else (k_scale, v_scale)    # an fp8 cache's only
            if target is not None and calls.attend(query, kv_cache, target, scale, softcap or 0.0, sinks,
                                                   alibi_slopes, *scales):
                return target
        if prepared_attention_tensors_fit(query, kv_cache, metadata, out, scale, softcap, sinks, alibi_slopes):
            k_scale, v_scale = _scales(k_scale, v_scale, layout, kv_cache.device)
            check_alibi_values_once(metadata, alibi_slopes)
            return _attend(query, kv_cache, metadata, scale, softcap or None, out, k_scale, v_scale, sinks,
                           alibi_slopes)
    check_attention_args(query, kv_cache, layout, scale, sliding_window, softcap, out,
                         metadata if isinstance(metadata, StepMetadata) else None, sinks, alibi_slopes)
    softcap = float(softcap) if softcap else None
    scale = float(layout.default_scale if scale is None else scale)
    k_scale, v_scale = _scales(k_scale, v_scale, layout, kv_cache.device)
    if torch.compiler.is_compiling():        # the custom op validates and prepares inside
        if isinstance(metadata, StepMetadata):
            common, name = metadata.common, metadata.backend.name
        else:
            common = metadata
            name = _backend_name(layout, kv_cache.device, sliding_window, softcap, metadata.causal, backend, role,
                                 sinks is not None, alibi_slopes is not None)
        result = torch.ops.kvmulti.paged_attention(
            query, kv_cache, common.query_start_loc, common.seq_lens, common.block_table,
            common.query_start_loc_cpu, common.seq_lens_cpu, common.num_actual_tokens, common.max_query_len,
            common.max_seq_len, common.causal, *layout_args(layout), scale, sliding_window, softcap, name,
            k_scale, v_scale, sinks, alibi_slopes)
        return result if out is None else out.copy_(result)
    if isinstance(metadata, StepMetadata):
        step = _check_step(metadata, query, layout, sliding_window, backend)
    else:
        step = prepare_step(metadata, layout, query.shape[1], num_query_rows=query.shape[0],
                            sliding_window=sliding_window, softcap=softcap, backend=backend, role=role,
                            device=kv_cache.device, sinks=sinks, alibi_slopes=alibi_slopes)
    check_alibi_values_once(step, alibi_slopes)
    return _attend(query, kv_cache, step, scale, softcap, out, k_scale, v_scale, sinks, alibi_slopes)


def _scales(k_scale: float | torch.Tensor | None, v_scale: float | torch.Tensor | None, layout: KVCacheLayout,
            device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both scale arguments in the form backends receive (kvmulti/fp8.py: fp32 [Hkv] or None)."""
    if k_scale is None and v_scale is None and not is_fp8(layout.dtype):
        return None, None                                   # the common case, without the calls
    return (scale_tensor(k_scale, "k_scale", layout.dtype, layout.num_kv_heads, device),
            scale_tensor(v_scale, "v_scale", layout.dtype, layout.num_kv_heads, device))


def _check_step(step: StepMetadata, query: torch.Tensor, layout: KVCacheLayout, sliding_window: int | None,
                backend: str | Backend | None) -> StepMetadata:
    if step.layout is not layout and step.layout != layout:
        raise ValueError("metadata was prepared for another layout")
    if step.sliding_window != sliding_window:
        raise ValueError(f"metadata was prepared for sliding_window={step.sliding_window}, the call passes "
                         f"{sliding_window}")
    if backend is not None and backend is not step.backend and get_backend_name(backend) != step.backend.name:
        raise ValueError(f"backend={get_backend_name(backend)} but the metadata was prepared by {step.backend.name}")
    return step


def get_backend_name(backend: str | Backend) -> str:
    return backend.name if isinstance(backend, Backend) else get_backend(backend).name


def _write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
           slot_mapping: torch.Tensor, backend: Backend, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None, step: StepMetadata | None = None) -> None:
    if step is None:
        check_slot_values(slot_mapping, layout)
    else:
        check_slot_values_once(step, slot_mapping, layout)
    _write_with(backend, key, None if layout.is_latent else value, kv_cache, layout, slot_mapping, k_scale, v_scale)


def _write_with(backend: Backend, key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor,
                layout: KVCacheLayout, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> None:
    """``backend.write_kv`` of a checked write, scales (normalised) passed for an fp8 cache only."""
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    backend.write_kv(key, value, kv_cache, layout, slot_mapping, **scales)


def _attend(query: torch.Tensor, kv_cache: torch.Tensor, step: StepMetadata, scale: float,
            softcap: float | None, out: torch.Tensor | None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
            alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    n = step.common.num_actual_tokens
    if step.capture is not None:      # the kernels write the rows of the replay's requests, nothing else
        if out is None:
            raise ValueError(CAPTURE_NEEDS_OUT)
    elif out is None:
        out = torch.zeros(query.shape[0], query.shape[1], step.layout.value_size, dtype=query.dtype,
                          device=query.device)
    elif out.shape[0] > n:
        out[n:].zero_()
    extra = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}   # fp8 caches only
    if sinks is not None:                                       # backends serving sinks only
        extra["sinks"] = sinks.contiguous()
    if alibi_slopes is not None:                                # backends serving ALiBi only
        extra["alibi_slopes"] = alibi_slopes.contiguous()
    step.backend.paged_attention(query, kv_cache, step, scale, softcap, out, **extra)
    return out


# eager calls go straight to _write / _attend; torch.compile traces the custom ops
register_custom_ops()
