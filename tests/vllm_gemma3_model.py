"""Save a tiny random Gemma-3-style text model (sliding-window and full-attention layers, so vLLM
makes two KV-cache groups) into the directory given as the only argument. Run by
tests/test_vllm_engine.py in vLLM's venv, whose transformers vLLM loads the model with."""

from __future__ import annotations

import sys

import torch
import transformers


def main(path: str) -> None:
    config = transformers.Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, max_position_embeddings=512, initializer_range=0.15, pad_token_id=0, bos_token_id=256,
        eos_token_id=2, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=15.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():                    # perturb norms and biases too, so no term is inert
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)


if __name__ == "__main__":
    main(sys.argv[1])
