"""Input checks of the public ops, so no backend has to repeat them.

What is checked where:

* always (no device sync): types, dtypes, shapes and devices of every tensor and the scalars (the
  rules of the table in :mod:`kvmulti.input_rules`, which the functions here evaluate); the metadata's
  invariants on its HOST copies (``query_start_loc_cpu``, ``seq_lens_cpu``): shapes agree with
  ``num_reqs``; ``query_start_loc`` starts at 0, never decreases and ends at ``num_actual_tokens``
  <= the query's rows; 0 <= query_len <= seq_len; ``max_query_len`` / ``max_seq_len`` are at least
  the true maxima; the block table has a row per request and is wide enough for every seq_len;
* index VALUES in device tensors (slot ids, the block ids each request reads, device tensors equal
  to their host copies): always for CPU tensors, for accelerator tensors only under
  ``KVMULTI_VALIDATE=1`` (they would force a device sync). Where they are not checked the kernels
  still never touch memory outside their tensors: a bad value gives wrong numbers, not a crash.

Every check runs before anything is written, so a rejected call leaves the cache untouched. The
model runner checks each group's metadata once per step (in the per-step hook), not per layer.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import input_rules, settings
from .capture import CaptureBucket
from .fp8 import FP8_DTYPES, check_scale_values
from .layout import KVCacheLayout
from .metadata import CommonAttentionMetadata, first_visible_position

if TYPE_CHECKING:
    from .backends.base import StepMetadata

INDEX_DTYPES = input_rules.INDEX_DTYPES


def value_checks_enabled(device: torch.device) -> bool:
    return device.type == "cpu" or bool(settings.get("KVMULTI_VALIDATE"))


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
    """Static checks of a KV write: the write rules of :mod:`kvmulti.input_rules`."""
    input_rules.check_write(key, value, kv_cache, layout, slot_mapping)


def prepared_attention_is_plain(query, kv_cache, layout, step, out, scale, sliding_window, softcap,
                                backend, sinks=None, alibi_slopes=None, k_scale=None, v_scale=None) -> bool:
    """The gate of a prepared attention call's fast paths (not input rules: what lets the call skip
    the rules these imply): ``layout`` is the step's own object, no backend named, the step's
    window, plain tensors (``out``, ``sinks``, ``alibi_slopes`` None or one), a float (or None)
    scale and softcap, and scales as :func:`prepared_scales_are_plain` says. The rules follow: the
    step's own calls (``step.calls``) or :func:`prepared_attention_tensors_fit`."""
    return not (layout is not step.layout or backend is not None or sliding_window != step.sliding_window
                or type(query) is not torch.Tensor or type(kv_cache) is not torch.Tensor
                or out is not None and type(out) is not torch.Tensor
                or sinks is not None and type(sinks) is not torch.Tensor
                or alibi_slopes is not None and type(alibi_slopes) is not torch.Tensor
                or not (scale is None or type(scale) is float) or not (softcap is None or type(softcap) is float)
                or not (k_scale is None and v_scale is None or prepared_scales_are_plain(k_scale, v_scale, layout)))


def prepared_scales_are_plain(k_scale, v_scale, layout) -> bool:
    """The scale part of the prepared gates: the cache is fp8 and each scale is None, a Python float
    or a plain tensor (a scale for another cache, or of another type, takes the full checks, which
    name what is wrong). Their rules (kvmulti/fp8.py: ``check_scale_*``) are checked by the step's
    calls, or by the normalisation the other fast path does (:func:`kvmulti.fp8.scale_tensor`)."""
    return (layout.dtype in FP8_DTYPES and (k_scale is None or type(k_scale) is float or type(k_scale) is torch.Tensor)
            and (v_scale is None or type(v_scale) is float or type(v_scale) is torch.Tensor))


def prepared_attention_tensors_fit(query, kv_cache, step, out, scale=None, softcap=None, sinks=None,
                                   alibi_slopes=None) -> bool:
    """Every ``prepared`` attention rule of :mod:`kvmulti.input_rules` holds, after
    :func:`prepared_attention_is_plain` (and the layout takes the fast paths: not latent).
    False sends the call through the full checks."""
    return input_rules.prepared_attention_fits(query, kv_cache, out, scale, softcap, step, sinks, alibi_slopes)


def prepared_write_is_plain(key, value, kv_cache, layout, slot_mapping, step, k_scale=None, v_scale=None) -> bool:
    """The gate of a prepared write's fast paths: ``layout`` is ``step``'s own object, every
    argument a plain tensor and scales as :func:`prepared_scales_are_plain` says (the rules follow:
    ``step.calls`` or :func:`prepared_write_tensors_fit`)."""
    return (layout is step.layout and type(key) is torch.Tensor and type(value) is torch.Tensor
            and type(kv_cache) is torch.Tensor and type(slot_mapping) is torch.Tensor
            and (k_scale is None and v_scale is None or prepared_scales_are_plain(k_scale, v_scale, layout)))


def prepared_write_tensors_fit(key, value, kv_cache, slot_mapping, step) -> bool:
    """Every ``prepared`` write rule of :mod:`kvmulti.input_rules` holds, after
    :func:`prepared_write_is_plain` (and the layout takes the fast paths: not latent). False sends
    the call through the full checks."""
    return input_rules.prepared_write_fits(key, value, kv_cache, slot_mapping, step)


def check_slot_values(slot_mapping: torch.Tensor, layout: KVCacheLayout) -> None:
    """Every slot is -1 (skip) or within the cache (rule ``slots.range``; CPU tensors, or
    ``KVMULTI_VALIDATE=1``)."""
    if value_checks_enabled(slot_mapping.device) and slot_mapping.numel():
        input_rules.check_slot_range(slot_mapping, layout)


def _once(step: "StepMetadata", kind: str, tensor: torch.Tensor, check) -> None:
    """``check(tensor)`` once per step per ``tensor`` (kept in ``step.extras[kind]``, so its id is not
    reused this step): value checks a group's layers would otherwise repeat per layer."""
    checked = step.extras.setdefault(kind, {})
    if checked.get(id(tensor)) is not tensor:
        check(tensor)
        checked[id(tensor)] = tensor


def check_slot_values_once(step: "StepMetadata", slot_mapping: torch.Tensor, layout: KVCacheLayout) -> None:
    """:func:`check_slot_values`, once per step per slot tensor."""
    _once(step, "checked_slot_mappings", slot_mapping, lambda slots: check_slot_values(slots, layout))


def check_scale_values_once(step: "StepMetadata", scale: torch.Tensor, name: str) -> None:
    """:func:`kvmulti.fp8.check_scale_values` (CPU tensors only), once per step per scale tensor."""
    if scale.device.type == "cpu":
        _once(step, "checked_scales", scale, lambda values: check_scale_values(values, name))


def check_alibi_values_once(step: "StepMetadata", alibi_slopes: torch.Tensor | None) -> None:
    """Every slope is finite (rule ``alibi.finite``; CPU tensors, or ``KVMULTI_VALIDATE=1``), once per
    step per slopes tensor."""
    if alibi_slopes is not None and value_checks_enabled(alibi_slopes.device):
        _once(step, "checked_alibi_slopes", alibi_slopes, input_rules.check_alibi_values)


def check_attention_args(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                         scale: float | None, sliding_window: int | None, softcap: float | None,
                         out: torch.Tensor | None = None, step: "StepMetadata | None" = None,
                         sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> None:
    """Static checks of an attention call's tensors and scalars (the metadata aside; with ``step``
    also the query against the step): the attention rules of :mod:`kvmulti.input_rules`."""
    input_rules.check_attention(query, kv_cache, layout, out, scale, sliding_window, softcap, step, sinks,
                                alibi_slopes)


check_window = input_rules.check_window


def check_metadata(metadata: CommonAttentionMetadata, layout: KVCacheLayout, num_query_rows: int,
                   sliding_window: int | None, device: torch.device, check_values: bool = True) -> None:
    """Every invariant of ``metadata`` for a query of ``num_query_rows`` rows over a cache of
    ``layout`` (see the module docstring for what runs where): :func:`check_lengths`, then
    :func:`check_group_metadata`. Raises TypeError/ValueError naming the field and the rule."""
    longest = check_lengths(metadata, num_query_rows, device)
    check_group_metadata(metadata, layout, sliding_window, device, longest, check_values)


def check_capture(metadata: CommonAttentionMetadata, num_query_rows: int, capture: CaptureBucket) -> None:
    """A step prepared for graph capture launches for ``capture``'s maxima: ``metadata`` holds its
    ``max_num_seqs`` requests (the real ones, then padding with query length 0), the query its
    ``max_num_tokens`` rows, and the batch lies within its maximum query and sequence lengths.
    Raises ValueError naming the field."""
    if not isinstance(capture, CaptureBucket):
        raise TypeError(f"capture must be a kvmulti.CaptureBucket, got {type(capture).__name__}")
    if metadata.num_reqs != capture.max_num_seqs:
        raise ValueError(f"metadata.num_reqs is {metadata.num_reqs}, the capture bucket's max_num_seqs "
                         f"{capture.max_num_seqs}: pad the batch to the bucket (requests with query length 0)")
    if num_query_rows != capture.max_num_tokens:
        raise ValueError(f"the query has {num_query_rows} rows, the capture bucket's max_num_tokens "
                         f"{capture.max_num_tokens}")
    if metadata.max_query_len > capture.max_query_len:
        raise ValueError(f"metadata.max_query_len {metadata.max_query_len} exceeds the capture bucket's "
                         f"max_query_len {capture.max_query_len}")
    if metadata.max_seq_len > capture.max_seq_len:
        raise ValueError(f"metadata.max_seq_len {metadata.max_seq_len} exceeds the capture bucket's "
                         f"max_seq_len {capture.max_seq_len}")


def check_group_metadata(metadata: CommonAttentionMetadata, layout: KVCacheLayout, sliding_window: int | None,
                         device: torch.device, longest: int, check_values: bool = True) -> None:
    """What one KV-cache group checks after :func:`check_lengths` passed (``longest``: its result):
    the block table (:func:`check_block_table`) and, unless ``check_values`` is False (metadata
    whose ids come from an engine's own block pools), the block ids' and host copies' values."""
    check_block_table(metadata, layout, device, longest)
    if check_values and value_checks_enabled(metadata.block_table.device):
        _check_device_values(metadata, layout, sliding_window)


_CPU = torch.device("cpu")


def check_lengths(metadata: CommonAttentionMetadata, num_query_rows: int, device: torch.device) -> int:
    """The layout-independent part of :func:`check_metadata`: types and shapes of the length
    tensors, the scalar fields and the host values of ``query_start_loc`` / ``seq_lens``. KV-cache
    groups that share those tensors (one runner's groups) need it once per step. Returns the
    longest seq_len (0 without requests)."""
    if not isinstance(metadata, CommonAttentionMetadata):
        raise TypeError(f"metadata must be a kvmulti.CommonAttentionMetadata, got {type(metadata).__name__}")
    check_index("metadata.query_start_loc", metadata.query_start_loc, 1, device, (torch.int32,))
    check_index("metadata.seq_lens", metadata.seq_lens, 1, device, (torch.int32,))
    check_index("metadata.query_start_loc_cpu", metadata.query_start_loc_cpu, 1, _CPU, (torch.int32,))
    check_index("metadata.seq_lens_cpu", metadata.seq_lens_cpu, 1, _CPU, (torch.int32,))
    n = metadata.num_reqs
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"metadata.num_reqs must be an int >= 0, got {n!r}")
    if not (metadata.query_start_loc.shape[0] - 1 == metadata.query_start_loc_cpu.shape[0] - 1
            == metadata.seq_lens.shape[0] == metadata.seq_lens_cpu.shape[0] == n):
        counts = {name: getattr(metadata, name).shape[0] - (name.startswith("query_start_loc"))
                  for name in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu")}
        sizes = ", ".join(f"{name} has {c + name.startswith('query_start_loc')} entries ({c} requests)"
                          for name, c in counts.items())
        raise ValueError(f"metadata's request counts disagree: num_reqs = {n}, {sizes}; query_start_loc "
                         "needs num_reqs + 1 entries and seq_lens num_reqs")
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
        query_lens = list(map(operator.sub, qsl[1:], qsl))
        over = any(map(operator.gt, query_lens, seq))
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
