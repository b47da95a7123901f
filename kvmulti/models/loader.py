"""Load an HF model directory (``config.json`` + ``*.safetensors``, sharded or not) into a CausalLM.

Weights are matched by their HF parameter names; nothing is downloaded. Missing weights are an
error (except ``lm_head.weight`` with tied embeddings), and so are unexpected ones (except
rotary ``inv_freq`` buffers and, for a multimodal Gemma3 checkpoint, the vision tower).
"""

from __future__ import annotations

import glob
import json
import os

import torch
from torch import nn

from .config import ModelConfig
from .decoder import CausalLM

#: Checkpoint name prefixes mapped to this package's ``model.`` (multimodal Gemma3 wrappers).
PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."))
IGNORED = ("rotary_emb.inv_freq", "vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")


def safetensors_files(path: str | os.PathLike) -> list[str]:
    """The weight files of ``path``: the shards named by ``model.safetensors.index.json``, else every
    ``*.safetensors`` file."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            shards = sorted(set(json.load(fh)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def iter_weights(path: str | os.PathLike):
    """Yield ``(hf_name, tensor)`` for every tensor of every weight file (CPU)."""
    from safetensors import safe_open
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _canonical(name: str) -> str | None:
    for old, new in PREFIXES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if any(name.startswith(p) or name.endswith(p) for p in IGNORED):
        return None
    return name


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> CausalLM:
    """Build the model described by ``path/config.json`` and load its safetensors weights."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    cfg = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = dict(model.named_parameters(remove_duplicate=False))
    state, unexpected = {}, []
    for name, tensor in iter_weights(path):
        key = _canonical(name)
        if key is None:
            continue
        if key not in expected:
            unexpected.append(name)
            continue
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(f"{path}: weight {name} has shape {tuple(tensor.shape)}, the config implies "
                             f"{tuple(expected[key].shape)}")
        state[key] = tensor.to(device=device, dtype=dtype)
    if unexpected:
        raise ValueError(f"{path}: unexpected weights {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)       # tied: the embedding is the head
    missing = [k for k in expected if k not in state and not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"{path}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        store_input_major(model)
    return model


def store_input_major(model: nn.Module) -> None:
    """Give every untied ``nn.Linear`` weight input-major storage ([in, out] in memory, still the
    [out, in] tensor nn.Linear expects). ``x @ W.T`` is then a plain (non-transposed) GEMM for the
    BLAS, which on CPU runs the few-row matmuls of decode and k + 1-token verification markedly
    faster (benchmarks/spec_decode.py); values are unchanged."""
    tied = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in tied:
            module.weight = nn.Parameter(module.weight.t().contiguous().t(), requires_grad=False)
