"""The real-shape configs ``benchmarks/vllm_e2e.py --model-config`` runs: they parse as the model
they name, and the KV-cache size the benchmark budgets for them is the model's."""

import importlib.util
import json
from pathlib import Path

import pytest
import transformers

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "benchmarks" / "model_configs"


def vllm_e2e():
    spec = importlib.util.spec_from_file_location("vllm_e2e", REPO / "benchmarks" / "vllm_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# name -> (architecture, layers, KV heads, head size): the published models' shapes
SHAPES = {"llama-3.2-1b": ("LlamaForCausalLM", 16, 8, 64), "qwen3-0.6b": ("Qwen3ForCausalLM", 28, 8, 128)}


def test_every_shipped_config_is_listed():
    assert sorted(p.name for p in CONFIGS.iterdir()) == sorted(SHAPES)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_config_parses_as_its_model_and_sizes_its_kv_cache(name):
    arch, layers, kv_heads, head = SHAPES[name]
    config = transformers.AutoConfig.from_pretrained(CONFIGS / name)
    assert config.architectures == [arch]
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (layers, kv_heads, head)
    raw = json.loads((CONFIGS / name / "config.json").read_text())
    assert vllm_e2e().kv_bytes_per_token(raw) == 2 * layers * kv_heads * head * 2      # K and V, bf16
