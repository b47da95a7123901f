"""What the tiny random encoder checkpoints (tests/vllm_bert_model.py, tests/vllm_modernbert_model.py)
share: every norm and bias perturbed so no term is inert, and a word-piece tokenizer over the model's
ids written from a vocabulary file (vLLM's pooling entry points need one, even for token-id prompts;
no download). Imported by those scripts, which run in vLLM's venv."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def save_perturbed(model: torch.nn.Module, path: str, norm_key: str, vocab_size: int) -> None:
    """Add N(0, 0.2) to every parameter whose name holds ``norm_key`` or ends in ``bias``, then save
    ``model`` and a BertTokenizer over ``vocab_size`` ids into ``path``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if norm_key in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    vocab = Path(path) / "vocab.txt"
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab.write_text("\n".join(special + [f"t{i}" for i in range(len(special), vocab_size)]) + "\n")
    transformers.BertTokenizer(str(vocab)).save_pretrained(path)
