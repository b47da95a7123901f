"""Input checks of the public ops, so no backend has to repeat them.

Static checks (types, dtypes, shapes, devices) always run. Checks of index VALUES (slot and
block ids in range) need the data on the host: they always run for CPU tensors and run for
accelerator tensors only under ``KVMULTI_VALIDATE=1`` (they would force a device sync per call).
Every check runs before anything is written, so a rejected call leaves the cache untouched.
"""

from __future__ import annotations

import os
import weakref

import numpy as np
import torch

from .layout import KVCacheLayout
from .metadata import CommonAttentionMetadata

INDEX_DTYPES = (torch.int32, torch.int64)


def value_checks_enabled(device: torch.device) -> bool:
    return device.type == "cpu" or os.environ.get("KVMULTI_VALIDATE", "") == "1"


def check_layout_and_cache(layout: KVCacheLayout, kv_cache: torch.Tensor) -> None:
    if not isinstance(layout, KVCacheLayout):
        raise TypeError(f"layout must be a kvmulti.KVCacheLayout, got {type(layout).__name__}")
    layout.validate(kv_cache)


def check_rows(name: str, tensor: torch.Tensor, layout: KVCacheLayout, heads: int | None, size: int,
               device: torch.device) -> None:
    """``tensor`` is [tokens, heads, size] of the cache dtype on ``device`` (heads None: any)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != layout.dtype:
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


def check_slot_values(slot_mapping: torch.Tensor, layout: KVCacheLayout) -> None:
    """Every slot is -1 (skip) or within the cache."""
    if not value_checks_enabled(slot_mapping.device) or slot_mapping.numel() == 0:
        return
    low, high = map(int, torch.aminmax(slot_mapping))
    if low < -1 or high >= layout.num_slots:
        bad = low if low < -1 else high
        raise ValueError(f"slot_mapping holds slot {bad}, outside -1 (skip) .. {layout.num_slots - 1} "
                         f"(num_blocks {layout.num_blocks} x block_size {layout.block_size})")


def check_attention(query: torch.Tensor, kv_cache: torch.Tensor, layout: KVCacheLayout,
                    metadata: CommonAttentionMetadata, scale: float | None, sliding_window: int | None,
                    softcap: float | None) -> None:
    """Static checks of an attention call, including host-side metadata consistency."""
    check_layout_and_cache(layout, kv_cache)
    device = kv_cache.device
    check_rows("query", query, layout, None, layout.head_size, device)
    if query.shape[1] % layout.num_kv_heads:
        raise ValueError(f"query has {query.shape[1]} heads, not a multiple of num_kv_heads={layout.num_kv_heads}")
    if not isinstance(metadata, CommonAttentionMetadata):
        raise TypeError(f"metadata must be a kvmulti.CommonAttentionMetadata, got {type(metadata).__name__}")
    check_index("metadata.query_start_loc", metadata.query_start_loc, 1, device, (torch.int32,))
    check_index("metadata.seq_lens", metadata.seq_lens, 1, device, (torch.int32,))
    check_index("metadata.block_table", metadata.block_table, 2, device, (torch.int32,))
    if query.shape[0] < metadata.num_actual_tokens:
        raise ValueError(f"query has {query.shape[0]} tokens, metadata.num_actual_tokens is "
                         f"{metadata.num_actual_tokens}")
    if metadata.max_seq_len > metadata.block_table.shape[1] * layout.block_size:
        raise ValueError(f"block_table has {metadata.block_table.shape[1]} columns, too narrow for "
                         f"seq_len {metadata.max_seq_len} with block_size {layout.block_size}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or softcap < 0):
        raise ValueError(f"softcap must be None or a float >= 0 (0 = off), got {softcap!r}")


#: Metadata already checked: every layer of a group reuses its step's tensors, so the check runs
#: once per group per step. Keyed by id, validated by a weak reference and a stamp of each tensor
#: (its version counter, or for inference-mode CPU tensors, which have none, a digest of the
#: bytes), so a new or modified tensor is always checked again.
_checked: dict[tuple, tuple] = {}


def check_metadata_values(metadata: CommonAttentionMetadata, layout: KVCacheLayout,
                          sliding_window: int | None) -> None:
    """No query_len exceeds its seq_len (host copies: always checked), and every block id attention
    will read (inside each request's window) is within the cache (a value check, see above)."""
    tensors = (metadata.block_table, metadata.seq_lens_cpu, metadata.query_start_loc_cpu)
    key = (*map(id, tensors), layout.num_blocks, layout.block_size, sliding_window)
    seen = _checked.get(key)
    stamps = tuple(map(_stamp, tensors))
    if seen is not None and None not in stamps and all(ref() is t and old == new for (ref, old), t, new
                                                       in zip(seen, tensors, stamps)):
        return
    _check_metadata_values(metadata, layout, sliding_window)
    if len(_checked) >= 64:
        _checked.clear()
    _checked[key] = tuple((weakref.ref(t), stamp) for t, stamp in zip(tensors, stamps))


def _stamp(tensor: torch.Tensor):
    """Changes whenever the tensor's contents may have changed; None: cannot tell (never cached)."""
    if not tensor.is_inference():
        return ("version", tensor._version)
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return ("bytes", hash(tensor.numpy().tobytes()))
    return None


def _check_metadata_values(metadata: CommonAttentionMetadata, layout: KVCacheLayout,
                           sliding_window: int | None) -> None:
    # numpy on the host copies: a handful of small-array ops, once per group per step.
    qsl = metadata.query_start_loc_cpu.numpy()
    seq = metadata.seq_lens_cpu.numpy().astype(np.int64)
    query_lens = np.diff(qsl).astype(np.int64)
    too_long = query_lens > seq
    if too_long.any():
        i = int(np.flatnonzero(too_long)[0])
        raise ValueError(f"metadata: request {i} has query_len {int(query_lens[i])} > seq_len {int(seq[i])}")
    table = metadata.block_table
    if not value_checks_enabled(table.device) or metadata.num_reqs == 0:
        return
    blocks = table.cpu().numpy()
    columns = blocks[:, : -(-int(seq.max()) // layout.block_size)]     # the longest request's blocks
    if columns.size == 0 or (int(columns.min()) >= 0 and int(columns.max()) < layout.num_blocks):
        return                                                # all in range: no need to mask per request
    first = seq - query_lens
    first = np.maximum(first - sliding_window + 1, 0) if sliding_window is not None else np.zeros_like(first)
    cols = np.arange(blocks.shape[1])[None, :]
    read = (cols >= (first // layout.block_size)[:, None]) & (cols < (-(-seq // layout.block_size))[:, None])
    bad = read & ((blocks < 0) | (blocks >= layout.num_blocks))
    if bad.any():
        req, col = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"metadata.block_table[{req}, {col}] = {int(blocks[req, col])} is outside the cache's "
                         f"{layout.num_blocks} blocks")
