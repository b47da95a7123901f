"""Save a tiny random BERT-style encoder (``BertModel``: non-causal attention, vLLM's
``EncoderOnlyAttention``, served as an embedding model) into the directory given as the only
argument. Run by tests/test_vllm_engine.py in vLLM's venv (its transformers). Weights are drawn
wide (initializer_range 0.2): on a 30-token prompt a row's largest probability is ~0.6 (median; 1/30
if uniform), so attention rows are far from uniform and not one-hot: an attention error shows in
the embeddings."""

from __future__ import annotations

import sys

import torch
import transformers

from vllm_tiny_encoder import save_perturbed


def main(path: str) -> None:
    config = transformers.BertConfig(
        vocab_size=320, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128, type_vocab_size=2, initializer_range=0.2, pad_token_id=0,
        layer_norm_eps=1e-12, hidden_act="gelu")
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    save_perturbed(model, path, "LayerNorm", config.vocab_size)


if __name__ == "__main__":
    main(sys.argv[1])
