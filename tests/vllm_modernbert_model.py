"""Save a tiny random ModernBERT-style encoder (``ModernBertModel``: non-causal attention with local,
sliding-window layers, vLLM's ``EncoderOnlyAttention`` with ``per_layer_sliding_window``, served as
an embedding model) into the directory given as the only argument. Run by tests/test_vllm_engine.py
in vLLM's venv (its transformers). ``local_attention=8``: HF's half-width 4, which vLLM hands the
attention backend as W = 5 (|q - k| <= 4), far below the prompts' lengths; layers 1 and 2 of 3 are
local. Weights are drawn wide (initializer_range 0.2) with every norm and bias perturbed, as in
tests/vllm_bert_model.py, so attention rows are far from uniform."""

from __future__ import annotations

import sys

import torch
import transformers

from vllm_tiny_encoder import save_perturbed


def main(path: str) -> None:
    config = transformers.ModernBertConfig(
        vocab_size=320, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128, local_attention=8, global_attn_every_n_layers=3, initializer_range=0.2,
        attention_bias=True, mlp_bias=True, norm_bias=True, pad_token_id=0, bos_token_id=2, eos_token_id=3,
        cls_token_id=2, sep_token_id=3)
    torch.manual_seed(0)
    model = transformers.ModernBertModel(config).eval()
    save_perturbed(model, path, "norm", config.vocab_size)


if __name__ == "__main__":
    main(sys.argv[1])
