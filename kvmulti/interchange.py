"""The KV interchange format: a block range of one or more layers' caches as bytes, and back.

:func:`export_blocks` gathers the tokens ``[start, num_tokens)`` of a request from its blocks into
a self-describing little-endian buffer (docs/interchange.md, byte by byte); :func:`import_blocks`
writes them into caches of any layout, order, block size, dtype and device. The source's layout
and block size never reach the payload (token-major rows), so those conversions are exact; dtype
conversions follow :func:`kvmulti.fp8.convert`.

A buffer that is truncated, corrupt (CRC-32), of another format version, or that the destination
cannot hold raises :class:`InterchangeError` (a ValueError) before any destination byte changes:
every layer is parsed, checked and converted first, then written.
"""

from __future__ import annotations

import struct
import sys
import zlib
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import torch

from . import fp8
from .layout import KVCacheLayout

MAGIC = b"KVMXCHG\0"
VERSION = 1
#: dtype codes of the format (docs/interchange.md)
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3,
                                       torch.float8_e4m3fn: 4, torch.float8_e5m2: 5,
                                       torch.float8_e4m3fnuz: 6, torch.float8_e5m2fnuz: 7}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_ORDER_CODES = {"NHD": 0, "HND": 1}
_ORDERS = {code: order for order, code in _ORDER_CODES.items()}

_FILE = struct.Struct("<8sHHIQ")      # magic, version, flags, num_groups, total_length
_GROUP = struct.Struct("<8I2Q")       # dtype, heads, head_size, head_size_v, block_size, order, layers,
                                      # reserved; start_token, num_tokens
_NAME = struct.Struct("<H")
_CRC = struct.Struct("<I")

CacheArg = Union[torch.Tensor, Mapping[str, torch.Tensor]]
LayoutArg = Union[KVCacheLayout, Mapping[str, KVCacheLayout]]
BlockIds = Union[Sequence[int], torch.Tensor]
BlockIdsArg = Union[BlockIds, Mapping[str, BlockIds]]
ScaleValue = Union[float, torch.Tensor, None]
ScaleArg = Union[ScaleValue, Mapping[str, ScaleValue]]


class InterchangeError(ValueError):
    """A buffer this kvmulti cannot read, or a destination that cannot hold it; nothing was written."""


@dataclass(frozen=True)
class ImportedBlocks:
    """What :func:`import_blocks` wrote. ``scales[layer]``: the fp32 ``[num_kv_heads]`` (k_scale,
    v_scale) on the destination's device that its cache now reads with, or None (not fp8);
    ``start_tokens[layer]``: the first token written (0 unless the source had freed leading
    blocks, e.g. a sliding window)."""

    num_tokens: int
    scales: dict[str, tuple[torch.Tensor, torch.Tensor] | None]
    start_tokens: dict[str, int]


@dataclass
class _Layer:
    name: str
    cache: torch.Tensor | None
    layout: KVCacheLayout
    block_ids: list[int]
    rows: torch.Tensor | None = None                      # [T, H, E] of layout.dtype (fp8: as uint8)
    scales: tuple[torch.Tensor, torch.Tensor] | None = None
    start: int = 0


def export_blocks(cache: CacheArg, layout: LayoutArg, block_ids: BlockIdsArg, num_tokens: int, *,
                  k_scale: ScaleArg = None, v_scale: ScaleArg = None) -> bytes:
    """Tokens ``0 .. num_tokens - 1`` of one request, held in ``block_ids`` (its block-table row:
    token t in block ``block_ids[t // block_size]`` at offset ``t % block_size``), as one buffer.

    ``cache``: one cache tensor, or ``{layer name: cache}`` (e.g. every layer of every KV-cache
    group); ``layout``, ``block_ids``, ``k_scale`` and ``v_scale``: one for every layer, or
    ``{layer name: ...}``. Scales apply to fp8 caches only (float, fp32 ``[]`` / ``[num_kv_heads]``
    or None = 1.0, as for :func:`kvmulti.write_kv`) and travel in the buffer. Leading ``-1``
    entries of ``block_ids`` (blocks a sliding window gave back) are skipped: the buffer then holds
    tokens from the first held block on. Caches may live on any device; the payload is gathered
    to host memory. Raises :class:`InterchangeError` for inputs that do not describe a cache range.
    """
    num_tokens = _count(num_tokens)
    layers = _layers(cache, layout, block_ids, "export")
    for layer in layers:
        lay = layer.layout
        _validate(layer)
        ids = layer.block_ids
        needed = -(-num_tokens // lay.block_size)
        if needed > len(ids):
            raise InterchangeError(f"layer {layer.name!r}: {num_tokens} tokens need {needed} blocks of "
                                   f"{lay.block_size}, block_ids has {len(ids)}")
        held = next((j for j, b in enumerate(ids[:needed]) if b != -1), needed)
        _check_ids(layer.name, ids[held:needed], lay.num_blocks)
        layer.start = min(held * lay.block_size, num_tokens)
        if fp8.is_fp8(lay.dtype):
            ks = _scale(k_scale, layer, "k_scale", layer.cache.device)
            vs = ks if lay.is_latent else _scale(v_scale, layer, "v_scale", layer.cache.device)
            layer.scales = (ks.cpu(), vs.cpu())
        else:
            for name, arg in (("k_scale", k_scale), ("v_scale", v_scale)):
                _scale(arg, layer, name, layer.cache.device)        # raises: scales for a non-fp8 cache
        layer.rows = _gather(layer, num_tokens)
    groups: dict[tuple, list[_Layer]] = {}
    for layer in layers:
        groups.setdefault((layer.layout, tuple(layer.block_ids), layer.start), []).append(layer)
    parts = [b""]
    for (lay, _, start), members in groups.items():
        parts.append(_GROUP.pack(DTYPE_CODES[lay.dtype], lay.num_kv_heads, lay.head_size, lay.value_size,
                                 lay.block_size, _ORDER_CODES[lay.order], len(members), 0, start, num_tokens))
        for layer in members:
            name = layer.name.encode("utf-8")
            parts += [_NAME.pack(len(name)), name]
            if layer.scales is not None:
                parts += [_little_endian(s.contiguous().view(torch.uint8), 4).numpy().tobytes()
                          for s in layer.scales]
            parts.append(_little_endian(layer.rows.reshape(-1), lay.dtype.itemsize).numpy().tobytes())
    total = _FILE.size + sum(map(len, parts)) + _CRC.size
    parts[0] = _FILE.pack(MAGIC, VERSION, 0, len(groups), total)
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def import_blocks(data: bytes | bytearray | memoryview, cache: CacheArg, layout: LayoutArg,
                  block_ids: BlockIdsArg, *, k_scale: ScaleArg = None, v_scale: ScaleArg = None) -> ImportedBlocks:
    """Write a buffer from :func:`export_blocks` into ``cache`` (one tensor, or ``{layer name:
    cache}`` naming exactly the buffer's layers), whose tokens are held in ``block_ids`` (the
    destination request's block-table row at the DESTINATION's block size: one for every layer, or
    ``{layer name: ...}``); ``layout`` likewise.

    Any order, block size and dtype of the destination; its head counts and head sizes must equal
    the source's. Values convert by :func:`kvmulti.fp8.convert`. An fp8 destination reads with
    ``k_scale`` / ``v_scale`` (as for :func:`kvmulti.write_kv`); None takes the buffer's scales when
    the source was fp8 (so an fp8 cache of the same format arrives bit for bit), else 1.0. The
    destination's blocks are written for the buffer's tokens only; each block id covering them must
    be a distinct valid block. Raises :class:`InterchangeError` (nothing written) for a truncated,
    corrupt or unknown buffer and for a destination that cannot hold it.
    """
    num_tokens, sources = _parse(data)
    layers = _layers(cache, layout, block_ids, "import")
    names = {layer.name for layer in layers}
    if names != set(sources):
        raise InterchangeError(f"the buffer holds layers {sorted(sources)}, the destination names "
                               f"{sorted(names)}: every layer must be given exactly once")
    for layer in layers:
        _validate(layer)
        header, rows, src_scales = sources[layer.name]
        lay = layer.layout
        src = (header["num_kv_heads"], header["head_size"], header["head_size_v"])
        if src != (lay.num_kv_heads, lay.head_size, lay.value_size):
            raise InterchangeError(f"layer {layer.name!r}: the buffer holds (num_kv_heads, head_size, head_size_v) "
                                   f"{src}, the destination layout {(lay.num_kv_heads, lay.head_size, lay.value_size)}")
        start = layer.start = header["start_token"]
        needed = -(-num_tokens // lay.block_size)
        if needed > len(layer.block_ids):
            raise InterchangeError(f"layer {layer.name!r}: {num_tokens} tokens need {needed} destination blocks "
                                   f"of {lay.block_size}, block_ids has {len(layer.block_ids)}")
        covering = layer.block_ids[start // lay.block_size:needed] if start < num_tokens else []
        _check_ids(layer.name, covering, lay.num_blocks)
        if len(set(covering)) != len(covering):
            raise InterchangeError(f"layer {layer.name!r}: block_ids repeats a block among {covering}")
        device = layer.cache.device
        scales = None
        if fp8.is_fp8(lay.dtype):
            carried = src_scales if src_scales is not None else (None, None)
            ks = _scale(k_scale, layer, "k_scale", device, carried[0])
            vs = ks if lay.is_latent else _scale(v_scale, layer, "v_scale", device, carried[1])
            scales = (ks, vs)
        else:
            for name, arg in (("k_scale", k_scale), ("v_scale", v_scale)):
                _scale(arg, layer, name, device)
        layer.scales = scales
        src_k, src_v = (None, None) if src_scales is None else (s.to(device) for s in src_scales)
        rows = rows.to(device)
        parts = [fp8.convert(rows[..., :lay.head_size], src_k, lay.dtype, scales and scales[0])]
        if not lay.is_latent:
            parts.append(fp8.convert(rows[..., lay.head_size:], src_v, lay.dtype, scales and scales[1]))
        layer.rows = torch.cat([_raw(p) for p in parts], dim=-1)
    for layer in layers:                                  # everything checked and converted: now write
        positions = torch.arange(layer.start, num_tokens, device=layer.cache.device)
        blocks, offsets = _slots(layer, positions)
        _raw(layer.cache)[blocks, offsets] = layer.rows
    return ImportedBlocks(num_tokens, {layer.name: layer.scales for layer in layers},
                          {layer.name: layer.start for layer in layers})


# -- parsing ---------------------------------------------------------------------------------

def _parse(data) -> tuple[int, dict[str, tuple[dict, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]]]:
    """num_tokens and ``{layer: (group header, rows [T, H, E] on the host, (k, v) scales or None)}``."""
    try:
        view = memoryview(data).cast("B")
    except TypeError as e:
        raise InterchangeError(f"a KV transfer is a bytes-like buffer, got {type(data).__name__}") from e
    if len(view) < _FILE.size + _CRC.size:
        raise InterchangeError(f"truncated KV transfer: {len(view)} bytes, shorter than the "
                               f"{_FILE.size + _CRC.size}-byte header and checksum")
    magic, version, flags, num_groups, total = _FILE.unpack_from(view, 0)
    if magic != MAGIC:
        raise InterchangeError(f"not a kvmulti KV transfer: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise InterchangeError(f"KV transfer format version {version}; this kvmulti reads version {VERSION}")
    if flags != 0:
        raise InterchangeError(f"KV transfer flags {flags:#x}: version {VERSION} defines none")
    if total != len(view):
        what = "truncated" if len(view) < total else "over-long"
        raise InterchangeError(f"{what} KV transfer: the header gives {total} bytes, the buffer has {len(view)}")
    (crc,) = _CRC.unpack_from(view, total - _CRC.size)
    if zlib.crc32(view[:total - _CRC.size]) != crc:
        raise InterchangeError("KV transfer checksum mismatch (CRC-32): the buffer is corrupt")
    reader = _Reader(view, _FILE.size, total - _CRC.size)
    layers: dict = {}
    num_tokens = None
    for _ in range(num_groups):
        (dtype_code, heads, head_size, head_size_v, block_size, order, num_layers, _reserved, start,
         end) = reader.unpack(_GROUP)
        if dtype_code not in _DTYPES or order not in _ORDERS or min(heads, head_size, block_size) < 1 \
                or not 0 <= start <= end or (num_tokens is not None and end != num_tokens):
            raise InterchangeError(f"KV transfer group header is invalid (dtype code {dtype_code}, order {order}, "
                                   f"heads {heads}, head_size {head_size}, block_size {block_size}, "
                                   f"tokens {start}..{end})")
        num_tokens = end
        dtype = _DTYPES[dtype_code]
        header = dict(dtype=dtype, num_kv_heads=heads, head_size=head_size, head_size_v=head_size_v,
                      block_size=block_size, order=_ORDERS[order], start_token=start)
        for _ in range(num_layers):
            (length,) = reader.unpack(_NAME)
            name = reader.text(length)
            if name in layers:
                raise InterchangeError(f"KV transfer names layer {name!r} twice")
            scales = None
            if fp8.is_fp8(dtype):
                scales = tuple(reader.take(heads * 4, 4).view(torch.float32) for _ in range(2))
            rows = reader.take((end - start) * heads * (head_size + head_size_v) * dtype.itemsize,
                               dtype.itemsize)
            rows = rows.view(torch.uint8 if fp8.is_fp8(dtype) else dtype)
            layers[name] = (header, rows.view(end - start, heads, head_size + head_size_v).view(dtype), scales)
    if reader.offset != reader.end:
        raise InterchangeError(f"KV transfer has {reader.end - reader.offset} bytes after its last layer")
    return num_tokens or 0, layers


class _Reader:
    """Sequential reads of a checked buffer, each bounds-checked."""

    def __init__(self, view: memoryview, offset: int, end: int):
        self.view, self.offset, self.end = view, offset, end

    def _advance(self, n: int) -> int:
        if n > self.end - self.offset:
            raise InterchangeError(f"KV transfer is inconsistent: {n} bytes needed at offset {self.offset}, "
                                   f"{self.end - self.offset} left")
        self.offset += n
        return self.offset - n

    def unpack(self, fmt: struct.Struct) -> tuple:
        return fmt.unpack_from(self.view, self._advance(fmt.size))

    def text(self, n: int) -> str:
        at = self._advance(n)
        try:
            return bytes(self.view[at:at + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InterchangeError(f"KV transfer has a layer name that is not UTF-8 at offset {at}") from e

    def take(self, n: int, itemsize: int) -> torch.Tensor:
        """The next ``n`` bytes as a uint8 host tensor of their own, in host byte order."""
        at = self._advance(n)
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        return _little_endian(torch.frombuffer(bytearray(self.view[at:at + n]), dtype=torch.uint8), itemsize)


# -- helpers ---------------------------------------------------------------------------------

def _layers(cache: CacheArg, layout: LayoutArg, block_ids: BlockIdsArg, what: str) -> list[_Layer]:
    if isinstance(cache, torch.Tensor):
        cache = {"": cache}
    if not isinstance(cache, Mapping) or not cache:
        raise InterchangeError(f"{what}_blocks: cache must be a tensor or a non-empty {{layer name: tensor}}")
    layers = []
    for name, tensor in cache.items():
        if not isinstance(name, str) or len(name.encode("utf-8")) > 0xFFFF:
            raise InterchangeError(f"layer names are strings of at most 65535 UTF-8 bytes, got {name!r}")
        lay = _for_layer(layout, name, "layout")
        if not isinstance(lay, KVCacheLayout):
            raise InterchangeError(f"layer {name!r}: layout must be a KVCacheLayout, got {type(lay).__name__}")
        ids = _for_layer(block_ids, name, "block_ids")
        try:
            ids = torch.as_tensor(ids, dtype=torch.int64).cpu()
        except (TypeError, ValueError, RuntimeError) as e:
            raise InterchangeError(f"layer {name!r}: block_ids must be a 1-D sequence of ints") from e
        if ids.dim() != 1:
            raise InterchangeError(f"layer {name!r}: block_ids must be 1-D, got shape {tuple(ids.shape)}")
        layers.append(_Layer(name, tensor, lay, ids.tolist()))
    return layers


def _for_layer(arg, name: str, what: str):
    if isinstance(arg, Mapping):
        if name not in arg:
            raise InterchangeError(f"{what} has no entry for layer {name!r}")
        return arg[name]
    return arg


def _validate(layer: _Layer) -> None:
    lay = layer.layout
    if lay.dtype not in DTYPE_CODES:
        raise InterchangeError(f"layer {layer.name!r}: dtype {lay.dtype} has no code in the interchange format "
                               f"(supports {', '.join(map(str, DTYPE_CODES))})")
    try:
        lay.validate(layer.cache, f"cache of layer {layer.name!r}")
    except TypeError as e:
        raise InterchangeError(str(e)) from e


def _check_ids(name: str, ids: list[int], num_blocks: int) -> None:
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise InterchangeError(f"layer {name!r}: block ids {bad[:8]} are not blocks of a {num_blocks}-block cache")


def _scale(arg: ScaleArg, layer: _Layer, name: str, device: torch.device,
           carried: torch.Tensor | None = None) -> torch.Tensor | None:
    value = _for_layer(arg, layer.name, name) if isinstance(arg, Mapping) else arg
    if value is None and carried is not None:
        value = carried.to(device)
    try:
        return fp8.scale_tensor(value, name, layer.layout.dtype, layer.layout.num_kv_heads, device)
    except TypeError as e:
        raise InterchangeError(f"layer {layer.name!r}: {e}") from e
    except ValueError as e:
        raise InterchangeError(f"layer {layer.name!r}: {e}") from e


def _slots(layer: _Layer, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(layer.block_ids, dtype=torch.int64, device=positions.device)
    bs = layer.layout.block_size
    return ids[positions // bs], positions % bs


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its uint8 codes (indexing has no fp8 kernels everywhere), others as is."""
    return t.view(torch.uint8) if fp8.is_fp8(t.dtype) else t


def _gather(layer: _Layer, num_tokens: int) -> torch.Tensor:
    """Rows [T, H, E] of tokens start .. num_tokens - 1 as contiguous host bytes (uint8)."""
    positions = torch.arange(layer.start, num_tokens, device=layer.cache.device)
    blocks, offsets = _slots(layer, positions)
    rows = _raw(layer.cache)[blocks, offsets].contiguous().cpu()
    return rows.view(torch.uint8)


def _little_endian(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Host-order bytes of ``itemsize``-byte elements in little-endian order (and back)."""
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    return raw.reshape(-1, itemsize).flip(-1).reshape(-1)


def _count(num_tokens: int) -> int:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InterchangeError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if num_tokens > 2**63 - 1:
        raise InterchangeError(f"num_tokens {num_tokens} is out of range")
    return num_tokens
