"""One flat model configuration for every supported family, read from an HF ``config.json``.

Families differ only by switches here: biases (Qwen2), sliding windows (Mistral, Qwen2 upper
layers), Gemma norms/scaling/softcaps (Gemma2), q/k norms and per-layer-type RoPE (Gemma3). Both
the transformers-5 ``rope_parameters`` format and the older ``rope_theta``/``rope_scaling``/
``rope_local_base_freq`` fields are understood.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

FULL, SLIDING = "full_attention", "sliding_attention"

#: HF ``model_type`` -> family.
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "gemma2": "gemma2",
            "gemma3_text": "gemma3", "gemma3": "gemma3"}

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu", "gelu_new")


@dataclass(frozen=True)
class RopeParams:
    """Rotary embedding of one layer type: ``default``, ``linear`` or ``llama3`` scaling."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, params: dict | None, default_theta: float) -> "RopeParams":
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: default, linear, "
                                      "llama3)")
        return cls(theta=float(params.get("rope_theta", default_theta)), rope_type=rope_type,
                   factor=float(params.get("factor", 1.0)),
                   low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)))

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies [head_dim // 2], float32, computed as transformers does."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


@dataclass(frozen=True)
class ModelConfig:
    """Everything the shared decoder needs; built by :meth:`from_hf` from a config dict."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope: dict = field(default_factory=dict)          # layer type -> RopeParams
    query_scale: float | None = None                  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    gemma: bool = False          # (1 + w) norms, sandwich norms, embeddings scaled by sqrt(hidden)
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096
    byte_vocab: dict | None = None                    # kvmulti_vocab {"type": "bytes", "bos", "eos", ...}

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - {FULL, SLIDING})
        if bad:
            raise ValueError(f"unknown layer types {bad}; known: {FULL}, {SLIDING}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need config.sliding_window")
        if self.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(f"activation {self.hidden_act!r} not supported (supported: {ACTIVATIONS})")

    # -- per layer -------------------------------------------------------------------------
    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def rope_for(self, layer_type: str) -> RopeParams:
        return self.rope.get(layer_type) or self.rope[FULL]

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.query_scale is None else self.query_scale

    # -- reading HF configs ----------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as fh:
            return cls.from_hf(json.load(fh))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Map an HF config dict (llama, qwen2, mistral, gemma2, gemma3_text, gemma3) to a ModelConfig."""
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise NotImplementedError(f"model_type {model_type!r} is not supported (supported: "
                                      f"{', '.join(FAMILIES)})")
        family = FAMILIES[model_type]
        top = cfg
        if model_type == "gemma3":                      # multimodal wrapper: the text model's config
            cfg = {**cfg.get("text_config", {}), "model_type": "gemma3_text"}
        gemma = family in ("gemma2", "gemma3")
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or hidden // heads
        window = cfg.get("sliding_window")
        if family == "qwen2" and not cfg.get("use_sliding_window", False) and "layer_types" not in cfg:
            window = None
        layer_types = tuple(cfg.get("layer_types") or _default_layer_types(family, cfg, layers, window))
        if SLIDING not in layer_types:
            window = None
        eos = cfg.get("eos_token_id", top.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            family=family, vocab_size=cfg["vocab_size"], hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            qkv_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            o_bias=False if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            layer_types=layer_types, sliding_window=window, rope=_rope(cfg, family),
            query_scale=cfg["query_pre_attn_scalar"] ** -0.5 if gemma and cfg.get("query_pre_attn_scalar") else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if family == "gemma2" else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            gemma=gemma, qk_norm=family == "gemma3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", top.get("tie_word_embeddings", gemma))),
            bos_token_id=cfg.get("bos_token_id", top.get("bos_token_id")), eos_token_ids=eos_ids,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            byte_vocab=top.get("kvmulti_vocab"),
        )


def _default_layer_types(family: str, cfg: dict, layers: int, window: int | None) -> list[str]:
    """Layer types of configs written before ``layer_types`` existed."""
    if window is None:
        return [FULL] * layers
    if family == "gemma2":                                   # even layers local, odd global
        return [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    if family == "gemma3":
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if family == "qwen2":
        first = cfg.get("max_window_layers", layers)
        return [SLIDING if i >= first else FULL for i in range(layers)]
    if family == "mistral":
        return [SLIDING] * layers
    return [FULL] * layers


def _rope(cfg: dict, family: str) -> dict[str, RopeParams]:
    """RoPE per layer type from ``rope_parameters`` (flat or per type) or the older fields."""
    theta = cfg.get("rope_theta", 10000.0)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        return {t: RopeParams.from_hf(p, theta) for t, p in params.items() if p is not None}
    if params is None:
        params = cfg.get("rope_scaling")
    full = RopeParams.from_hf({**(params or {}), "rope_theta": (params or {}).get("rope_theta", theta)}, theta)
    rope = {FULL: full, SLIDING: full}
    if family == "gemma3":
        rope[SLIDING] = RopeParams(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    return rope
