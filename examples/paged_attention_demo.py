"""A mixed batch (a prefill, a chunked prefill, two decodes) through kvmulti, checked against the oracle."""

import torch

import kvmulti
from kvmulti import reference


def main() -> None:
    torch.manual_seed(0)
    layout = kvmulti.KVCacheLayout(num_blocks=32, block_size=16, num_kv_heads=2, head_size=64,
                                   dtype=torch.bfloat16, order="HND")
    cache = layout.allocate("cpu")
    query_lens, seq_lens = [12, 4, 1, 1], [12, 40, 70, 9]
    block_table = torch.randperm(layout.num_blocks, dtype=torch.int32)[:4 * 5].view(4, 5)
    md = kvmulti.CommonAttentionMetadata.from_lens(query_lens, seq_lens, block_table, layout.block_size)
    context = kvmulti.CommonAttentionMetadata.from_lens(seq_lens, seq_lens, block_table, layout.block_size)
    # Fill every request's context, then attend with the last query_lens tokens of each.
    n = context.num_actual_tokens
    kvmulti.write_kv(torch.randn(n, 2, 64, dtype=torch.bfloat16), torch.randn(n, 2, 64, dtype=torch.bfloat16),
                     cache, layout, context.slot_mapping)
    query = torch.randn(md.num_actual_tokens, 8, 64, dtype=torch.bfloat16)
    out = kvmulti.paged_attention(query, cache, layout, md, sliding_window=32, softcap=30.0)
    expected = reference.paged_attention(query, cache, layout, md, sliding_window=32, softcap=30.0)
    err = (out.float() - expected.float()).abs().max().item()
    print(f"paged_attention: query {tuple(query.shape)} -> out {tuple(out.shape)} {out.dtype}; "
          f"backend {kvmulti.select_backend(kvmulti.AttentionConfig.from_layout(layout, 'cpu', 32, 30.0))}; "
          f"max |out - oracle| = {err:.2e}")


if __name__ == "__main__":
    main()
