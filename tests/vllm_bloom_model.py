"""Save a tiny random Bloom-style model (ALiBi on every layer, no position embeddings) into the
directory given as the first argument; with ``--draft`` as the second, a one-layer model of the same
vocabulary drawn from another seed (a draft for vLLM's ``draft_model`` speculative decoding). Run by tests/test_vllm_engine.py in vLLM's venv, whose
transformers vLLM loads the model with. Weights are drawn wide (initializer_range 0.15) and the
slopes are Bloom's own (8 heads: 2^-1 .. 2^-8), so attention rows are far from uniform and
the bias moves them: an error in either shows in the greedy ids. The output head is tied to the
embeddings, as vLLM's Bloom expects."""

from __future__ import annotations

import sys

import torch
import transformers


def main(path: str, draft: bool = False) -> None:
    config = transformers.BloomConfig(
        vocab_size=320, hidden_size=256, n_layer=1 if draft else 3, n_head=8,   # head size 32 (CPU_ATTN has none of 16)
        initializer_range=0.15, pad_token_id=0,
        bos_token_id=256, eos_token_id=2, tie_word_embeddings=True)   # vLLM ties lm_head
    torch.manual_seed(1 if draft else 0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):   # no inert term
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)


if __name__ == "__main__":
    main(sys.argv[1], draft=sys.argv[2:] == ["--draft"])
