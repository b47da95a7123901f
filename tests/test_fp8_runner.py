"""fp8 KV caches in ModelRunner / SpeculativeRunner / ``kvmulti generate`` (shipped tiny pair, CPU)."""

from __future__ import annotations

import pytest
import torch

from kvmulti import cli
from kvmulti.generate_cli import shipped_model
from kvmulti.engine import ModelRunner, resolve_kv_cache_dtype
from kvmulti.spec_decode.runner import SpeculativeRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [256, *b"def fibonacci(n):\n    "]


def test_kv_cache_dtype_names_and_checks():
    assert resolve_kv_cache_dtype(None, torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32) is torch.float32
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert resolve_kv_cache_dtype(torch.float8_e5m2, torch.float16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("fp8", torch.float32)
    with pytest.raises(ValueError, match="model's dtype"):
        resolve_kv_cache_dtype(torch.float16, torch.float32)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_runner_with_an_fp8_cache_stays_close_to_the_bf16_one(kv):
    target = str(shipped_model("target"))
    plain = ModelRunner(target, backend="CPU", dtype=torch.bfloat16)
    quantised = ModelRunner(target, backend="CPU", dtype=torch.bfloat16, kv_cache_dtype=kv)
    assert {lay.dtype for lay in quantised.layouts.values()} == {getattr(torch, {"fp8_e4m3": "float8_e4m3fn",
                                                                              "fp8_e5m2": "float8_e5m2"}[kv])}
    assert all(c.dtype == quantised.layouts[0].dtype for c in quantised.kv_caches.values())
    probs = []
    for runner in (plain, quantised):
        runner.add_request(0, PROMPT)
        first = runner.forward({0: len(PROMPT)}, num_logits=len(PROMPT))      # prefill reads the cache
        second = runner.run({0: [32]})                                          # a decode step too
        probs.append(torch.cat([first, second]).softmax(-1))
    # the distributions barely move: fp8 keeps 3 (e4m3) / 2 (e5m2) mantissa bits of K and V
    assert (probs[0] - probs[1]).abs().sum(-1).max() < {"fp8_e4m3": 0.15, "fp8_e5m2": 0.3}[kv]


def test_target_and_draft_choose_their_cache_dtypes_independently():
    target, draft = str(shipped_model("target")), str(shipped_model("draft"))
    runner = SpeculativeRunner(target=target, draft=draft, num_speculative_tokens=2, dtype=torch.bfloat16,
                               target_backend="CPU", draft_backend="CPU", kv_cache_dtype="auto",
                               draft_kv_cache_dtype="fp8_e5m2")
    assert {lay.dtype for lay in runner.target.layouts.values()} == {torch.bfloat16}
    assert {lay.dtype for lay in runner.draft.layouts.values()} == {torch.float8_e5m2}
    greedy = SpeculativeRunner(target=target, draft=None, dtype=torch.bfloat16, target_backend="CPU")
    prompts = ["def f(x):\n", "import os\n"]
    # the target's cache is bf16 in both: greedy speculative output equals target-only output
    assert runner.generate(prompts, max_new_tokens=12) == greedy.generate(prompts, max_new_tokens=12)
    assert runner.stats.acceptance_rate is not None and runner.stats.acceptance_rate > 0
    inherits = SpeculativeRunner(target=target, draft=draft, dtype=torch.bfloat16, kv_cache_dtype="fp8_e4m3",
                                 target_backend="CPU", draft_backend="CPU")
    assert {lay.dtype for lay in inherits.draft.layouts.values()} == {torch.float8_e4m3fn}


def test_generate_cli_with_fp8_caches(capsys):
    assert cli.main(["generate", "def f(x):", "--max-new-tokens", "8", "--no-baseline", "--dtype", "bfloat16",
                     "--kv-cache-dtype", "fp8_e4m3", "--draft-kv-cache-dtype", "fp8_e5m2"]) == 0
    out = capsys.readouterr().out
    assert "kv_dtype=float8_e4m3fn" in out and "kv_dtype=float8_e5m2" in out, out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "x", "--kv-cache-dtype", "int8"])
    assert exit_info.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err
