"""vLLM CPU_ATTN's cache pages to and from the per-token [K | V] rows kvmulti's layouts name.

CPU_ATTN allocates the same ``[num_blocks, H, N, 2 * D]`` tensor as every backend but fills each
(block, head) page its own way: the first ``N * D`` elements hold the keys, the next ``N * D`` the
values, each in an order that depends on its kernel ISA and differs between keys and values
(``vec`` keys: dim-major, the N tokens of a dim adjacent; ``amx``: pairs interleaved for VNNI). Rather than restate those orders, :func:`page_order`
asks vLLM's own writer (``cpu_attn_reshape_and_cache``) where each (token, dim) element lands, and
refuses a writer that does not place every element exactly once.
"""

from __future__ import annotations

import functools

import torch

#: Digits small enough that fp16, bf16 and fp32 hold them exactly.
_BASE = 16


@functools.lru_cache(maxsize=None)
def page_order(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> torch.Tensor:
    """``order`` [2, N * D] (int64): CPU_ATTN's key region (``order[0]``) and value region
    (``order[1]``) of one page hold standard element ``order[kv, i]`` at position ``i``, the
    standard index being ``token * head_size + dim``.
    Raises NotImplementedError for a dtype the probe cannot hold exactly (fp8) or a writer that
    does not fill the page with a permutation."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise NotImplementedError(f"kvmulti's KV connector reads CPU_ATTN pages of fp16/bf16/fp32, not {dtype}")
    from vllm._custom_ops import cpu_attn_reshape_and_cache

    n = block_size * head_size
    index = torch.arange(n)
    found = torch.zeros(2, n, dtype=torch.int64)
    scale, passes = 1, 0
    while scale < n or passes == 0:
        digit = ((index // scale) % _BASE).to(dtype).view(block_size, 1, head_size)
        page = torch.full((1, 1, block_size, 2 * head_size), -1, dtype=dtype)
        keys, values = page.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
        cpu_attn_reshape_and_cache(digit, digit, keys, values, torch.arange(block_size), isa)
        written = page.view(2, n).to(torch.int64)
        if bool((written < 0).any()):
            raise NotImplementedError(f"CPU_ATTN's {isa} page layout leaves elements of a page unwritten")
        found += written * scale
        scale, passes = scale * _BASE, passes + 1
    if not all(torch.equal(torch.sort(region).values, index) for region in found):
        raise NotImplementedError(f"CPU_ATTN's {isa} page layout is not a permutation of the page's elements")
    return found


def to_rows(pages: torch.Tensor, block_ids: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The blocks ``block_ids`` of CPU_ATTN's cache ``pages`` [B, H, N, 2D] as a new contiguous
    ``[len(block_ids), H, N, 2D]`` tensor of per-token [K | V] rows (vLLM's standard view)."""
    num_blocks, heads, block_size, entry = pages.shape
    d = entry // 2
    native = pages.view(num_blocks, heads, 2, block_size * d)[block_ids]
    k, v = torch.empty_like(native[:, :, 0]), torch.empty_like(native[:, :, 1])
    k[..., order[0]] = native[:, :, 0]
    v[..., order[1]] = native[:, :, 1]
    return torch.cat([k.view(-1, heads, block_size, d), v.view(-1, heads, block_size, d)], dim=-1)


def from_rows(rows: torch.Tensor, pages: torch.Tensor, block_ids: torch.Tensor, order: torch.Tensor) -> None:
    """Write ``rows`` [len(block_ids), H, N, 2D] (per-token [K | V]) into CPU_ATTN's ``pages`` at
    ``block_ids``, in CPU_ATTN's page order."""
    num_blocks, heads, block_size, entry = pages.shape
    d = entry // 2
    flat = [part.reshape(-1, heads, block_size * d)[..., kv_order]
            for part, kv_order in ((rows[..., :d], order[0]), (rows[..., d:], order[1]))]
    pages.view(num_blocks, heads, 2, block_size * d).index_copy_(0, block_ids, torch.stack(flat, dim=2))
