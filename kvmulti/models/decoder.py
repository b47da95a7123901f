"""The shared decoder-only transformer (Llama, Qwen2, Mistral, Gemma2, Gemma3 text).

Flat layers over packed tokens: every forward takes ``input_ids`` [T] and ``positions`` [T] of a
whole mixed batch (prefill chunks and decodes side by side) plus an :class:`AttentionContext`.
Each attention layer writes its new K/V with ``kvmulti.write_kv`` and attends with
``kvmulti.paged_attention`` on its OWN cache, using its KV group's step metadata (prepared once per step: layout, backend, plan).
Module and parameter names follow transformers, so HF checkpoints load by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..backends.base import StepMetadata
from .config import ModelConfig


@dataclass
class AttentionContext:
    """What the attention layers of one forward read: per group the step's prepared metadata (its
    layout and backend included), per layer the cache."""

    steps: dict[int, StepMetadata]                   # group id -> this step's prepared metadata
    layer_to_group: dict[str, int]                   # layer name -> group id
    kv_caches: dict[str, torch.Tensor]               # layer name -> its cache


class RMSNorm(nn.Module):
    """RMSNorm in fp32; Gemma scales by ``1 + weight`` (weights stored as offsets from 1)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.eps, self.gemma = eps, gemma
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gemma and x.dtype == torch.float32 == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)      # one op, the same fp32 math
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.gemma:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] of ``positions`` (fp32 math, as transformers)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [T, H, D] with cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer_name = f"model.layers.{layer}.self_attn"
        self.layer_type = cfg.layer_types[layer]
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale, self.softcap = cfg.scale, cfg.attn_softcap
        self.sliding_window = cfg.layer_window(layer)
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.gemma)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        step, cache = ctx.steps[ctx.layer_to_group[self.layer_name]], ctx.kv_caches[self.layer_name]
        ops.write_kv(k, v, cache, step.layout, step.common.slot_mapping, step=step)
        out = ops.paged_attention(q, cache, step.layout, step, scale=self.scale, sliding_window=self.sliding_window,
                                  softcap=self.softcap)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.act == "silu":
            gate = F.silu(gate)
        elif self.act == "gelu":
            gate = F.gelu(gate)
        else:                                              # gelu_pytorch_tanh, gelu_new
            gate = F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block; Gemma adds post-attention and pre/post-feedforward ("sandwich") norms."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.gemma = cfg.gemma
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, cfg.gemma)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, cfg.gemma)
        if cfg.gemma:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, True)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        if self.gemma:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)


class CausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states; :meth:`compute_logits` the logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope_tables: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]

    def _rope(self, layer_type: str, positions: torch.Tensor, dtype: torch.dtype, num_positions: int):
        """cos/sin [T, head_dim] of ``positions`` (all < ``num_positions``), gathered from a table
        computed once per power-of-two range of positions (the same fp32 math per position)."""
        key = (layer_type, positions.device, dtype)
        table = self._rope_tables.get(key)                   # [positions, 2 * head_dim]: cos | sin
        if table is None or table.shape[0] < num_positions:
            size = max(256, 1 << (num_positions - 1).bit_length())
            inv_freq = self.config.rope_for(layer_type).inv_freq(self.config.head_dim).to(positions.device)
            table = torch.cat(rope_cos_sin(inv_freq, torch.arange(size, device=positions.device), dtype), dim=-1)
            self._rope_tables[key] = table
        rows = table[positions]
        return rows[:, : self.config.head_dim], rows[:, self.config.head_dim:]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for packed tokens ``input_ids`` [T]."""
        x = self.model.embed_tokens(input_ids)
        if self.config.gemma:
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        num_positions = max(step.common.max_seq_len for step in ctx.steps.values())
        rope = {t: self._rope(t, positions, x.dtype, num_positions) for t in set(self.config.layer_types)}
        for layer in self.model.layers:
            x = layer(x, *rope[layer.self_attn.layer_type], ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


__all__ = ["AttentionContext", "CausalLM"]
