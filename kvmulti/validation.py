"""Input checks of the public ops, so no backend has to repeat them.

What is checked where:

* always (no device sync): types, dtypes, shapes and devices of every tensor; the metadata's
  invariants on its HOST copies (``query_start_loc_cpu``, ``seq_lens_cpu``): shapes agree with
  ``num_reqs``; ``query_start_loc`` starts at 0, never decreases and ends at ``num_actual_tokens``
  <= the query's rows; 0 <= query_len <= seq_len; ``max_query_len`` / ``max_seq_len`` are at least
  the true maxima; the block table has a row per request and is wide enough for every seq_len;
  ``scale`` and ``softcap`` are finite;
* index VALUES in device tensors (slot ids, the block ids each request reads, device tensors equal
  to their host copies): always for CPU tensors, for accelerator tensors only under
  ``KVMULTI_VALIDATE=1`` (they would force a device sync). Where they are not checked the kernels
  still never touch memory outside their tensors: a bad value gives wrong numbers, not a crash.

Every check runs before anything is written, so a rejected call leaves the cache untouched. The
model runner checks each group's metadata once per step (in the per-step hook), not per layer.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import settings
from .fp8 import activation_dtypes
from .layout import KVCacheLayout
from .metadata import CommonAttentionMetadata, first_visible_position

INDEX_DTYPES = (torch.int32, torch.int64)


def value_checks_enabled(device: torch.device) -> bool:
    return device.type == "cpu" or bool(settings.get("KVMULTI_VALIDATE"))


def check_layout_and_cache(layout: KVCacheLayout, kv_cache: torch.Tensor) -> None:
    if not isinstance(layout, KVCacheLayout):
        raise TypeError(f"layout must be a kvmulti.KVCacheLayout, got {type(layout).__name__}")
    layout.validate(kv_cache)


def check_rows(name: str, tensor: torch.Tensor, layout: KVCacheLayout, heads: int | None, size: int,
               device: torch.device) -> None:
    """``tensor`` is [tokens, heads, size] on ``device`` (heads None: any), of the cache dtype (any
    activation dtype for an fp8 cache)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in activation_dtypes(layout.dtype):
        raise TypeError(f"{name} has dtype {tensor.dtype}, the cache holds {layout.dtype}")
    if tensor.dim() != 3:
        raise ValueError(f"{name} must be 3-D [num_tokens, num_heads, head_size], got shape {tuple(tensor.shape)}")
    if heads is not None and tensor.shape[1] != heads:
        raise ValueError(f"{name} has {tensor.shape[1]} heads, the layout has num_kv_heads={heads}")
    if tensor.shape[2] != size:
        raise ValueError(f"{name} has head size {tensor.shape[2]}, the layout expects {size}")
    check_device(name, tensor, device)


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the kv_cache is on {device}")


def check_index(name: str, tensor: torch.Tensor, dims: int, device: torch.device,
                dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name} must be an integer tensor of {', '.join(map(str, dtypes))}, got {tensor.dtype}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(tensor.shape)}")
    check_device(name, tensor, device)


def check_write(key: torch.Tensor, value: torch.Tensor | None, kv_cache: torch.Tensor, layout: KVCacheLayout,
                slot_mapping: torch.Tensor) -> None:
    """Static checks of a KV write."""
    if _write_is_well_formed(key, value, kv_cache, layout, slot_mapping):
        return
    check_layout_and_cache(layout, kv_cache)
    device = kv_cache.device
    check_rows("key", key, layout, layout.num_kv_heads, layout.head_size, device)
    if not layout.is_latent:
        if value is None:
            raise TypeError("value must be a tensor (only a latent cache with head_size_v=0 takes value=None)")
        check_rows("value", value, layout, layout.num_kv_heads, layout.value_size, device)
        if value.shape[0] != key.shape[0]:
            raise ValueError(f"value has {value.shape[0]} tokens but key has {key.shape[0]}")
    check_index("slot_mapping", slot_mapping, 1, device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")


def _write_is_well_formed(key, value, kv_cache, layout, slot_mapping) -> bool:
    """:func:`check_write`'s rules for the common case (a cache of the layout, key and value of an
    activation dtype the cache takes, int64/int32 slots, one device) in a few attribute reads; False sends the call through
    the full checks, which name what is wrong."""
    try:
        if not isinstance(layout, KVCacheLayout):
            return False
        layout.validate(kv_cache)
        if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
                and isinstance(slot_mapping, torch.Tensor)) or layout.is_latent:
            return False
        shape, device, dtypes = key.shape, kv_cache.device, activation_dtypes(layout.dtype)
        return (key.dtype in dtypes and value.dtype in dtypes
                and shape[1:] == (layout.num_kv_heads, layout.head_size)
                and value.shape == (shape[0], layout.num_kv_heads, layout.value_size)
                and slot_mapping.shape == shape[:1] and slot_mapping.dtype in INDEX_DTYPES
                and key.device == device and value.device == device and slot_mapping.device == device)
    except (TypeError, ValueError, AttributeError, IndexError):
        return False


def _query_is_well_formed(query, kv_cache, layout) -> bool:
    """:func:`check_attention_args`' tensor rules for the common case (a query of an activation
    dtype the cache takes) in a few attribute reads; False sends the call through the full checks."""
    try:
        if not isinstance(layout, KVCacheLayout):
            return False
        layout.validate(kv_cache)
        shape = query.shape
        return (query.dtype in activation_dtypes(layout.dtype) and len(shape) == 3 and shape[2] == layout.head_size
                and shape[1] % layout.num_kv_heads == 0 and query.device == kv_cache.device)
    except (TypeError, ValueError, AttributeError, IndexError):
        return False


def prepared_attention_is_plain(query, kv_cache, layout, step, out, scale, sliding_window, softcap,
                                backend) -> bool:
    """The scalar and type rules of a prepared attention call's fast paths: ``layout`` is the step's
    own object, no backend named, the step's window, plain tensors (``out`` None or one), a finite
    float scale (or None) and a float softcap >= 0 (or None). The tensors' shapes are checked
    after this by the step's own calls (``step.calls``) or :func:`prepared_attention_tensors_fit`."""
    return not (layout is not step.layout or backend is not None or sliding_window != step.sliding_window
                or type(query) is not torch.Tensor or type(kv_cache) is not torch.Tensor
                or out is not None and type(out) is not torch.Tensor
                or not (scale is None or type(scale) is float and math.isfinite(scale))
                or not (softcap is None or type(softcap) is float and 0.0 <= softcap < math.inf))


def prepared_attention_tensors_fit(query, kv_cache, step, out) -> bool:
    """The rest of every check a prepared attention call gets (:func:`check_attention_args`,
    :func:`check_out` and the step's own), after :func:`prepared_attention_is_plain`: the layout
    takes the fast paths (not fp8, not latent), the cache is the layout's (dtype, shape, strides),
    query [>= num_actual_tokens, Hq, D] and out (None, or [its rows, Hq, Dv]) of the cache's dtype
    and device. False sends the call through the full checks."""
    cache, _, head_size, value_size, heads, rows, fast = step.call_signature
    qs, device = query.shape, kv_cache.device
    return (fast and (kv_cache.dtype, kv_cache.shape, kv_cache.stride()) == cache and query.dtype == cache[0]
            and len(qs) == 3 and qs[1] == heads and qs[2] == head_size and qs[0] >= rows and query.device == device
            and (out is None or out.dtype == cache[0] and out.shape == (qs[0], heads, value_size)
                 and out.device == device))


def prepared_write_is_plain(key, value, kv_cache, layout, slot_mapping, step) -> bool:
    """The type rules of a prepared write's fast paths: ``layout`` is ``step``'s own object and
    every argument a plain tensor (shapes follow: ``step.calls`` or :func:`prepared_write_tensors_fit`)."""
    return (layout is step.layout and type(key) is torch.Tensor and type(value) is torch.Tensor
            and type(kv_cache) is torch.Tensor and type(slot_mapping) is torch.Tensor)


def prepared_write_tensors_fit(key, value, kv_cache, slot_mapping, step) -> bool:
    """:func:`check_write`'s rules for the common prepared write, after
    :func:`prepared_write_is_plain`: the layout takes the fast paths (not fp8, not latent), key /
    value [T, Hkv, D / Dv] of the cache's dtype, slot_mapping [T] int32/int64, all on the cache's
    device. False sends the call through the full checks."""
    cache, kv_heads, head_size, value_size, _, _, fast = step.call_signature
    ks, device = key.shape, kv_cache.device
    return (fast and (kv_cache.dtype, kv_cache.shape, kv_cache.stride()) == cache and key.dtype == cache[0]
            and value.dtype == cache[0] and len(ks) == 3 and ks[1] == kv_heads and ks[2] == head_size
            and value.shape == (ks[0], kv_heads, value_size) and slot_mapping.shape == ks[:1]
            and slot_mapping.dtype in INDEX_DTYPES and key.device == device and value.device == device
            and slot_mapping.device == device)


def check_slot_values(slot_mapping: torch.Tensor, layout: KVCacheLayout) -> None:
    """Every slot is -1 (skip) or within the cache."""
    if not value_checks_enabled(slot_mapping.device) or slot_mapping.numel() == 0:
        return
    low, high = map(int, torch.aminmax(slot_mapping))
    if low < -1 or high >= layout.num_slots:
        bad = low if low < -1 else high
        raise ValueError(f"slot_mapping holds slot {bad}, outside -1 (skip) .. {layout.num_slots - 1} "
                         f"(num_blocks {layout.num_blocks} x block_size {layout.block_size})")


def check_attention_args(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                         scale: float | None, sliding_window: int | None, softcap: float | None) -> None:
    """Static checks of an attention call's tensors and scalars (the metadata aside)."""
    if sliding_window is None and softcap is None and (scale is None or type(scale) is float and math.isfinite(scale)) \
            and _query_is_well_formed(query, kv_cache, layout):
        return
    check_layout_and_cache(layout, kv_cache)
    check_rows("query", query, layout, None, layout.head_size, kv_cache.device)
    if query.shape[1] % layout.num_kv_heads:
        raise ValueError(f"query has {query.shape[1]} heads, not a multiple of num_kv_heads={layout.num_kv_heads}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    check_window(sliding_window)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap >= 0 or math.isinf(softcap)):
        raise ValueError(f"softcap must be None or a finite float >= 0 (0 = off), got {softcap!r}")


def check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def check_out(out: torch.Tensor, query: torch.Tensor, layout: KVCacheLayout) -> None:
    """A caller's output buffer: [query rows, query heads, head_size_v] of the query's dtype and device."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    want = (query.shape[0], query.shape[1], layout.value_size)
    if out.shape != want:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {want} (query rows, query heads, head_size_v)")
    if out.dtype != query.dtype:
        raise TypeError(f"out has dtype {out.dtype}, the query {query.dtype}")
    check_device("out", out, query.device)


def check_metadata(metadata: CommonAttentionMetadata, layout: KVCacheLayout, num_query_rows: int,
                   sliding_window: int | None, device: torch.device, check_values: bool = True) -> None:
    """Every invariant of ``metadata`` for a query of ``num_query_rows`` rows over a cache of
    ``layout`` (see the module docstring for what runs where). Raises TypeError/ValueError naming
    the field and the rule. ``check_values=False`` skips the block-id / host-copy value checks: for
    metadata whose ids come from kvmulti's own block pools (the model runner's)."""
    longest = check_lengths(metadata, num_query_rows, device)
    check_block_table(metadata, layout, device, longest)
    if check_values and value_checks_enabled(metadata.block_table.device):
        _check_device_values(metadata, layout, sliding_window)


def check_lengths(metadata: CommonAttentionMetadata, num_query_rows: int, device: torch.device) -> int:
    """The layout-independent part of :func:`check_metadata`: types and shapes of the length
    tensors, the scalar fields and the host values of ``query_start_loc`` / ``seq_lens``. KV-cache
    groups that share those tensors (one runner's groups) need it once per step. Returns the
    longest seq_len (0 without requests)."""
    if not isinstance(metadata, CommonAttentionMetadata):
        raise TypeError(f"metadata must be a kvmulti.CommonAttentionMetadata, got {type(metadata).__name__}")
    check_index("metadata.query_start_loc", metadata.query_start_loc, 1, device, (torch.int32,))
    check_index("metadata.seq_lens", metadata.seq_lens, 1, device, (torch.int32,))
    cpu = torch.device("cpu")
    check_index("metadata.query_start_loc_cpu", metadata.query_start_loc_cpu, 1, cpu, (torch.int32,))
    check_index("metadata.seq_lens_cpu", metadata.seq_lens_cpu, 1, cpu, (torch.int32,))
    n = metadata.num_reqs
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"metadata.num_reqs must be an int >= 0, got {n!r}")
    for name in ("query_start_loc", "query_start_loc_cpu"):
        if getattr(metadata, name).shape[0] != n + 1:
            raise ValueError(f"metadata.{name} has {getattr(metadata, name).shape[0]} entries, "
                             f"expected num_reqs + 1 = {n + 1}")
    for name in ("seq_lens", "seq_lens_cpu"):
        if getattr(metadata, name).shape[0] != n:
            raise ValueError(f"metadata.{name} has {getattr(metadata, name).shape[0]} entries, expected num_reqs = {n}")
    for name in ("num_actual_tokens", "max_query_len", "max_seq_len"):
        value = getattr(metadata, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"metadata.{name} must be an int >= 0, got {value!r}")
    if metadata.num_actual_tokens > num_query_rows:
        raise ValueError(f"query has {num_query_rows} tokens, metadata.num_actual_tokens is "
                         f"{metadata.num_actual_tokens}")
    return _check_host_values(metadata)


def check_block_table(metadata: CommonAttentionMetadata, layout: KVCacheLayout, device: torch.device,
                      longest: int) -> None:
    """The group-specific part of :func:`check_metadata`: the block table's type, a row per request
    and enough columns for the longest request with ``layout``'s block size (after
    :func:`check_lengths`, whose result ``longest`` is)."""
    check_index("metadata.block_table", metadata.block_table, 2, device, (torch.int32,))
    if metadata.block_table.shape[0] < metadata.num_reqs:
        raise ValueError(f"metadata.block_table has {metadata.block_table.shape[0]} rows for "
                         f"{metadata.num_reqs} requests")
    if not metadata.num_reqs:
        return
    if -(-longest // layout.block_size) > metadata.block_table.shape[1]:
        raise ValueError(f"block_table has {metadata.block_table.shape[1]} columns, too narrow for "
                         f"seq_len {longest} with block_size {layout.block_size}")


#: Up to this many requests the host checks run on Python ints (a few microseconds per step);
#: numpy's fixed cost per call is lower only for larger batches.
_SMALL_BATCH = 64


def _host_extremes(qsl_t: torch.Tensor, seq_t: torch.Tensor) -> tuple[int, int, int, int, int, int, bool]:
    """first and last query_start_loc, shortest / longest query_len and seq_len, and whether some
    query_len exceeds its seq_len, from the host copies (num_reqs >= 1)."""
    if seq_t.shape[0] <= _SMALL_BATCH:
        qsl, seq = qsl_t.tolist(), seq_t.tolist()
        query_lens = [b - a for a, b in zip(qsl, qsl[1:])]
        over = any(q > s for q, s in zip(query_lens, seq))
        return qsl[0], qsl[-1], min(query_lens), max(query_lens), min(seq), max(seq), over
    qsl, seq = qsl_t.numpy().astype(np.int64), seq_t.numpy().astype(np.int64)
    query_lens = np.diff(qsl)
    return (int(qsl[0]), int(qsl[-1]), int(query_lens.min()), int(query_lens.max()), int(seq.min()),
            int(seq.max()), bool((query_lens > seq).any()))


def _check_host_values(metadata: CommonAttentionMetadata) -> int:
    """The host copies' values against the scalar fields; returns the longest seq_len (0: none)."""
    if metadata.num_reqs == 0:
        first = last = int(metadata.query_start_loc_cpu[0])
    else:
        first, last, shortest_query, longest_query, shortest, longest, over = _host_extremes(
            metadata.query_start_loc_cpu, metadata.seq_lens_cpu)
    if first != 0:
        raise ValueError(f"metadata.query_start_loc must start at 0, got {first}")
    if last != metadata.num_actual_tokens:
        raise ValueError(f"metadata.query_start_loc ends at {last} but num_actual_tokens is "
                         f"{metadata.num_actual_tokens}")
    if metadata.num_reqs == 0:
        return 0
    if shortest_query < 0 or shortest < 0 or over:      # name the first offending request
        qsl = metadata.query_start_loc_cpu.numpy().astype(np.int64)
        seq = metadata.seq_lens_cpu.numpy().astype(np.int64)
        query_lens = np.diff(qsl)
        if shortest_query < 0:
            i = int(np.flatnonzero(query_lens < 0)[0])
            raise ValueError(f"metadata.query_start_loc must not decrease: entry {i + 1} ({int(qsl[i + 1])}) < "
                             f"entry {i} ({int(qsl[i])})")
        if shortest < 0:
            i = int(np.flatnonzero(seq < 0)[0])
            raise ValueError(f"metadata: request {i} has a negative seq_len {int(seq[i])}")
        i = int(np.flatnonzero(query_lens > seq)[0])
        raise ValueError(f"metadata: request {i} has query_len {int(query_lens[i])} > seq_len {int(seq[i])}")
    if longest_query > metadata.max_query_len:
        raise ValueError(f"metadata.max_query_len {metadata.max_query_len} is below the longest query_len "
                         f"{longest_query}")
    if longest > metadata.max_seq_len:
        raise ValueError(f"metadata.max_seq_len {metadata.max_seq_len} is below the longest seq_len {longest}")
    return longest


def _check_device_values(metadata: CommonAttentionMetadata, layout: KVCacheLayout,
                         sliding_window: int | None) -> None:
    """Device tensors agree with their host copies and every block id a request reads is in the
    cache (host copies of device tensors: a device sync on accelerators)."""
    n = metadata.num_reqs
    for name in ("query_start_loc", "seq_lens"):
        dev, host = getattr(metadata, name), getattr(metadata, name + "_cpu")
        if dev.data_ptr() != host.data_ptr() and not torch.equal(dev.cpu(), host):
            raise ValueError(f"metadata.{name} differs from metadata.{name}_cpu")
    if n == 0:
        return
    seq = metadata.seq_lens_cpu.numpy().astype(np.int64)
    query_lens = np.diff(metadata.query_start_loc_cpu.numpy().astype(np.int64))
    blocks = metadata.block_table[:n].cpu().numpy()
    ncols = -(-int(seq.max()) // layout.block_size)                     # the longest request's blocks
    as_unsigned = blocks[:, :ncols].view(np.uint32)                      # negative ids become huge
    if as_unsigned.size == 0 or int(as_unsigned.max()) < layout.num_blocks:
        return                                                # all in range: no need to mask per request
    first = first_visible_position(seq - query_lens, sliding_window) // layout.block_size
    cols = np.arange(ncols)
    read = (cols >= first[:, None]) & (cols < (-(-seq // layout.block_size))[:, None])
    bad = read & (as_unsigned >= layout.num_blocks)
    if bad.any():
        req, col = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"metadata.block_table[{req}, {col}] = {int(blocks[req, col])} is outside the cache's "
                         f"{layout.num_blocks} blocks")
