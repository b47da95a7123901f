"""Host (CPU) memory for KV caches: anonymous mappings advised for transparent huge pages.

A paged cache is read a block at a time in an order set by the block tables, so with 4 KiB pages
nearly every block of a small block size (16 tokens x one KV head of bf16 head 64 = 4 KiB) needs its
own TLB entry and page walk. Backing the cache with 2 MiB pages removes most of them; the contents,
shape and strides are unchanged. Linux only (elsewhere, or with THP off, callers get None and use
an ordinary allocation).
"""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 1 << 21
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages() -> str:
    """The kernel's THP mode: ``always``, ``madvise`` or ``never``; ``unavailable`` off Linux or
    where the setting cannot be read."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "unavailable"
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return "unavailable"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unavailable"


def huge_pages_usable() -> bool:
    """Whether an anonymous mapping advised MADV_HUGEPAGE gets huge pages here (THP always/madvise)."""
    return transparent_huge_pages() in ("always", "madvise")


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A 1-D CPU tensor of ``numel`` zeros of ``dtype`` whose memory starts on a 2 MiB boundary and
    is advised MADV_HUGEPAGE; None when THP is unusable here or the tensor is under one huge page.

    The memory is a private anonymous mapping owned by the tensor's storage: it is unmapped when
    the last tensor viewing it is freed. Pages are zero until first written.
    """
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not huge_pages_usable():
        return None
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise MemoryError(f"cannot map {nbytes} bytes for the KV cache: {e.strerror or e}") from e
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except OSError:                      # e.g. a kernel built without THP behind a readable setting
        return None
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype)
