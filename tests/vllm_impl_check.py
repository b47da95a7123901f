"""Run in vLLM's venv by tests/test_vllm_engine.py: kvmulti's vLLM layer implementation against
kvmulti's oracle on caches shaped as vLLM allocates them (uint8 bytes for fp8), every vLLM layout.

For each vLLM layout and cache dtype ("auto" = bf16, "fp8", "fp8_e5m2"): allocate the layers'
caches as vLLM views them ([num_blocks, H, N, C]; cross-layer layouts share one allocation), call
``forward`` (which writes the step's keys and values, then attends) on layer 1 with per-tensor scales on the layer, and compare
the cache bytes (exactly) and the output (bf16 tolerance) with ``kvmulti.reference``. Prints one
JSON line: ``{"checked": [...], "failures": [...]}``.
"""

from __future__ import annotations

import json
import types

import torch

from kvmulti import reference
from kvmulti.integrations.vllm.backend import (FP8_KV_CACHE_DTYPES, KvmultiAttentionImpl, KvmultiStepMetadata,
                                               SUPPORTED_VLLM_LAYOUTS)
from kvmulti.layout import KVCacheLayout
from kvmulti.metadata import CommonAttentionMetadata

NUM_LAYERS, NUM_BLOCKS, BLOCK, HKV, GROUP, D = 3, 16, 16, 2, 2, 64


def vllm_layer_views(physical: str, dtype: torch.dtype, fp8: torch.dtype | None) -> list[torch.Tensor]:
    """The per-layer [B, H, N, C] views vLLM makes for ``physical`` (its layout name, L B H N C), of
    random data (fp8 caches: uint8 bytes of random fp8 codes, as vLLM allocates them)."""
    sizes = dict(L=NUM_LAYERS, B=NUM_BLOCKS, H=HKV, N=BLOCK, C=2 * D)
    flat = torch.randn(NUM_LAYERS * NUM_BLOCKS * HKV * BLOCK * 2 * D)
    flat = flat.to(fp8).view(torch.uint8) if fp8 else flat.to(dtype)
    allocation = flat.view(*(sizes[c] for c in physical)).permute(*(physical.index(c) for c in "LBHNC"))
    return [allocation[i] for i in range(NUM_LAYERS)]


def check(physical: str, kv_cache_dtype: str) -> str | None:
    gen = torch.Generator().manual_seed(len(physical) + len(kv_cache_dtype))
    fp8 = FP8_KV_CACHE_DTYPES.get(kv_cache_dtype)
    views = vllm_layer_views(physical, torch.bfloat16, fp8)
    before = [v.clone() for v in views]
    impl = KvmultiAttentionImpl(HKV * GROUP, D, D ** -0.5, HKV, sliding_window=24, kv_cache_dtype=kv_cache_dtype,
                                logits_soft_cap=15.0)
    layer = types.SimpleNamespace(_k_scale_float=0.75, _v_scale_float=1.5)
    query_lens, seq_lens = [1, 6, 3], [40, 6, 70]
    table = torch.randperm(NUM_BLOCKS, generator=gen)[: 3 * 5].view(3, 5).to(torch.int32)
    md = CommonAttentionMetadata.from_lens(query_lens, seq_lens, table, BLOCK)
    tokens = md.num_actual_tokens
    key = torch.randn(tokens + 2, HKV, D, generator=gen).bfloat16()          # vLLM pads past num_actual_tokens
    value = torch.randn(tokens + 2, HKV, D, generator=gen).bfloat16()
    query = torch.randn(tokens + 2, HKV * GROUP * D, generator=gen).bfloat16()
    output = torch.full((tokens + 2, HKV * GROUP * D), 7.0, dtype=torch.bfloat16)

    cache = views[1]
    impl.forward(layer, query, key, value, cache, KvmultiStepMetadata(md), output)

    ours = cache.view(fp8) if fp8 else cache
    layout = KVCacheLayout.of_view(ours.transpose(1, 2), D)
    want = before[1].view(fp8) if fp8 else before[1]                      # a dense per-layer copy
    want_view = want.transpose(1, 2)
    ref_layout = KVCacheLayout.of_view(want_view, D)
    scales = dict(k_scale=0.75, v_scale=1.5) if fp8 else {}
    reference.write_kv(key[:tokens], value[:tokens], want_view, ref_layout, md.slot_mapping,
                       scales.get("k_scale"), scales.get("v_scale"))
    if not torch.equal(ours.view(torch.uint8), want.view(torch.uint8)):
        return f"{physical} {kv_cache_dtype}: cache after forward differs from the oracle's write"
    for i in (0, 2):
        if not torch.equal(views[i].view(torch.uint8), before[i].view(torch.uint8)):
            return f"{physical} {kv_cache_dtype}: layer {i} changed"
    expected = reference.paged_attention(query[:tokens].view(tokens, HKV * GROUP, D), want_view, ref_layout, md,
                                         scale=D ** -0.5, sliding_window=24, softcap=15.0, **scales)
    got = output[:tokens].view(tokens, HKV * GROUP, D).float()
    err = (got - expected.float()).abs().max().item()
    if err > 0.05 or not torch.all(output[tokens:] == 7.0):
        return f"{physical} {kv_cache_dtype}: forward differs from the oracle (max error {err}) or wrote padding rows"
    if (layout.cross_layer_order is None) != physical.startswith("LB"):
        return f"{physical}: named {layout}"
    return None


def main() -> None:
    checked, failures = [], []
    for vllm_layout in SUPPORTED_VLLM_LAYOUTS:
        for kv_cache_dtype in ("auto", "fp8", "fp8_e5m2"):
            failure = check(vllm_layout.name, kv_cache_dtype)
            checked.append(f"{vllm_layout.name}/{kv_cache_dtype}")
            if failure:
                failures.append(failure)
    print(json.dumps({"checked": checked, "failures": failures}))


if __name__ == "__main__":
    main()
