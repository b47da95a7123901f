"""Save a tiny random gpt-oss-style model (attention sinks on every layer; sliding-window and
full-attention layers alternating, so vLLM makes two KV-cache groups; a small mixture of experts)
into the directory given as the only argument. Run by tests/test_vllm_engine.py in vLLM's venv,
whose transformers vLLM loads the model with. Weights are drawn wide (initializer_range 0.15) and
the sinks are of the scores' size, so attention rows are far from uniform and a sink takes a
visible share of some rows: an error in either shows in the greedy ids."""

from __future__ import annotations

import sys

import torch
import transformers


def main(path: str) -> None:
    config = transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=4, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=512, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                      "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False},
        initializer_range=0.15, pad_token_id=0, bos_token_id=256, eos_token_id=2,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 1.5 + 0.5)
            elif "norm" in name or name.endswith("bias"):   # no inert term
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)


if __name__ == "__main__":
    main(sys.argv[1])
