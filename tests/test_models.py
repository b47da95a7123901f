"""HF-format models on the kvmulti API against transformers (eager attention, float32).

Tiny random models of every supported family are built from configs offline and saved with
``save_pretrained``; kvmulti loads the directories and must reproduce transformers' logits for
a batch of prompts of different lengths -- full prefill, chunked prefill and token-by-token
decode with requests joining and finishing -- on every attention backend usable on this host,
and greedy generation must equal ``generate(do_sample=False)`` token for token.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import kvmulti
from kvmulti.engine import ModelRunner
from kvmulti.models import ModelConfig, load_model
from kvmulti.spec_decode.runner import SpeculativeRunner

transformers = pytest.importorskip("transformers")

VOCAB = 320
PROMPTS = [[5, 17, 33, 2 + 7, 250, 11, 90, 4, 61, 77, 12, 300, 8, 19, 140, 3, 99, 45, 21],
           [7, 8, 9],
           [101, 55, 66, 12, 250, 13, 14, 15, 16, 200, 1, 31],
           [42]]
TOL = dict(atol=2e-4, rtol=2e-4)


pytestmark = pytest.mark.usefixtures("one_torch_thread")

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, max_position_embeddings=512, initializer_range=0.15, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)

#: family -> (config class name, extra config). Windows are small so prompts cross them.
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2)),
    "llama3rope_tied": ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2)),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=6)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=4.0, final_logit_softcapping=12.0)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=4, sliding_window=5, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                     "sliding_attention"],
                                        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                                         "full_attention": dict(rope_type="linear", factor=2.0,
                                                                                rope_theta=1e6)},
                                        final_logit_softcapping=15.0)),
}


def usable_backends() -> list[str]:
    """Backends that report themselves usable for CPU tensors here (CPU always; TRITON under
    TRITON_INTERPRET=1, SYCL, HIP harness when built)."""
    return [name for name, reasons in kvmulti.available_backends("cpu").items() if not reasons]


BACKENDS = usable_backends()


def build_hf_model(family: str, seed: int = 0):
    """A random transformers model of ``family`` (every parameter perturbed, biases and norm
    weights included, so no term can be ignored by accident)."""
    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_COMMON, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def save_hf_model(model, path, **kwargs) -> str:
    model.save_pretrained(path, **kwargs)
    return str(path)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """family -> (transformers model, saved directory), built once per module."""
    out = {}
    for family in FAMILIES:
        model = build_hf_model(family)
        out[family] = (model, save_hf_model(model, tmp_path_factory.mktemp(family)))
    return out


@torch.no_grad()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


def make_runner(path, backend=None, **kwargs) -> ModelRunner:
    kwargs.setdefault("block_size", {"full": 4, "sliding": 8})
    kwargs.setdefault("num_blocks", 96)
    return ModelRunner(path, backend=backend, **kwargs)


def run_full_prefill(runner: ModelRunner, prompts) -> list[torch.Tensor]:
    for i, p in enumerate(prompts):
        runner.add_request(i, p)
    logits = runner.forward({i: len(p) for i, p in enumerate(prompts)}, {i: len(p) for i, p in enumerate(prompts)})
    for i in range(len(prompts)):
        runner.remove_request(i)
    return list(logits.split([len(p) for p in prompts]))


def run_chunked_prefill(runner: ModelRunner, prompts, budget: int = 5) -> list[torch.Tensor]:
    """Prefill through the scheduler's token budget: chunks of different requests share steps."""
    out = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        runner.add_request(i, p)
    while any(r.num_pending for r in runner.requests.values()):
        schedule = runner.schedule(budget)
        logits = runner.forward(schedule, num_logits=dict(schedule))
        for rid, chunk in zip(schedule, logits.split(list(schedule.values()))):
            out[rid].append(chunk)
    for i in range(len(prompts)):
        runner.remove_request(i)
    return [torch.cat(out[i]) for i in range(len(prompts))]


def run_decode(runner: ModelRunner, prompts, join_every: int = 2) -> list[torch.Tensor]:
    """Every request computes one token per step; request i joins at step i * join_every and
    leaves (its blocks back to the pools) as soon as its last token is computed."""
    out = {i: [] for i in range(len(prompts))}
    step, waiting = 0, list(range(len(prompts)))
    while waiting or runner.requests:
        while waiting and waiting[0] * join_every <= step:
            i = waiting.pop(0)
            runner.add_request(i, prompts[i])
        if runner.requests:
            schedule = {rid: 1 for rid in runner.requests}
            logits = runner.forward(schedule, 1)
            for rid, row in zip(schedule, logits):
                out[rid].append(row)
                if runner.requests[rid].num_pending == 0:
                    runner.remove_request(rid)
        step += 1
    return [torch.stack(out[i]) for i in range(len(prompts))]


MODES = {"full_prefill": run_full_prefill, "chunked_prefill": run_chunked_prefill, "decode": run_decode}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(hf_models, family, backend):
    model, path = hf_models[family]
    expected = [hf_logits(model, p) for p in PROMPTS]
    runner = make_runner(path, backend=backend)
    assert {b.name for b in runner.backends.values()} == {backend}
    free_before = runner.num_free_blocks()
    for mode, run in MODES.items():
        got = run(runner, PROMPTS)
        for i, (g, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(g, e, **TOL, msg=lambda m: f"{family}/{backend}/{mode} prompt {i}: {m}")
        assert runner.num_free_blocks() == free_before, f"{mode}: blocks leaked"


def test_cpu_backend_always_runs():
    assert "CPU" in BACKENDS


GPU_HOST = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


@pytest.mark.skipif("TRITON" in BACKENDS, reason="TRITON is usable in this process: parametrised above")
@pytest.mark.skipif(GPU_HOST, reason="GPU host: TRITON runs compiled kernels, parametrised above when usable")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_interpreter_in_a_fresh_process():
    """The Triton interpreter must be chosen before anything imports triton.language (importing
    kvmulti's ops does), so when this process was started without TRITON_INTERPRET=1 the TRITON
    parity tests of this module run in a fresh process that has it."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    # Every family's logits (all three modes); greedy generation for the two sliding-window
    # families (the interpreter is slow: about two minutes for these eight on 2 cores).
    select = "TRITON and (logits or gemma3 or mistral) and not fresh_process"
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-k", select, "-p", "no:cacheprovider"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(__file__))
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    counts = [line for line in proc.stdout.splitlines() if re.search(r"\d+ passed", line)][-1]
    assert int(re.search(r"(\d+) passed", counts).group(1)) == len(FAMILIES) + 2, tail
    assert "skipped" not in counts and "failed" not in counts, tail


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers(hf_models, family, backend):
    model, path = hf_models[family]
    runner = SpeculativeRunner(path, target_backend=backend, block_size={"full": 4, "sliding": 8}, num_blocks=128)
    assert {b.name for b in runner.target.backends.values()} == {backend}
    prompts = PROMPTS[:3]
    got = runner.generate(prompts, max_new_tokens=12, temperature=0.0)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert g == ref[0, len(p):].tolist(), f"{family}: prompt {p[:4]}..."
    assert runner.stats.num_generated_tokens == sum(len(g) for g in got)
    assert runner.target.num_free_blocks() == {gid: 128 for gid in runner.target.pools}


def test_family_configs(hf_models):
    """What each family's config turns into: windows, groups, scaling, caps, biases, ties."""
    cfgs = {f: ModelConfig.from_pretrained(p) for f, (_, p) in hf_models.items()}
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].o_bias and cfgs["qwen2"].sliding_window is None
    assert set(cfgs["mistral"].layer_types) == {"sliding_attention"} and cfgs["mistral"].sliding_window == 6
    assert cfgs["gemma2"].layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfgs["gemma2"].attn_softcap == 4.0 and cfgs["gemma2"].final_softcap == 12.0
    assert cfgs["gemma2"].scale == pytest.approx(24 ** -0.5)
    assert cfgs["gemma3"].qk_norm and cfgs["gemma3"].attn_softcap is None
    assert cfgs["gemma3"].rope_for("full_attention").rope_type == "linear"
    assert cfgs["gemma3"].rope_for("sliding_attention").theta == 10000.0
    assert cfgs["llama3rope_tied"].tie_word_embeddings and cfgs["llama3rope_tied"].rope_for("full_attention").rope_type == "llama3"
    groups = {f: len(make_runner(p).kv_cache_config.groups) for f, (_, p) in hf_models.items()}
    assert groups == {"llama": 1, "llama3rope_tied": 1, "qwen2": 1, "mistral": 1, "gemma2": 2, "gemma3": 2}


def test_old_style_config_fields():
    """Configs written before transformers 5: rope_theta / rope_scaling / rope_local_base_freq,
    no layer_types (Gemma2 alternates, Gemma3 uses its pattern, Qwen2 its max_window_layers)."""
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
                num_hidden_layers=6)
    g3 = ModelConfig.from_hf({**base, "model_type": "gemma3_text", "sliding_window": 4, "rope_theta": 1e6,
                              "rope_local_base_freq": 1e4, "sliding_window_pattern": 3,
                              "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert g3.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert g3.rope_for("full_attention") .theta == 1e6 and g3.rope_for("full_attention").factor == 8.0
    assert g3.rope_for("sliding_attention").theta == 1e4 and g3.tie_word_embeddings
    g2 = ModelConfig.from_hf({**base, "model_type": "gemma2", "sliding_window": 4})
    assert g2.layer_types[:2] == ("sliding_attention", "full_attention")
    q = ModelConfig.from_hf({**base, "model_type": "qwen2", "sliding_window": 4, "use_sliding_window": True,
                             "max_window_layers": 4})
    assert q.layer_types == ("full_attention",) * 4 + ("sliding_attention",) * 2
    q_off = ModelConfig.from_hf({**base, "model_type": "qwen2", "sliding_window": 4})
    assert q_off.sliding_window is None and set(q_off.layer_types) == {"full_attention"}
    with pytest.raises(NotImplementedError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(NotImplementedError, match="rope_type 'yarn'"):
        ModelConfig.from_hf({**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2}})


def test_sharded_checkpoint_loads_same_logits(hf_models, tmp_path):
    model, path = hf_models["gemma3"]
    sharded = save_hf_model(model, tmp_path / "sharded", max_shard_size="20KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    with open(os.path.join(sharded, "model.safetensors.index.json")) as fh:
        assert len(set(json.load(fh)["weight_map"].values())) > 2
    a, b = (run_full_prefill(make_runner(p), PROMPTS[:2]) for p in (path, sharded))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_tied_embeddings_share_the_weight(hf_models):
    m = load_model(hf_models["llama3rope_tied"][1])
    assert m.lm_head.weight is m.model.embed_tokens.weight
    untied = load_model(hf_models["llama"][1])
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_missing_and_unexpected_weights_are_errors(hf_models, tmp_path):
    from safetensors.torch import load_file, save_file
    _, path = hf_models["qwen2"]
    weights = load_file(os.path.join(path, "model.safetensors"))
    cfg = open(os.path.join(path, "config.json")).read()
    for case, tensors, match in [
            ("missing", {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj.bias" not in k}, "missing weights"),
            ("unexpected", {**weights, "model.layers.9.mlp.up_proj.weight": torch.zeros(2)}, "unexpected weights"),
            ("shape", {**weights, "model.norm.weight": torch.zeros(3)}, "has shape")]:
        d = tmp_path / case
        d.mkdir()
        (d / "config.json").write_text(cfg)
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            load_model(d)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "nowhere")


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_hnd_layout_gives_the_same_logits(hf_models, family):
    model, path = hf_models[family]
    runner = make_runner(path, order="HND")
    assert {lay.order for lay in runner.layouts.values()} == {"HND"}
    for got, p in zip(run_decode(runner, PROMPTS), PROMPTS):
        torch.testing.assert_close(got, hf_logits(model, p), **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3"])
def test_half_precision_runs_close_to_float32(hf_models, family, dtype):
    """Weights and caches in half precision: logits near the fp32 model's (relative to the logit
    scale: measured ~1.8% for bfloat16, ~0.2% for float16)."""
    model, path = hf_models[family]
    runner = make_runner(path, dtype=dtype)
    assert {c.dtype for c in runner.kv_caches.values()} == {dtype}
    for got, p in zip(run_chunked_prefill(runner, PROMPTS[:3]), PROMPTS[:3]):
        ref = hf_logits(model, p)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        bound = 0.04 if dtype == torch.bfloat16 else 0.01
        assert (got - ref).abs().max() <= bound * ref.abs().max(), f"{family} {dtype}"
