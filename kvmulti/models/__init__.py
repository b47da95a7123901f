"""Small transformer models that run on the kvmulti API, loaded from HF model directories.

Llama, Qwen2, Mistral, Gemma2 and Gemma3 (text) share one decoder (:mod:`.decoder`) with
per-family switches in :class:`ModelConfig`; :func:`load_model` reads ``config.json`` and the
safetensors weights by their HF names.
"""

from .config import FULL, SLIDING, ModelConfig, RopeParams
from .decoder import AttentionContext, CausalLM
from .loader import load_model

__all__ = ["AttentionContext", "CausalLM", "FULL", "ModelConfig", "RopeParams", "SLIDING", "load_model"]
