"""The canonical paged KV-cache layout.

Every KV cache of every backend has the LOGICAL shape
``(num_blocks, block_size, num_kv_heads, head_size + head_size_v)``: K in
``[..., :head_size]``, V in ``[..., head_size:]``. The PHYSICAL order of the two
middle dimensions is a property of the layout (``order``), never guessed from a
tensor's shape:

- ``NHD``: memory order (block, token, head, content), the logical order.
- ``HND``: memory order (block, head, token, content); the tensor handed out is a
  permuted view with the logical shape.

A layout may also describe one layer of a CROSS-LAYER allocation (``cross_layer_order``, vLLM's
names: the physical order of all layers' caches in one tensor, outermost first, over B = block,
L = layer, H = KV head, N = token in block, C = content): ``BLHNC``, ``BLNHC`` and ``BHLNC`` keep
a block of every layer together (KV transfer, offloading); ``LHBNC`` keeps each layer together but
puts the head outside the block. A layer's cache is then a view whose block and head strides are
not the per-layer ones (they span other layers or blocks); it has the same logical shape and is
read through the same named strides.

Kernels address the cache through :class:`LayoutStrides` (named, in elements),
so no backend can confuse the token and head strides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Literal, NamedTuple

import torch

from . import host_memory

Order = Literal["NHD", "HND"]
ORDERS: tuple[str, ...] = ("NHD", "HND")

CrossLayerOrder = Literal["BLHNC", "BLNHC", "LHBNC", "BHLNC"]
CROSS_LAYER_ORDERS: tuple[str, ...] = ("BLHNC", "BLNHC", "LHBNC", "BHLNC")
#: Physical order (outermost first) of a per-layer cache of each order.
_PER_LAYER_PHYSICAL = {"NHD": "BNHC", "HND": "BHNC"}


def token_order(physical: str) -> Order:
    """The per-layer order of a physical order: ``NHD`` where a token's heads are adjacent."""
    return "NHD" if physical.index("N") < physical.index("H") else "HND"

#: ``allocator(numel, dtype, device) -> 1-D tensor`` of ``numel`` elements, used to place a
#: cache in special memory (e.g. SYCL USM) while keeping it a torch tensor.
Allocator = Callable[[int, torch.dtype, torch.device], torch.Tensor]


class LayoutStrides(NamedTuple):
    """Strides of a cache tensor in elements, by name. ``dim`` is the content stride (always 1)."""

    block: int
    token: int
    head: int
    dim: int


#: Largest block id / slot position the kernels address (int32).
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class KVCacheLayout:
    """Describes one paged KV cache: its sizes, dtype and physical order.

    ``head_size_v=None`` means ``head_size_v == head_size``; ``head_size_v=0`` is a
    latent (MLA-style) cache that holds keys only.

    ``cross_layer_order`` (one of :data:`CROSS_LAYER_ORDERS`) makes this the layout of each layer
    of a cross-layer allocation of ``num_layers`` layers: :meth:`allocate` returns the whole
    allocation, logical shape ``(num_layers, *shape)``, :meth:`layer` one layer's cache (what the
    ops take). ``order`` must then name the token/head order inside it (``NHD`` for ``BLNHC``,
    ``HND`` for the others). Without it, ``num_layers`` must be 1 (each layer allocates its own).
    """

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int | None = None
    dtype: torch.dtype = torch.float16
    order: Order = "NHD"
    cross_layer_order: CrossLayerOrder | None = None
    num_layers: int = 1
    _head_size_v: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCacheLayout.{name} must be a positive int, got {value!r}")
        hv = self.head_size if self.head_size_v is None else self.head_size_v
        if not isinstance(hv, int) or isinstance(hv, bool) or hv < 0:
            raise ValueError(f"KVCacheLayout.head_size_v must be an int >= 0 or None, got {self.head_size_v!r}")
        if self.order not in ORDERS:
            raise ValueError(f"KVCacheLayout.order must be one of {ORDERS}, got {self.order!r}")
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers < 1:
            raise ValueError(f"KVCacheLayout.num_layers must be a positive int, got {self.num_layers!r}")
        if self.cross_layer_order is None:
            if self.num_layers != 1:
                raise ValueError(f"KVCacheLayout.num_layers={self.num_layers} needs a cross_layer_order "
                                 f"(one of {CROSS_LAYER_ORDERS}); a per-layer layout has num_layers=1")
        elif self.cross_layer_order not in CROSS_LAYER_ORDERS:
            raise ValueError(f"KVCacheLayout.cross_layer_order must be one of {CROSS_LAYER_ORDERS} or None, "
                             f"got {self.cross_layer_order!r}")
        elif token_order(self.cross_layer_order) != self.order:
            raise ValueError(f"KVCacheLayout: cross_layer_order {self.cross_layer_order} keeps "
                             f"{'a token' if token_order(self.cross_layer_order) == 'NHD' else 'a head'}'s rows "
                             f"together: order must be {token_order(self.cross_layer_order)!r}, got {self.order!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"KVCacheLayout.dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.num_blocks > INT32_MAX:
            raise ValueError(f"KVCacheLayout.num_blocks {self.num_blocks} exceeds {INT32_MAX}: block ids are int32")
        for name in ("block_size", "num_kv_heads", "head_size"):
            if getattr(self, name) > INT32_MAX:
                raise ValueError(f"KVCacheLayout.{name} {getattr(self, name)} exceeds {INT32_MAX}")
        object.__setattr__(self, "_head_size_v", hv)
        nbytes = self.num_layers * self.num_blocks * self.page_size_bytes
        if self.num_blocks * self.block_size > INT32_MAX or nbytes >= 2**62:
            raise ValueError(f"KVCacheLayout: {self.num_blocks} blocks x {self.block_size} slots ({nbytes} bytes) "
                             f"exceed what int32 block/slot positions and a single tensor can address")

    # -- sizes -------------------------------------------------------------------------------
    @property
    def value_size(self) -> int:
        """Head size of V (0 for a latent cache)."""
        return self._head_size_v

    @property
    def entry_size(self) -> int:
        """Content elements per (token, head): head_size + head_size_v."""
        return self.head_size + self._head_size_v

    @property
    def is_latent(self) -> bool:
        return self._head_size_v == 0

    @property
    def default_scale(self) -> float:
        """The attention scale when a call passes none: head_size ** -0.5."""
        return float(self.head_size ** -0.5)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical shape (num_blocks, block_size, num_kv_heads, entry_size)."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.entry_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (all its tokens, heads, K and V)."""
        return self.block_size * self.num_kv_heads * self.entry_size * self.dtype.itemsize

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def physical_order(self) -> str:
        """Memory order of the allocation, outermost first: ``BNHC`` (NHD), ``BHNC`` (HND) or the
        cross-layer order."""
        return self.cross_layer_order or _PER_LAYER_PHYSICAL[self.order]

    @cached_property
    def _sizes(self) -> dict[str, int]:
        """Size of each dimension letter of a (cross-layer) allocation."""
        return {"B": self.num_blocks, "L": self.num_layers, "H": self.num_kv_heads, "N": self.block_size,
                "C": self.entry_size}

    @cached_property
    def _physical_strides(self) -> dict[str, int]:
        """Element stride of each dimension letter of :attr:`physical_order` (L: 0 if absent)."""
        strides, step = {"L": 0}, 1
        for letter in reversed(self.physical_order):
            strides[letter] = step
            step *= self._sizes[letter]
        return strides

    def expected_strides(self) -> LayoutStrides:
        """Strides (in elements) that a (layer's) cache of this layout must have."""
        return self._expected_strides

    @cached_property
    def _expected_strides(self) -> LayoutStrides:
        st = self._physical_strides
        return LayoutStrides(block=st["B"], token=st["N"], head=st["H"], dim=1)

    @property
    def layer_stride(self) -> int:
        """Elements from one layer's cache to the next in a cross-layer allocation (0: per-layer)."""
        return self._physical_strides["L"]

    # -- tensors -----------------------------------------------------------------------------
    def allocate(self, device: torch.device | str = "cpu", allocator: Allocator | None = None,
                 zero: bool = True, huge_pages: bool | None = None) -> torch.Tensor:
        """Allocate a cache: a tensor of logical shape :attr:`shape` with this layout's strides; for a
        cross-layer layout, all layers: logical shape ``(num_layers, *shape)``, layer ``i`` being
        :meth:`layer` ``(cache, i)``.

        ``huge_pages`` (CPU, no ``allocator``): back the cache with transparent huge pages (see
        :mod:`kvmulti.host_memory`). None = whenever the cache spans at least one 2 MiB page and the
        kernel allows THP; True = the same but raise where it cannot; False = an ordinary tensor.
        """
        device = torch.device(device)
        numel = math.prod(self._sizes.values())
        if huge_pages and (allocator is not None or device.type != "cpu"):
            raise ValueError("huge_pages=True applies to CPU caches without a custom allocator")
        if allocator is not None:
            flat = allocator(numel, self.dtype, device)
            if flat.numel() != numel or flat.dtype != self.dtype or not flat.is_contiguous():
                raise ValueError(f"allocator returned {tuple(flat.shape)} {flat.dtype}; expected a contiguous "
                                 f"1-D tensor of {numel} elements of {self.dtype}")
        else:
            want_huge = huge_pages is not False and device.type == "cpu"
            flat = host_memory.huge_page_empty(numel, self.dtype) if want_huge else None
            if flat is None and huge_pages:
                raise RuntimeError(f"huge_pages=True: not available for this cache ({numel * self.dtype.itemsize} "
                                   f"bytes; transparent huge pages: {host_memory.transparent_huge_pages()})")
            if flat is None:
                try:
                    flat = torch.empty(numel, dtype=self.dtype, device=device)
                except (RuntimeError, MemoryError) as e:
                    raise MemoryError(f"cannot allocate the KV cache: {numel * self.dtype.itemsize} bytes "
                                      f"({self.num_blocks} blocks of {self.page_size_bytes} bytes) on {device}: "
                                      f"{str(e).splitlines()[0]}; lower num_blocks") from e
        if zero:
            flat.zero_()                     # also faults a huge-page mapping in now, not in the first step
        physical = flat.view(*(self._sizes[letter] for letter in self.physical_order))
        logical = "LBNHC" if self.cross_layer_order else "BNHC"
        return physical.permute(*(self.physical_order.index(letter) for letter in logical))

    def layer(self, allocation: torch.Tensor, index: int) -> torch.Tensor:
        """Layer ``index``'s cache in a cross-layer ``allocation`` (from :meth:`allocate`): a
        zero-copy view that :meth:`validate` accepts."""
        if self.cross_layer_order is None:
            raise ValueError("layer(): this layout is per-layer (no cross_layer_order); its allocation is the cache")
        if not isinstance(allocation, torch.Tensor) or tuple(allocation.shape) != (self.num_layers, *self.shape):
            got = tuple(allocation.shape) if isinstance(allocation, torch.Tensor) else type(allocation).__name__
            raise ValueError(f"layer(): expected a cross-layer allocation of shape {(self.num_layers, *self.shape)}, "
                             f"got {got}")
        if not -self.num_layers <= index < self.num_layers:
            raise IndexError(f"layer {index} out of range for {self.num_layers} layers")
        cache = allocation[index]
        self.validate(cache, f"layer {index} of the allocation")
        return cache

    @classmethod
    def of_view(cls, cache: torch.Tensor, head_size: int) -> "KVCacheLayout":
        """The layout of an existing cache tensor of logical shape ``(num_blocks, block_size,
        num_kv_heads, head_size + head_size_v)``, named from its strides: a per-layer ``NHD`` /
        ``HND`` cache, or one layer of a cross-layer allocation (``num_layers`` as far as the strides
        tell it; 1 for ``LHBNC``, whose layer views do not show it). Raises ValueError for strides no
        layout describes."""
        num_blocks, block_size, num_kv_heads, entry = cache.shape
        common = dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                      head_size_v=entry - head_size, dtype=cache.dtype)
        strides = LayoutStrides(*cache.stride())
        row = block_size * num_kv_heads * entry
        layer_counts = {"BLHNC": strides.block // row, "BLNHC": strides.block // row, "LHBNC": 1,
                        "BHLNC": strides.head // (block_size * entry)}
        candidates = [cls(**common, order=order) for order in ORDERS]
        candidates += [cls(**common, order=token_order(name), cross_layer_order=name, num_layers=max(1, layers))
                       for name, layers in layer_counts.items()]
        for layout in candidates:
            if _strides_equivalent(strides, layout.expected_strides(), layout.shape):
                return layout
        raise ValueError(f"a cache view with shape {tuple(cache.shape)} and strides {tuple(strides)} matches no "
                         f"kvmulti layout (per-layer {ORDERS} or cross-layer {CROSS_LAYER_ORDERS})")

    def validate(self, cache: torch.Tensor, name: str = "kv_cache") -> None:
        """Raise ValueError/TypeError naming ``name`` if ``cache`` is not a cache of this layout.

        Checks type, dtype, logical shape and strides: a cache of the other order, or one made
        for another layout, is rejected, never reinterpreted.
        """
        if isinstance(cache, torch.Tensor) and (cache.dtype, cache.shape, cache.stride()) == self._exact_signature:
            return                                            # the common case, checked in one comparison
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
        if cache.dtype != self.dtype:
            raise TypeError(f"{name} has dtype {cache.dtype}, layout expects {self.dtype}")
        if tuple(cache.shape) != self.shape:
            raise ValueError(f"{name} has shape {tuple(cache.shape)}, layout expects {self.shape} "
                             "(num_blocks, block_size, num_kv_heads, head_size + head_size_v)")
        expected = self.expected_strides()
        actual = LayoutStrides(*cache.stride())
        if not _strides_equivalent(actual, expected, self.shape):
            where = (f"cross-layer order {self.cross_layer_order} of {self.num_layers} layers"
                     if self.cross_layer_order else f"order {self.order}")
            raise ValueError(f"{name} has strides {tuple(actual)}, layout {where} expects "
                             f"{tuple(expected)} (block, token, head, dim); a cache of another order or "
                             "layout is never reinterpreted")

    def __hash__(self) -> int:            # layouts key per-step caches: hash the fields once
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.num_blocks, self.block_size, self.num_kv_heads, self.head_size, self._head_size_v,
                     self.dtype, self.order, self.cross_layer_order, self.num_layers))

    @cached_property
    def _exact_signature(self) -> tuple:
        """(dtype, shape, strides) of a cache allocated for this layout."""
        return (self.dtype, torch.Size(self.shape), tuple(self.expected_strides()))

    def strides(self, cache: torch.Tensor) -> LayoutStrides:
        """Named strides of ``cache`` (validated against this layout), in elements."""
        self.validate(cache)
        return self.expected_strides()

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """Zero-copy K view: (num_blocks, block_size, num_kv_heads, head_size)."""
        self.validate(cache)
        return cache[..., : self.head_size]

    def values(self, cache: torch.Tensor) -> torch.Tensor:
        """Zero-copy V view: (num_blocks, block_size, num_kv_heads, head_size_v)."""
        if self.is_latent:
            raise ValueError("this layout is a latent (MLA-style) cache with head_size_v=0: it holds no values")
        self.validate(cache)
        return cache[..., self.head_size:]


def _strides_equivalent(actual: LayoutStrides, expected: LayoutStrides, shape: tuple[int, ...]) -> bool:
    """Strides match where they matter: a dimension of size 1 may carry any stride."""
    return all(size == 1 or a == e for a, e, size in zip(actual, expected, shape))
