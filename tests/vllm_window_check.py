"""Run in vLLM's venv by tests/test_vllm_engine.py: an encoder-only layer with a sliding window on
kvmulti's vLLM layer implementation against vLLM's CPU_ATTN kernel on the same inputs.

kvmulti and its kernel sources come from the checkout this file lives in (tests/vllm_checkout.py).
For each dtype and window W (None: none) the layer's ``forward`` (vLLM's placeholder cache and block table, as vLLM hands encoder-only
layers) runs against ``torch.ops._C.cpu_attention_with_kv_cache`` called as
``vllm/v1/attention/backends/cpu_attn.py`` calls it for encoder-only layers (the step's keys and
values in a scratch cache, ``causal=False``, ``sliding_window=W``). Prints one JSON line:
``{"sources": ..., "errors": {case: max abs error}, "window_effect": {case: max |out_W - out_none|}}``.
"""

from __future__ import annotations

import json
import types

import vllm_checkout  # first: kvmulti and its kernel sources from this checkout

import torch  # noqa: E402
import vllm._custom_ops as vllm_ops  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from kvmulti.backends.cpu import native  # noqa: E402
from kvmulti.integrations.vllm.backend import KvmultiAttentionImpl, KvmultiStepMetadata  # noqa: E402
from kvmulti.metadata import CommonAttentionMetadata  # noqa: E402

HQ, HKV, D, BLOCK = 4, 2, 64, 16
LENS = (37, 9, 50, 1)
WINDOWS = (None, 1, 5, 16, 40, 300)


def cpu_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """CPU_ATTN's encoder-only path: keys and values into a scratch cache of consecutive blocks per
    request, then its kernel with causal=False and the layer's window (-1: none)."""
    dtype, w = q.dtype, -1 if window is None else window
    isa = _get_attn_isa(dtype, BLOCK, D)
    blocks = [(n + BLOCK - 1) // BLOCK for n in LENS]
    cache = torch.zeros(sum(blocks), HKV, BLOCK, 2 * D, dtype=dtype)
    key_cache, value_cache = cache.view(sum(blocks), HKV, 2 * BLOCK, D).chunk(2, dim=2)
    table = torch.zeros(len(LENS), max(blocks), dtype=torch.int32)
    slots, first = [], 0
    for i, n in enumerate(LENS):
        table[i, :blocks[i]] = torch.arange(first, first + blocks[i])
        slots += [first * BLOCK + j for j in range(n)]
        first += blocks[i]
    vllm_ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, torch.tensor(slots), isa)
    qsl = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(LENS, dtype=torch.int32)
    plan = vllm_ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(LENS), num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=qsl, causal=False, sliding_window_size=w, isa=isa, enable_kv_split=False)
    out = torch.zeros_like(q)
    vllm_ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl, seq_lens=seq_lens,
        scale=D ** -0.5, causal=False, alibi_slopes=None, sliding_window=w, block_table=table, softcap=0.0,
        scheduler_metadata=plan, s_aux=None)
    return out


def plugin(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """kvmulti's layer on the step vLLM gives an encoder-only layer (no cache, a placeholder table)."""
    impl = KvmultiAttentionImpl(HQ, D, D ** -0.5, HKV, sliding_window=window, attn_type=AttentionType.ENCODER_ONLY)
    placeholder_table = torch.zeros(len(LENS), (max(LENS) + BLOCK - 1) // BLOCK, dtype=torch.int32)
    common = CommonAttentionMetadata.from_lens(list(LENS), list(LENS), placeholder_table, BLOCK, causal=False)
    out = torch.zeros_like(q)
    impl.forward(types.SimpleNamespace(), q, k, v, torch.empty(0, dtype=q.dtype), KvmultiStepMetadata(common), out)
    return out


def main() -> None:
    sources = dict(vllm_checkout.sources(), kernel=native.origin(), isa=_get_attn_isa(torch.float32, BLOCK, D))
    errors, window_effect = {}, {}
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        tokens = sum(LENS)
        q = (torch.randn(tokens, HQ, D, generator=gen) * 2).to(dtype)
        k = (torch.randn(tokens, HKV, D, generator=gen) * 2).to(dtype)
        v = torch.randn(tokens, HKV, D, generator=gen).to(dtype)
        unwindowed = cpu_attn(q, k, v, None).float()
        for window in WINDOWS:
            case = f"{str(dtype).split('.')[-1]}/w={window}"
            want = cpu_attn(q, k, v, window).float()
            errors[case] = (plugin(q, k, v, window).float() - want).abs().max().item()
            window_effect[case] = (want - unwindowed).abs().max().item()
    print(json.dumps({"sources": sources, "errors": errors, "window_effect": window_effect}))


if __name__ == "__main__":
    main()
