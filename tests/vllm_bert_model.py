"""Save a tiny random BERT-style encoder (``BertModel``: non-causal attention, vLLM's
``EncoderOnlyAttention``, served as an embedding model) into the directory given as the only
argument. Run by tests/test_vllm_engine.py in vLLM's venv (its transformers). Weights are drawn
wide (initializer_range 0.2): on a 30-token prompt a row's largest probability is ~0.6 (median; 1/30
if uniform), so attention rows are far from uniform and not one-hot: an attention error shows in
the embeddings."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers


def main(path: str) -> None:
    config = transformers.BertConfig(
        vocab_size=320, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128, type_vocab_size=2, initializer_range=0.2, pad_token_id=0,
        layer_norm_eps=1e-12, hidden_act="gelu")
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):     # no inert term
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    # vLLM's pooling entry points need a tokenizer, even for token-id prompts: a word-piece one over
    # the model's 320 ids, written from a vocabulary file (no download)
    vocab = Path(path) / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"t{i}" for i in range(5, 320)]) + "\n")
    transformers.BertTokenizer(str(vocab)).save_pretrained(path)


if __name__ == "__main__":
    main(sys.argv[1])
